"""Request intake, host side (no JAX): a prompt and its SamplingParams checked against
what the model and the engine can do, and turned into the request's sequences (one per
sample of n), each with its seed, stop tokens, bad words' token sequences and grammar
matcher. Everything a bad request can be refused for is found here, before it reaches
the scheduler."""

from __future__ import annotations

import functools

import numpy as np

from jaxmtp.engine.sampling_params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, SamplingParams
from jaxmtp.engine.sequence import Sequence
from jaxmtp.engine.structured_outputs import GrammarCompiler


class RequestIntake:
    def __init__(self, tokenizer, model_name: str, vocab_size: int, max_model_len: int, num_top_logprobs: int,
                 eos_token_ids: frozenset[int], seed: int):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_top_logprobs = num_top_logprobs
        self.eos_token_ids = eos_token_ids
        self._rng = np.random.default_rng(seed)
        self._arrivals = 0  # admission order of every sequence so far

    def encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self._tokenizer_for("a text prompt").encode(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if any(not isinstance(t, (int, np.integer)) or isinstance(t, bool) for t in ids):
            raise ValueError("prompt token ids must be integers")
        return None, [int(t) for t in ids]

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        vocab = self.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of vocabulary (size {vocab}): {bad[:5]}")
        # ids the step indexes its logits with
        for name, ids in (("logit_bias", params.logit_bias or {}), ("allowed_token_ids", params.allowed_token_ids or []),
                          ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name} has token ids out of vocabulary (size {vocab}): {bad[:5]}")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's context of {self.max_model_len} tokens"
            )
        stop_ids = self.stop_ids(params)
        if params.allowed_token_ids and params.min_tokens > 0 and set(params.allowed_token_ids) <= stop_ids:
            raise ValueError(
                "allowed_token_ids: every allowed token is a stop token, which min_tokens holds back: no token is left "
                "to sample"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.num_top_logprobs:
                raise ValueError(f"{name} must be <= {self.num_top_logprobs}, got {value}")

    def stop_ids(self, params: SamplingParams) -> set[int]:
        """The tokens that end a request: its stop_token_ids and, unless ignore_eos, EOS."""
        return set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)

    def sequences(self, request_id: str, prompt_ids: list[int], params: SamplingParams, salt: int) -> list[Sequence]:
        """The request's n sequences; sample j of a seeded request has seed + j."""
        bad_words = bad_words_ids(self._tokenizer_for("bad_words"), params.bad_words) if params.bad_words else ()
        constraint = params.structured_outputs
        # compiled before any sequence exists: a constraint that does not compile is refused whole
        matchers = ([self.grammars.matcher(constraint, params.allowed_token_ids) for _ in range(params.n)]
                    if constraint is not None else None)
        stop_ids = self.stop_ids(params)
        seqs = []
        for i in range(params.n):
            seed = params.seed + i if params.seed is not None else int(self._rng.integers(2**32))
            seq = Sequence(request_id, list(prompt_ids), params, seed % 2**32, self._arrivals, frozenset(stop_ids), salt,
                           bad_words)
            seq.grammar = matchers[i] if matchers else None
            seqs.append(seq)
            self._arrivals += 1
        return seqs

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Structured outputs' compiler, built at the first constrained request."""
        return GrammarCompiler(self._tokenizer_for("structured_outputs").hf.to_str(), self.vocab_size, self.eos_token_ids)

    def _tokenizer_for(self, what: str):
        if self.tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer, and {self.model_name} has no tokenizer.json: pass token ids")
        return self.tokenizer


def bad_words_ids(tokenizer, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token sequences, as vLLM tokenizes them: the word, and the word
    after a space where that is another sequence of as many tokens."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    longest = max(map(len, sequences))
    if len(sequences) > MAX_BAD_WORDS or longest > MAX_BAD_WORD_TOKENS:
        raise ValueError(
            f"bad_words: at most {MAX_BAD_WORDS} token sequences of at most {MAX_BAD_WORD_TOKENS} tokens each are "
            f"supported, got {len(sequences)} of up to {longest} tokens"
        )
    return tuple(sequences)
