"""Postprocessing, host side: a step's tokens appended to their sequences, detokenised
incrementally, checked against stop tokens, max_tokens and stop strings, and turned into
RequestOutputs of each request's RequestOutputKind. Work per emitted token is O(1) in
the length of the output: text is decoded one token at a time, stop strings are looked
for in the new text (and a window of the longest stop string before it), and only
CUMULATIVE outputs copy what came before."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jaxmtp.engine.detokenizer import IncrementalDetokenizer
from jaxmtp.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxmtp.engine.sampling_params import RequestOutputKind
from jaxmtp.engine.sequence import Sequence
from jaxmtp.engine.stop_strings import StopStringMatcher

if TYPE_CHECKING:
    from jaxmtp.worker.step_records import StepResult

TEXT_CONTEXT = 4  # tokens before a logprob's token decoded with it, for its leading space


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: str | None
    seqs: list[Sequence]
    metrics: RequestMetrics
    error: str | None = None  # why the engine failed it (finish_reason "error")

    @property
    def finished(self) -> bool:
        for seq in self.seqs:  # (a loop: all() of a generator costs more, once per request a step)
            if not seq.finished:
                return False
        return True


class OutputProcessor:
    def __init__(self, tokenizer, with_spec_stats: bool, stats):
        """stats: the engine's EngineStats, whose generation_tokens this counts."""
        self.tokenizer = tokenizer
        self.with_spec_stats = with_spec_stats
        self.stats = stats

    def start(self, seq: Sequence) -> None:
        if seq.params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, seq.params.skip_special_tokens)
            seq.stop_matcher = StopStringMatcher(seq.params.stop) if seq.params.stop else None

    def append(self, seq: Sequence, tokens: list[int], result: StepResult, i: int) -> bool:
        """Append the tokens request i emitted (row i of result, which holds their
        logprobs) to seq; True when seq finished."""
        if self._only_text_can_end(seq, tokens):
            return self._append_plain(seq, tokens)
        params = seq.params
        for j, token in enumerate(tokens):
            seq.append_token(token)
            self.stats.generation_tokens += 1
            if params.logprobs is not None:
                entry = self._token_logprobs(seq, result, i, j)
                seq.output_logprobs.append(entry)
                seq.cumulative_logprob += entry[token].logprob
            if token in seq.stop_token_ids:  # its text is part of the output only when asked
                seq.finish_reason, seq.stop_reason = "stop", token
                if params.include_stop_str_in_output:
                    self._add_text(seq, token)
                self._flush_text(seq)
                return True
            if seq.grammar is not None and seq.grammar.accept(token):  # the grammar is complete
                seq.finish_reason = "stop"
                self._add_text(seq, token)
                self._flush_text(seq)
                return True
            if self._add_text(seq, token):
                seq.finish_reason = "length" if len(seq.output_token_ids) >= params.max_tokens else "stop"
                return True
            if len(seq.output_token_ids) >= params.max_tokens:
                seq.finish_reason = "length"
                self._flush_text(seq)
                return True
        return False

    @staticmethod
    def _only_text_can_end(seq: Sequence, tokens: list[int]) -> bool:
        """append's usual case: no logprobs to keep, no grammar, no stop token among the
        tokens and max_tokens not reached with them; only a stop string in their text
        can end seq then."""
        params = seq.params
        return (params.logprobs is None and seq.grammar is None and seq.stop_token_ids.isdisjoint(tokens)
                and len(seq.output_token_ids) + len(tokens) < params.max_tokens)

    def _append_plain(self, seq: Sequence, tokens: list[int]) -> bool:
        """append in its usual case (_only_text_can_end), without the per-token checks
        that cannot fire: the tokens' text is decoded (piece by piece, as always), and
        looked at token by token only when a stop string ends in it."""
        pieces = seq.detokenizer.add_all(tokens) if seq.detokenizer is not None else ()
        text = "".join(pieces)
        matcher = seq.stop_matcher
        if matcher is not None and matcher.find(text) is not None:
            for n, (token, piece) in enumerate(zip(tokens, pieces), 1):
                seq.append_token(token)  # one at a time: a stop string's min_tokens check counts them
                if self._append_text(seq, piece):
                    seq.finish_reason = "stop"
                    self.stats.generation_tokens += n
                    return True
            self.stats.generation_tokens += len(tokens)
            return False
        seq.token_ids += tokens
        seq.output_token_ids += tokens
        self.stats.generation_tokens += len(tokens)
        if text:
            if matcher is not None:
                matcher.advance(text)
            seq.text += text
        return False

    def append_prompt_logprobs(self, seq: Sequence, start: int, first_row: int, num_rows: int, result: StepResult) -> None:
        """Keep the prompt logprobs of seq's rows (positions start.., from batch row
        first_row): row p scores prompt token p + 1. A recompute's rows score tokens
        already kept, and a chunk's rows past the prompt score none."""
        n, prompt = seq.params.prompt_logprobs, seq.prompt_token_ids
        for p in range(max(start, len(seq.prompt_logprobs) - 1), min(start + num_rows, len(prompt) - 1)):
            row = first_row + p - start
            seq.prompt_logprobs.append(self._logprobs(
                prompt[max(p + 1 - TEXT_CONTEXT, 0) : p + 1], prompt[p + 1], float(result.prompt_logprobs[row]),
                int(result.prompt_ranks[row]), result.prompt_top_token_ids[row, :n].tolist(),
                result.prompt_top_logprobs[row, :n].tolist(),
            ))

    def _token_logprobs(self, seq: Sequence, result: StepResult, i: int, j: int) -> dict[int, Logprob]:
        """The logprobs of the token seq just appended (row j of request i)."""
        n = seq.params.logprobs
        return self._logprobs(
            seq.token_ids[-TEXT_CONTEXT - 1 : -1], seq.token_ids[-1], float(result.logprobs[i, j]), int(result.ranks[i, j]),
            result.top_token_ids[i, j, :n].tolist() if n else [], result.top_logprobs[i, j, :n].tolist() if n else [],
        )

    def _logprobs(self, context: list[int], token: int, logprob: float, rank: int, top_ids: list[int],
                  top_values: list[float]) -> dict[int, Logprob]:
        """token's Logprob with its rank from the device, then those of the top n (ranks
        1..n) it is not one of; each with the text it adds after the context tokens."""
        found: dict[int, tuple[float, int]] = {token: (logprob, rank)}
        for t, value, r in zip(top_ids, top_values, range(1, len(top_ids) + 1)):
            found.setdefault(t, (value, r))
        if self.tokenizer is None:
            texts = [None] * len(found)
        else:  # special tokens by name: the logprobs show what was sampled
            texts = self.tokenizer.token_texts(context, list(found), TEXT_CONTEXT, False)
        return {t: Logprob(value, r, text) for (t, (value, r)), text in zip(found.items(), texts)}

    def _add_text(self, seq: Sequence, token: int) -> bool:
        """Detokenise one more token; True when the text reached a stop string (cut there)."""
        return seq.detokenizer is not None and self._append_text(seq, seq.detokenizer.add(token))

    def _flush_text(self, seq: Sequence) -> None:
        """The sequence ended: the text the detokenizer still held joins the output."""
        if seq.detokenizer is not None:
            self._append_text(seq, seq.detokenizer.finish())

    @staticmethod
    def _append_text(seq: Sequence, piece: str) -> bool:
        if not piece:
            return False
        match = seq.stop_matcher.feed(piece) if seq.stop_matcher else None
        seq.text += piece
        # min_tokens holds back stop strings too, as vLLM's: a match counts once more
        # tokens than min_tokens are out (one that ends within the first min_tokens
        # tokens' text never does)
        if match is None or len(seq.output_token_ids) <= seq.params.min_tokens:
            return False
        end = match.start + len(match.stop) if seq.params.include_stop_str_in_output else match.start
        seq.text, seq.stop_reason = seq.text[:end], match.stop
        return True

    # ----- outputs --------------------------------------------------------------------------

    def output(self, request: Request) -> RequestOutput | None:
        """The request's output after a step that advanced it, of its output kind; None
        when that kind reports nothing now (FINAL_ONLY before the end, an empty delta)."""
        kind = request.seqs[0].params.output_kind
        finished = request.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        first = request.seqs[0]
        # a stream sends the prompt's logprobs once, with its first tokens
        with_prompt_logprobs = first.params.prompt_logprobs is not None and (
            kind is not RequestOutputKind.DELTA or first.num_reported_tokens == 0
        )
        completions = [self._completion(index, seq, kind) for index, seq in enumerate(request.seqs)]
        if kind is RequestOutputKind.DELTA and not finished and not any(c.token_ids or c.text for c in completions):
            return None
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=finished,
            spec_stats=first.spec_stats.as_dict() if self.with_spec_stats else None,
            num_cached_tokens=first.num_cached_tokens,
            error=request.error,
            prompt_logprobs=list(first.prompt_logprobs) if with_prompt_logprobs else None,
            # a copy (half the cost of dataclasses.replace's, once per request a step)
            metrics=RequestMetrics(**vars(request.metrics)),
        )

    def _completion(self, index: int, seq: Sequence, kind: RequestOutputKind) -> CompletionOutput:
        with_logprobs = seq.params.logprobs is not None
        if kind is RequestOutputKind.DELTA:
            # hold back what a stop string may still cut, until the sequence finishes
            holdback = seq.stop_matcher.holdback() if seq.stop_matcher and not seq.finished else 0
            text_end = max(seq.num_reported_chars, len(seq.text) - holdback)
            first_token, first_char = seq.num_reported_tokens, seq.num_reported_chars
            seq.num_reported_tokens, seq.num_reported_chars = len(seq.output_token_ids), text_end
            text, token_ids = seq.text[first_char:text_end], seq.output_token_ids[first_token:]
            logprobs = seq.output_logprobs[first_token:] if with_logprobs else None
        else:
            text, token_ids = seq.text, list(seq.output_token_ids)
            logprobs = list(seq.output_logprobs) if with_logprobs else None
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=token_ids,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=seq.cumulative_logprob if with_logprobs else None,
        )
