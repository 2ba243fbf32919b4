"""A read step's tokens applied to its sequences: the scheduler's bookkeeping, the
acceptance counters, the request timings and the output processor's appends. The host
does this once per step for every row, so the loop keeps per-row Python to what each
row needs: the step's arrays become lists once, the engine-wide counters are summed per
step, and the output processor's usual case appends a row's tokens and text at once."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from jaxmtp.engine.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from jaxmtp.engine.output_processor import OutputProcessor, Request
    from jaxmtp.engine.outputs import EngineStats
    from jaxmtp.engine.scheduler import ScheduledRows, Scheduler
    from jaxmtp.worker.step_records import InFlightStep, StepResult

FINAL_ONLY = RequestOutputKind.FINAL_ONLY


class StepPostprocessor:
    def __init__(self, scheduler: Scheduler, output_processor: OutputProcessor, requests: dict[str, Request],
                 stats: EngineStats, num_speculative_tokens: int, fail_request: Callable[[Request, Exception], None]):
        """requests: the engine's live requests by id; fail_request: how the engine fails
        one request (a row whose append raised)."""
        self.scheduler = scheduler
        self.output_processor = output_processor
        self.requests = requests
        self.stats = stats
        self.k = num_speculative_tokens
        self.fail_request = fail_request

    def apply(self, record: InFlightStep, result: StepResult, following: dict[int, ScheduledRows]) -> list[Request]:
        """Apply the step's result to its sequences; returns the requests that have an
        output to report (finished, or of an output kind that reports progress), in
        order. following: id(seq) -> its rows in the next step, already dispatched."""
        stats, requests, processor = self.stats, self.requests, self.output_processor
        on_step_output, step_id, k = self.scheduler.on_step_output, record.step_id, self.k
        # as lists, converted once: indexing the arrays row by row costs more than the rest
        num_accepted, tokens, drafts = result.num_accepted.tolist(), result.tokens.tolist(), result.drafts.tolist()
        with_prompt_logprobs = result.prompt_logprobs is not None
        # verify steps by (drafts, accepted), flat: index drafts * (k + 1) + accepted
        spec_steps = [0] * (k + 1) * (k + 1)
        touched: dict[str, Request] = {}
        computed = first_row = 0
        now = time.monotonic()  # when this step's tokens reached the host
        for i, (item, preemptions) in enumerate(zip(record.scheduled.rows, record.preemptions)):
            seq = item.seq
            num_rows = len(item.token_ids)
            first_row += num_rows
            # finished (aborted, or another sequence of its request failed) or preempted
            # since dispatch: its recompute will produce these tokens again
            if seq.finished or seq.num_preemptions != preemptions:
                continue
            computed += num_rows
            if with_prompt_logprobs and seq.params.prompt_logprobs is not None:
                processor.append_prompt_logprobs(seq, item.start, first_row - num_rows, num_rows, result)
            if not item.has_output:
                continue
            accepted = num_accepted[i]
            emitted = tokens[i][: accepted + 1]
            on_step_output(step_id, item, accepted, emitted[-1], drafts[i], following.get(id(seq)))
            if item.num_drafts:
                seq.spec_stats.record(item.num_drafts, accepted)
                spec_steps[item.num_drafts * (k + 1) + accepted] += 1
            request = requests[seq.request_id]
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            try:
                if processor.append(seq, emitted, result, i):
                    self.scheduler.finish(seq)
                elif seq.grammar is not None and id(seq) not in following:  # (else it verifies the device's drafts)
                    seq.drafts = seq.grammar.propose(seq.drafts, k)
            except Exception as err:  # noqa: BLE001 - e.g. detokenising: fail this request, not the step
                self.fail_request(request, err)
            if seq.finished or seq.params.output_kind is not FINAL_ONLY:  # (else no output yet)
                touched[seq.request_id] = request
        stats.computed_tokens += computed
        for index, times in enumerate(spec_steps):
            if times:
                stats.spec.record(*divmod(index, k + 1), times)
        return list(touched.values())
