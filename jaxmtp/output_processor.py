"""Postprocessing, host side: a step's tokens appended to their sequences, detokenised
incrementally, checked against stop tokens, max_tokens and stop strings, and turned into
RequestOutputs of each request's RequestOutputKind. Work per emitted token is O(1) in
the length of the output: text is decoded one token at a time, stop strings are looked
for in the new text (and a window of the longest stop string before it), and only
CUMULATIVE outputs copy what came before."""

from __future__ import annotations

import dataclasses

from jaxmtp.detokenizer import IncrementalDetokenizer
from jaxmtp.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxmtp.runner import StepResult
from jaxmtp.sampling_params import RequestOutputKind
from jaxmtp.sequence import Sequence
from jaxmtp.stop_strings import StopStringMatcher

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
        return all(s.finished for s in self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer, with_spec_stats: bool, stats):
        """stats: the engine's EngineStats, whose generation_tokens this counts."""
        self.tokenizer = tokenizer
        self.with_spec_stats = with_spec_stats
        self.stats = stats

    def start(self, seq: Sequence) -> None:
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids)
            seq.stop_matcher = StopStringMatcher(seq.params.stop) if seq.params.stop else None

    def append(self, seq: Sequence, result: StepResult, i: int) -> bool:
        """Append request i's emitted tokens to seq; True when seq finished."""
        params = seq.params
        for j in range(int(result.num_accepted[i]) + 1):
            token = int(result.tokens[i, j])
            seq.append_token(token)
            self.stats.generation_tokens += 1
            if params.logprobs is not None:
                entry = self._token_logprobs(seq, result, i, j)
                seq.output_logprobs.append(entry)
                seq.cumulative_logprob += entry[token].logprob
            if token in seq.stop_token_ids:  # the stop token's text is not part of the output
                seq.finish_reason, seq.stop_reason = "stop", token
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

    def _token_logprobs(self, seq: Sequence, result: StepResult, i: int, j: int) -> dict[int, Logprob]:
        """The Logprob of the token seq just appended (row j of request i), its rank from
        the device, then those of the top n (ranks 1..n) it is not one of; each with the
        text it adds after the tokens before it."""
        n = seq.params.logprobs
        ids = [seq.token_ids[-1]] + (result.top_token_ids[i, j, :n].tolist() if n else [])
        values = [float(result.logprobs[i, j])] + (result.top_logprobs[i, j, :n].tolist() if n else [])
        ranks = [int(result.ranks[i, j])] + list(range(1, n + 1))
        found: dict[int, tuple[float, int]] = {}
        for token, logprob, rank in zip(ids, values, ranks):
            found.setdefault(token, (logprob, rank))
        if self.tokenizer is None:
            texts = [None] * len(found)
        else:  # special tokens by name: the logprobs show what was sampled
            texts = self.tokenizer.token_texts(seq.token_ids[-TEXT_CONTEXT - 1 : -1], list(found), TEXT_CONTEXT, False)
        return {token: Logprob(logprob, rank, text) for (token, (logprob, rank)), text in zip(found.items(), texts)}

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
        if match is None:
            return False
        seq.text, seq.stop_reason = seq.text[: match.start], match.stop
        return True

    # ----- outputs --------------------------------------------------------------------------

    def output(self, request: Request) -> RequestOutput | None:
        """The request's output after a step that advanced it, of its output kind; None
        when that kind reports nothing now (FINAL_ONLY before the end, an empty delta)."""
        kind = request.seqs[0].params.output_kind
        finished = request.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = [self._completion(index, seq, kind) for index, seq in enumerate(request.seqs)]
        if kind is RequestOutputKind.DELTA and not finished and not any(c.token_ids or c.text for c in completions):
            return None
        first = request.seqs[0]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=finished,
            spec_stats=first.spec_stats.as_dict() if self.with_spec_stats else None,
            num_cached_tokens=first.num_cached_tokens,
            error=request.error,
            metrics=dataclasses.replace(request.metrics),
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
