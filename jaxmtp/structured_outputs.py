"""Structured outputs, host side (no JAX): constraints compiled by llguidance, one
matcher per sequence, and the token bitmasks of a step's verify rows.

Row j of a constrained request's verify rows samples after its output so far plus the
drafts of rows 0..j-1, so its mask is the grammar's after those drafts too: the matcher
advances over the drafts on a copy's worth of state and rolls back (llguidance computes
all the rows' masks in one call). A draft the grammar forbids is then rejected at its
row as any mismatch is, and the output is token for token what plain decoding under
the grammar gives (the sampler's keyed draw makes speculation change nothing).

Drafts are also chosen inside the grammar: where the grammar forces the next tokens
(JSON punctuation, a property name) those are the drafts, and otherwise the MTP
module's drafts up to the first one the grammar forbids."""

from __future__ import annotations

import dataclasses
import functools
import json

import llguidance
import llguidance.numpy as llnp
import numpy as np

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass
class StructuredOutputsParams:
    """vLLM's structured_outputs: exactly one of these."""

    json: dict | str | None = None  # a JSON schema (a dict or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, or GBNF / EBNF as llguidance reads them
    json_object: bool = False  # any JSON object

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(KINDS)}, got {given or 'none'}")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or any(not isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name} must be a string")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its text)")

    def grammar_text(self) -> str:
        """The constraint as llguidance's grammar text."""
        if self.json is not None:
            schema = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return llguidance.grammar_from("json_schema", schema)
        if self.json_object:
            return llguidance.grammar_from("json_schema", '{"type": "object"}')
        if self.regex is not None:
            return llguidance.grammar_from("regex", self.regex)
        if self.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(self.choice))
        return llguidance.grammar_from("grammar", self.grammar)


class GrammarCompiler:
    """One per engine: llguidance's view of the tokenizer (built once; it takes about a
    second for a large vocabulary) and a cache of validated grammars."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids):
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_token_ids))
        self.executor = llguidance.LLExecutor()
        self.mask_words = llnp.get_bitmask_shape(1, vocab_size)[1]

    @functools.lru_cache(maxsize=256)
    def _compiled(self, text: str):
        """A matcher at the start of grammar `text`, copied for each sequence (compiling
        a large schema is what costs)."""
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs does not compile: {matcher.get_error()}")
        return matcher

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A matcher at the start of the constraint; ValueError naming the problem when
        the constraint does not compile."""
        try:
            text = params.grammar_text()
        except (ValueError, TypeError) as err:
            raise ValueError(f"structured_outputs: {err}") from err
        return GrammarMatcher(self._compiled(text).deep_copy(), self)


class GrammarMatcher:
    """A sequence's grammar state: advanced by each token it emits."""

    def __init__(self, matcher, compiler: GrammarCompiler):
        self._matcher = matcher
        self._compiler = compiler

    def accept(self, token: int) -> bool:
        """Advance over an emitted token; True when the grammar is complete (stopped)."""
        if not self._matcher.consume_token(token):
            raise ValueError(f"structured_outputs: token {token} does not fit the grammar: {self._matcher.get_error()}")
        return self._matcher.is_stopped()

    def propose(self, drafts: list[int], k: int) -> list[int]:
        """The next step's drafts: tokens the grammar forces, else the MTP drafts up to
        the first the grammar forbids."""
        forced = self._matcher.compute_ff_tokens()[:k]
        if forced:
            return forced
        return drafts[: self._matcher.validate_tokens(drafts)]


def fill_row_masks(rows: list[tuple[GrammarMatcher, int, list[int]]], masks: np.ndarray) -> None:
    """masks [N, W] int32: for each (matcher, first mask row, drafts), the masks of rows
    first..first+len(drafts), row j's after drafts[:j]. Other rows are left as they are."""
    if not rows:
        return
    executor = rows[0][0]._compiler.executor
    with_drafts = [(m._matcher, i, d) for m, i, d in rows if d]
    if with_drafts:
        llnp.fill_next_token_bitmask_par_with_draft_tokens(executor, with_drafts, masks)
    without = [(m._matcher, i) for m, i, d in rows if not d]
    if without:
        llnp.fill_next_token_bitmask_par(executor, without, masks)
