"""LLMEngine: request intake and the loop, one way:

    outputs = postprocess(run(schedule()))

The scheduler (host) decides the rows of the step, the runner (device) runs them, and
postprocessing appends the tokens and makes the outputs. add_request/abort_request are
safe to call from other threads (the server's event loop); step() runs on one thread."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from jaxmtp.engine.allocator import PageAllocator, pages_for
from jaxmtp.engine.engine_config import EngineConfig
from jaxmtp.engine.intake import RequestIntake
from jaxmtp.engine.model_options import (check_model_options, log_start, max_model_len, sampling_defaults,
                                         tokenizer_folder)
from jaxmtp.engine.output_processor import OutputProcessor, Request
from jaxmtp.engine.outputs import EngineStats, RequestMetrics, RequestOutput
from jaxmtp.engine.prefix_cache import PrefixCache, PrefixCacheStats, model_salt
from jaxmtp.engine.sampling_params import SamplingParams
from jaxmtp.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from jaxmtp.engine.state_snapshots import StateSnapshots
from jaxmtp.engine.step_postprocess import StepPostprocessor
from jaxmtp.engine.structured_outputs import step_bitmask
from jaxmtp.loading.hub import resolve_model
from jaxmtp.loading.tokenizer import Tokenizer
from jaxmtp.models.registry import load_config
from jaxmtp.worker.distributed import start_runner

if TYPE_CHECKING:
    from jaxmtp.worker.step_records import InFlightStep, StepResult

log = logging.getLogger("jaxmtp.engine.llm_engine")
# how long the engine's thread waits at most for the mask worker to reach llguidance: a
# fill starts in well under a millisecond, and step_bitmask signals on every path, so
# this bounds only a worker the OS does not run; past it the thread goes on (the fill
# still runs)
MASK_START_WAIT_S = 1.0


class StaleSchedule(Exception):
    """A step was scheduled on a cache that the failure of the step before it lost."""


class LLMEngine:
    def __init__(self, model: str | Path, **kwargs):
        self.config = config = EngineConfig(**kwargs)
        self.model_dir = model_dir = resolve_model(model, config.revision)
        self.model_config = cfg = load_config(model_dir, config.dtype)
        check_model_options(config, model, model_dir, cfg)
        # what a request that gives no SamplingParams gets: the model's recommended sampling
        self.generation_defaults: dict = sampling_defaults(config, model_dir)
        tokenizer_dir = tokenizer_folder(config, model_dir)
        k = config.num_speculative_tokens
        # M: the MTP modules the draft pass runs (module j drafts at depth j; past M, module M chains)
        self.num_draft_modules = m = min(k, cfg.num_mtp_modules)
        self.max_model_len = max_model_len(config, cfg)
        log_start(config, model, cfg, self.max_model_len, self.generation_defaults)
        self.page_size = config.page_size
        # room for k verify rows plus k-1 chained draft positions past the last token
        self.max_pages_per_seq = pages_for(self.max_model_len + 2 * k, self.page_size)
        self.runner = start_runner(model_dir, config, cfg, m, self.max_pages_per_seq)  # other ranks than 0 stay there
        tokenizer = Tokenizer(tokenizer_dir) if (tokenizer_dir / "tokenizer.json").is_file() else None
        self.prefix_cache = None
        # the salt: what besides the tokens decides a page's KV in this engine
        self._salt = model_salt(str(model_dir.resolve()), cfg.dtype, config.load_format, config.seed, config.mtp_boundary)
        if config.enable_prefix_caching:
            snapshots = self.runner.num_state_snapshots  # the device table's entries
            self.prefix_cache = PrefixCache(self.page_size, k > 0, config.prefix_cache_boundary, m,
                                            StateSnapshots(snapshots) if snapshots else None)
        self.allocator = PageAllocator(self.runner.num_pages, self.page_size, self.prefix_cache)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                prefill_chunk_size=config.chunk_size,
                page_size=self.page_size,
                max_pages_per_seq=self.max_pages_per_seq,
                num_speculative_tokens=k,
                num_draft_modules=m,
            ),
            self.allocator,
            self.prefix_cache,
            self._admissible,
        )
        self.eos_token_ids = frozenset(cfg.eos_token_ids)
        self.intake = RequestIntake(
            tokenizer, model_dir.name, cfg.vocab_size, self.max_model_len, self.runner.step_config.num_top_logprobs,
            self.eos_token_ids, config.seed,
        )
        self.stats = EngineStats(prefix_cache=self.prefix_cache.stats if self.prefix_cache else PrefixCacheStats())
        self.output_processor = OutputProcessor(tokenizer, with_spec_stats=k > 0, stats=self.stats)
        self.requests: dict[str, Request] = {}
        self.postprocessor = StepPostprocessor(self.scheduler, self.output_processor, self.requests, self.stats, k,
                                               self._fail_request)
        self._incoming: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._lock = threading.Lock()
        self._in_flight: deque[InFlightStep] = deque()
        self._awaiting: InFlightStep | None = None  # the masked step in flight whose second part is not queued yet
        # the awaiting step's masks, filled on a worker thread from when the step before it
        # has been read (its grammars are final) until the next step is built: llguidance
        # fills without the GIL, so the masks run beside the host's scheduling and building.
        # Taken (and waited for) whenever _awaiting is, so it is always _awaiting's.
        self._masks: Future | None = None
        self._mask_worker = ThreadPoolExecutor(1, thread_name_prefix="jaxmtp-masks")
        self._step_ids = 0
        self.usable = True  # False once a failed step could not be recovered from
        # the last step read: its record (schedule and device arguments), rows and output,
        # for tests, benchmarks and debugging
        self.last_step: InFlightStep | None = None
        self.last_schedule = []
        self.last_step_output: StepResult | None = None

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with generation_defaults: what a request that gives none gets."""
        return SamplingParams(**self.generation_defaults)

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer (None without a tokenizer.json); the intake encodes with it."""
        return self.intake.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Tokenizer | None) -> None:
        self.intake.tokenizer = tokenizer

    # ----- what the runner owns, for research code and tests --------------------------------

    @property
    def params(self):
        return self.runner.params

    @property
    def cache(self):
        return self.runner.cache

    @property
    def oracle_tokens(self):
        return self.runner.oracle_tokens

    @oracle_tokens.setter
    def oracle_tokens(self, table) -> None:
        self.runner.oracle_tokens = table

    def warmup(self, num_threads: int = 1, background: bool = False) -> int:
        """Compile the step for every bucket shape; background: the largest now, the
        rest while the engine already runs steps (ModelRunner.warmup)."""
        return self.runner.warmup(num_threads, with_page_copies=self.prefix_cache is not None, background=background)

    def _admissible(self, seq) -> bool:
        """Whether seq's steps can run without compiling: a constrained or prompt-logprob
        request waits in the queue while the warm-up compiles its kind off this thread
        (ModelRunner.other_kinds_ready); the others go ahead of it."""
        return (seq.grammar is None and not seq.wants_prompt_logprobs) or self.runner.other_kinds_ready

    # ----- requests -------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        return self.intake.encode_prompt(prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.intake.validate(prompt_ids, params)
        tokens = len(prompt_ids) + params.max_tokens + self.config.num_speculative_tokens
        if self.allocator.pages_for(tokens) > self.allocator.num_pages:
            raise ValueError(f"request needs more KV pages than the pool holds ({self.allocator.num_pages})")

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
        cache_salt: str | None = None, arrival_time: float | None = None,
    ) -> None:
        """cache_salt: requests reuse each other's cached KV only when their salts are equal
        (the server salts by API key, so one tenant's prompts cannot be probed by another).
        arrival_time: when the request arrived, in time.monotonic() seconds (default: now);
        the server gives the time its HTTP request came in."""
        metrics = RequestMetrics(time.monotonic() if arrival_time is None else arrival_time)
        params = params or self.default_sampling_params()
        params.validate()
        text, ids = self.encode_prompt(prompt)
        self.validate(ids, params)
        salt = self._salt if cache_salt is None else model_salt(self._salt, cache_salt)
        with self._lock:
            if request_id in self.requests or any(r.request_id == request_id for r in self._incoming):
                raise ValueError(f"request id {request_id!r} is already in use")
            seqs = self.intake.sequences(request_id, ids, params, salt)
            for seq in seqs:
                self.output_processor.start(seq)
            self._incoming.append(Request(request_id, text, seqs, metrics))

    def abort_request(self, request_id: str) -> None:
        self._aborts.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._incoming)

    @property
    def num_steps_in_flight(self) -> int:
        """Dispatched steps not read yet (at most one, with async_scheduling)."""
        return len(self._in_flight)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Sequences not yet running: queued in the scheduler or not yet admitted. Safe from
        any thread (the server's metrics and stats line read it while the engine steps)."""
        with self._lock:  # the engine thread empties _incoming under it
            incoming = sum(len(r.seqs) for r in self._incoming)
        return len(self.scheduler.waiting) + incoming

    # ----- the loop -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that progressed (as
        its RequestOutputKind asks). With async_scheduling the step dispatched here is
        read on the next call: step N+1 is scheduled, built and queued on the device
        before step N's tokens are read, so the host's work overlaps the device's.
        A step with constrained requests goes in two parts: its forward, queued as any
        step; then, once step N's tokens have advanced the grammars, its sampling with
        the masks they give, queued on the next call just before step N+2 (_awaiting).
        The host's turn (reading step N, scheduling and building step N+2, with the
        masks filled meanwhile on a worker thread in one llguidance call) then runs
        under the forward, and the device runs the second part and the next forward
        back to back."""
        outputs = self._admit_and_abort()
        scheduled = self.scheduler.schedule()
        dispatched = self._dispatch(scheduled, outputs) if scheduled.rows else None
        keep = 1 if dispatched is not None and self.config.async_scheduling else 0
        if not keep:  # every step before it has been read: its masks are known
            self._complete_awaiting(outputs)
        while len(self._in_flight) > keep:
            outputs += self._postprocess(self._in_flight.popleft())
        if self._awaiting is not None and self._masks is None:  # every step before it is read
            self._start_masks()
        return [out for out in outputs if out is not None]

    def _admit_and_abort(self) -> list[RequestOutput | None]:
        with self._lock:
            while self._incoming:
                request = self._incoming.popleft()
                self.requests[request.request_id] = request
                for seq in request.seqs:
                    self.stats.prompt_tokens += len(seq.prompt_token_ids)
                    self.scheduler.add(seq)
        outputs = []
        while self._aborts:
            request = self.requests.get(self._aborts.popleft())
            if request is not None:
                outputs.append(self._end_request(request, "abort"))
        return outputs

    def _dispatch(self, scheduled: SchedulerOutput, outputs: list) -> InFlightStep | None:
        """Run the scheduled step (a masked one's first part); returns its record. A batch
        that cannot be built fails only the requests that break it; a step that fails on
        the device fails the requests it held and, if it consumed the cache, every
        running request, and the engine goes on."""
        self._step_ids += 1

        def before_device() -> None:  # the step awaiting its masks goes first (step())
            if not self._complete_awaiting(outputs):
                raise StaleSchedule

        try:
            record = self.runner.dispatch(self._step_ids, scheduled, before_device)
        except StaleSchedule:  # its requests failed with the cache
            return None
        except Exception as err:  # noqa: BLE001 - whatever broke, the engine must go on
            outputs += self._recover(scheduled, err)
            return None
        self.scheduler.on_dispatch(self._step_ids, scheduled)
        self._in_flight.append(record)
        if record.awaits_masks:
            self._awaiting = record
        now = time.monotonic()
        for item in scheduled.rows:
            request = self.requests.get(item.seq.request_id)  # (one the step before failed has ended)
            if request is not None and request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
        return record

    def _complete_awaiting(self, outputs: list) -> bool:
        """Queue the second part of the masked step that awaits its masks, if any (and if
        no failure dropped it), with its rows' grammar masks; a request whose masks fail
        fails alone. False when the step failed and took the cache with it: every running
        request failed, and a step scheduled since must not run."""
        record, self._awaiting = self._awaiting, None
        masks_job, self._masks = self._masks, None
        if record is None or not any(item is record for item in self._in_flight):
            if masks_job is not None:  # no fill may still run on the grammars
                masks_job.exception()
            return True
        try:
            masks, failed = masks_job.result() if masks_job is not None else self._step_bitmask(record)
            # (a request aborted since its fill began has ended already)
            outputs += [self._end_request(self.requests[seq.request_id], "error", err) for seq, err in failed
                        if seq.request_id in self.requests]
            self.runner.complete(record, masks)
        except Exception as err:  # noqa: BLE001
            self._in_flight.remove(record)
            lost = self.runner.cache_is_lost
            outputs += self._recover(record.scheduled, err)
            return not lost
        return True

    def _start_masks(self) -> None:
        """Start filling the awaiting step's masks on the worker, and let the worker run
        until llguidance has them (it fills without the GIL). A thread waiting for the GIL
        gets it only when the holder blocks or after the interpreter's switch interval
        (5 ms): without the hand-over the fill would begin only once this thread waits
        for its result, and nothing would overlap it."""
        began = threading.Event()
        self._masks = self._mask_worker.submit(self._step_bitmask, self._awaiting, began)
        began.wait(MASK_START_WAIT_S)

    def _step_bitmask(self, record: InFlightStep, began: threading.Event | None = None):
        return step_bitmask(record.scheduled.rows, record.preemptions, self.config.num_speculative_tokens,
                            self.runner.mask_width, record.shape.num_seqs, began)

    def _postprocess(self, record: InFlightStep) -> list[RequestOutput | None]:
        """Read a dispatched step back and apply it to its sequences."""
        try:
            result = self.runner.read(record)
        except Exception as err:  # noqa: BLE001
            return self._recover(record.scheduled, err)
        self.last_step, self.last_schedule, self.last_step_output = record, record.scheduled.rows, result
        self.stats.steps += 1
        # rows of the next step, already dispatched, that continue this step's output
        following = {id(item.seq): item for item in self._in_flight[0].scheduled.rows} if self._in_flight else {}
        touched = self.postprocessor.apply(record, result, following)
        self.scheduler.register_cached_rows(record.scheduled.rows)
        return [self._finish(r) if r.finished else self.output_processor.output(r) for r in touched]

    # ----- failures and endings -------------------------------------------------------

    def _recover(self, scheduled: SchedulerOutput, err: Exception) -> list[RequestOutput | None]:
        """A step could not run. Fail the requests whose own rows break the batch if
        there are such (the rest run next step); otherwise fail the step's requests,
        and every running one if the donated cache is gone (rebuilt empty)."""
        self.stats.failed_steps += 1
        culprits = [item for item in scheduled.rows if not self._builds(item)]
        if culprits:
            log.error("failing %d request(s) whose input breaks the batch: %s", len(culprits), err)
            return [self._end_request(self.requests[item.seq.request_id], "error", err) for item in culprits]
        log.exception("engine step failed", exc_info=err)
        failed = {item.seq.request_id for item in scheduled.rows}
        if self.runner.cache_is_lost:
            try:
                self.runner.reset()
            except Exception:  # noqa: BLE001
                self.usable = False
                log.exception("could not rebuild the KV cache; the engine is unusable")
            self._in_flight.clear()
            failed |= {seq.request_id for seq in self.scheduler.reset()}
            self.allocator.reset()
        return [self._end_request(self.requests[rid], "error", err) for rid in failed if rid in self.requests]

    def _builds(self, item) -> bool:
        """Whether one request's rows make a batch on their own."""
        try:
            self.runner.host_batch([item], self.runner.shape_for([item]))
            return True
        except Exception:  # noqa: BLE001
            return False

    def _fail_request(self, request: Request, err: Exception) -> None:
        request.error = f"{type(err).__name__}: {err}"
        for seq in request.seqs:
            if not seq.finished:
                seq.finish_reason = "error"
                self.scheduler.finish(seq)

    def _end_request(self, request: Request, reason: str, err: Exception | None = None) -> RequestOutput | None:
        """End every unfinished sequence of the request (abort, error) and report it."""
        if err is not None:
            self._fail_request(request, err)
        for seq in request.seqs:
            if not seq.finished:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
        return self._finish(request)

    def _finish(self, request: Request) -> RequestOutput | None:
        self.requests.pop(request.request_id, None)
        self.stats.requests_finished += 1
        request.metrics.finished_time = time.monotonic()
        return self.output_processor.output(request)
