"""LLMEngine: owns the params, the donated KV cache and the scheduler, and turns one
schedule into one jitted step. add_request/abort_request are safe to call from other
threads (the server's event loop); step() runs on one engine thread."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import threading
from collections import deque
from pathlib import Path

import jax
import numpy as np

from jaxmtp.attention import resolve_backend
from jaxmtp.batch import BatchShape, BucketPlan, build_batch, pack_batch
from jaxmtp.cache import PAGE_COPY_BATCH, PageAllocator, allocate_cache, copy_pages, page_copy_arrays
from jaxmtp.config import load_config
from jaxmtp.engine_config import EngineConfig
from jaxmtp.loader import load_params
from jaxmtp.outputs import CompletionOutput, RequestOutput
from jaxmtp.prefix_cache import PrefixCache, PrefixCacheStats, model_salt
from jaxmtp.sampling_params import SamplingParams
from jaxmtp.scheduler import ScheduledRows, Scheduler, SchedulerConfig
from jaxmtp.sequence import Sequence, SpecStats
from jaxmtp.sharding import check_divisible, make_mesh, replicated
from jaxmtp.step import StepConfig, StepOutput, jitted_step
from jaxmtp.tokenizer import Tokenizer

_compile_events = {"count": 0}


def _on_event(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compile_events["count"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def num_compiles() -> int:
    """XLA compilations in this process so far (all functions)."""
    return _compile_events["count"]


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: str | None
    seqs: list[Sequence]
    error: str | None = None  # why the engine failed it (finish_reason "error")


@dataclasses.dataclass
class InFlightStep:
    """A dispatched step whose output has not been read yet."""

    step_id: int
    scheduled: list[ScheduledRows]
    preemptions: list[int]  # each sequence's num_preemptions at dispatch
    output: StepOutput  # on the device
    batch: tuple  # the step's arguments after params and cache, for replays


@dataclasses.dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    generation_tokens: int = 0
    computed_tokens: int = 0  # rows run through the main model (prefill and verify)
    spec: SpecStats = dataclasses.field(default_factory=SpecStats)  # all requests' drafts together
    prefix_cache: PrefixCacheStats = dataclasses.field(default_factory=PrefixCacheStats)
    requests_finished: int = 0


class LLMEngine:
    def __init__(self, model: str | Path, **kwargs):
        self.config = config = EngineConfig(**kwargs)
        model_dir = Path(model)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model folder {model_dir!s} does not exist")
        self.model_dir = model_dir
        self.model_config = cfg = load_config(model_dir, config.dtype)
        k = config.num_speculative_tokens
        if k and not cfg.num_mtp_modules:
            raise ValueError(
                f"num_speculative_tokens={k} needs MTP weights, and {model_dir!s} has none "
                "(no num_nextn_predict_layers in config.json)"
            )
        # M: the MTP modules the draft pass runs (module j drafts at depth j; past M, module M chains)
        self.num_draft_modules = m = min(k, cfg.num_mtp_modules)
        if config.enable_prefix_caching and m > 1 and (config.page_size < m or config.prefix_cache_boundary != "exact"):
            # the rows a step rewrites before its first (up to M-1) must lie in the private
            # copy-on-write page a cache hit ends with (docs/prefix-cache.md)
            raise ValueError(
                f"prefix caching with {m} MTP modules drafting needs page_size >= {m} and "
                f"prefix_cache_boundary='exact', got page_size={config.page_size} and "
                f"prefix_cache_boundary={config.prefix_cache_boundary!r}"
            )
        resolve_backend(config.attention_backend, cfg.head_dim)  # fail early on a bad choice
        self.mesh = make_mesh(config.tensor_parallel_size)
        check_divisible(cfg, config.tensor_parallel_size)
        self.params = load_params(model_dir, cfg, config.load_format, config.seed, num_mtp_modules=m, mesh=self.mesh)
        self.tokenizer = Tokenizer(model_dir) if (model_dir / "tokenizer.json").is_file() else None
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.page_size = config.page_size
        # room for k verify rows plus k-1 chained draft positions past the last token
        self.max_pages_per_seq = math.ceil((self.max_model_len + 2 * k) / self.page_size)
        num_pages = config.num_pages or config.max_num_seqs * self.max_pages_per_seq
        # committed to its devices, sharded as every cache the step returns, so the first
        # shape warmup() compiles is not compiled again for the first real request
        self.cache = allocate_cache(cfg, num_pages, self.page_size, m, self.mesh)
        self.prefix_cache = None
        if config.enable_prefix_caching:
            # the salt: what besides the tokens decides a page's KV in this engine
            salt = model_salt(str(model_dir.resolve()), cfg.dtype, config.load_format, config.seed, config.mtp_boundary)
            self.prefix_cache = PrefixCache(self.page_size, salt, k > 0, config.prefix_cache_boundary, m)
        self.allocator = PageAllocator(num_pages, self.prefix_cache)
        chunk = config.chunk_size
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                prefill_chunk_size=chunk,
                page_size=self.page_size,
                max_pages_per_seq=self.max_pages_per_seq,
                num_speculative_tokens=k,
                num_draft_modules=m,
            ),
            self.allocator,
            self.prefix_cache,
        )
        self.buckets = BucketPlan(config.max_num_batched_tokens, config.max_num_seqs)
        self.step_config = StepConfig(
            model=cfg,
            num_speculative_tokens=k,
            attention_backend=config.attention_backend,
            mtp_boundary=config.mtp_boundary,
            num_top_logprobs=min(config.max_logprobs, cfg.vocab_size),
            mesh=self.mesh,
        )
        self.eos_token_ids = frozenset(cfg.eos_token_ids)
        self.stats = EngineStats(prefix_cache=self.prefix_cache.stats if self.prefix_cache else PrefixCacheStats())
        self.requests: dict[str, Request] = {}
        self._incoming: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._lock = threading.Lock()
        self._rng = np.random.default_rng(config.seed)
        self._arrivals = 0
        # the last step's schedule, device batch and read-back StepOutput, for tests,
        # benchmarks and debugging
        self.last_schedule = []
        self.last_batch = None
        self.last_step_output = None
        self._oracle_tokens = None
        self._in_flight: deque[InFlightStep] = deque()
        self._step_ids = 0
        # per request of the last dispatched step: accepted count, last token, drafts
        self._carry = jax.device_put(np.zeros((self.buckets.seq_sizes[-1], k + 2), np.int32), replicated(self.mesh))

    @property
    def oracle_tokens(self) -> jax.Array | None:
        """Benchmarks set an [R, L] table of token ids here, row r the output of an earlier
        plain greedy run for the request whose SamplingParams.seed is r: the step then
        drafts the row's next tokens in place of the MTP module's (step.oracle_drafts),
        on the device, so async scheduling works. None (the default): the module's drafts."""
        return self._oracle_tokens

    @oracle_tokens.setter
    def oracle_tokens(self, table) -> None:
        if table is not None:
            table = jax.device_put(np.asarray(table, np.int32), replicated(self.mesh))
        self._oracle_tokens = table

    # ----- requests -------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError(f"{self.model_dir!s} has no tokenizer.json: pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        return None, ids

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of vocabulary (size {vocab}): {bad[:5]}")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's context of {self.max_model_len} tokens"
            )
        if params.logprobs is not None and params.logprobs > self.step_config.num_top_logprobs:
            raise ValueError(f"logprobs must be <= {self.step_config.num_top_logprobs}, got {params.logprobs}")
        tokens = len(prompt_ids) + params.max_tokens + self.config.num_speculative_tokens
        if math.ceil(tokens / self.page_size) > self.allocator.num_pages:
            raise ValueError(f"request needs more KV pages than the pool holds ({self.allocator.num_pages})")

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None
    ) -> None:
        params = params or SamplingParams()
        params.validate()
        text, ids = self.encode_prompt(prompt)
        self.validate(ids, params)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        with self._lock:
            if request_id in self.requests or any(r.request_id == request_id for r in self._incoming):
                raise ValueError(f"request id {request_id!r} is already in use")
            seqs = []
            for i in range(params.n):
                seed = params.seed + i if params.seed is not None else int(self._rng.integers(2**32))
                seqs.append(
                    Sequence(
                        request_id=request_id,
                        prompt_token_ids=list(ids),
                        params=params,
                        seed=seed % 2**32,
                        arrival=self._arrivals,
                        stop_token_ids=frozenset(stop_ids),
                    )
                )
                self._arrivals += 1
            self._incoming.append(Request(request_id, text, seqs))

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
        """Sequences not yet running: queued in the scheduler or not yet admitted."""
        return len(self.scheduler.waiting) + sum(len(r.seqs) for r in self._incoming)

    # ----- the step -------------------------------------------------------------------

    def _admit_and_abort(self) -> list[RequestOutput]:
        outputs = []
        with self._lock:
            while self._incoming:
                request = self._incoming.popleft()
                self.requests[request.request_id] = request
                for seq in request.seqs:
                    self.stats.prompt_tokens += len(seq.prompt_token_ids)
                    self.scheduler.add(seq)
        while self._aborts:
            request = self.requests.get(self._aborts.popleft())
            if request is None:
                continue
            for seq in request.seqs:
                if not seq.finished:
                    seq.finish_reason = "abort"
                    self.scheduler.finish(seq)
            outputs.append(self._finish_request(request))
        return outputs

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that progressed.

        With async_scheduling the step dispatched here is read on the next call: step
        N+1 is scheduled, built and queued on the device before step N's tokens are
        read, so the host's work overlaps the device's."""
        outputs = self._admit_and_abort()
        scheduled = self.scheduler.schedule()
        self._copy_pages(self.scheduler.page_copies)  # queued before the step that reads them
        self.scheduler.page_copies = []
        if scheduled:
            self._in_flight.append(self._dispatch(scheduled))
        keep = 1 if scheduled and self.config.async_scheduling else 0
        while len(self._in_flight) > keep:
            outputs += self._collect(self._in_flight.popleft())
        return outputs

    def _dispatch(self, scheduled: list[ScheduledRows]) -> InFlightStep:
        greedy = all(item.seq.params.temperature == 0 and item.seq.params.logprobs is None for item in scheduled)
        shape = self.buckets.shape_for(sum(len(s.token_ids) for s in scheduled), len(scheduled), greedy)
        self._step_ids += 1
        output = self._run(scheduled, shape)
        preemptions = [item.seq.num_preemptions for item in scheduled]
        record = InFlightStep(self._step_ids, scheduled, preemptions, output, self.last_batch)
        for i, item in enumerate(scheduled):
            seq = item.seq
            # exact for a prefill chunk; for rows that emit, assumes no draft is accepted
            # until the step is read (_collect adds the accepted count)
            seq.num_computed = item.start + len(item.token_ids) - item.num_drafts
            seq.in_flight = (record.step_id, i, item.num_drafts + 1) if item.has_output else None
        return record

    def _collect(self, record: InFlightStep) -> list[RequestOutput]:
        """Read a dispatched step back and apply it to its sequences."""
        out = record.output
        wants_logprobs = any(item.seq.params.logprobs is not None for item in record.scheduled)
        if not wants_logprobs:  # read back only what the host uses
            out = dataclasses.replace(out, logprobs=None, top_logprobs=None, top_token_ids=None)
        out = jax.device_get(dataclasses.replace(out, carry=None))
        self.last_schedule, self.last_step_output, self.last_batch = record.scheduled, out, record.batch
        self.stats.steps += 1
        # rows of the next step, already dispatched, that continue this step's output
        continued = {id(item.seq): item for item in self._in_flight[0].scheduled} if self._in_flight else {}
        touched = {}
        for i, item in enumerate(record.scheduled):
            seq = item.seq
            # finished (aborted, or another sequence of its request failed) or preempted
            # since dispatch: its recompute will produce these tokens again
            if seq.finished or seq.num_preemptions != record.preemptions[i]:
                continue
            self.stats.computed_tokens += len(item.token_ids)
            if not item.has_output:
                continue
            if seq.in_flight and seq.in_flight[0] == record.step_id:
                seq.in_flight = None
            accepted = int(out.num_accepted[i])
            seq.num_computed += accepted
            if item.num_drafts:
                seq.spec_stats.record(item.num_drafts, accepted)
                self.stats.spec.record(item.num_drafts, accepted)
            try:
                self._append_tokens(seq, out, i, accepted + 1)
            except Exception as err:  # e.g. detokenising: fail this request, not the whole step
                self._fail_request(self.requests[seq.request_id], err)
            seq.drafts = [int(t) for t in out.drafts[i]]
            following = continued.get(id(seq))
            if following is not None:  # what the device filled in from the carry
                following.start += accepted
                following.token_ids = [int(out.tokens[i, accepted])] + seq.drafts
            touched[seq.request_id] = self.requests[seq.request_id]
        if self.prefix_cache:
            # KV dispatched to the device is final for every later step, which runs after it
            for item in record.scheduled:
                if not item.seq.finished:  # (a finished one registered its pages on release)
                    self.prefix_cache.register(item.seq)
        outputs = []
        for request in touched.values():
            if all(s.finished for s in request.seqs):
                outputs.append(self._finish_request(request))
            else:
                outputs.append(self._request_output(request))
        return outputs

    def _run(self, scheduled, shape: BatchShape):
        """The jitted step over a schedule padded to shape; the batch crosses to the
        device packed in one transfer. Returns the StepOutput, still on the device."""
        self.last_batch = (self._carry, *self._device_batch(scheduled, shape))
        self.cache, out = jitted_step(self.params, self.cache, *self.last_batch, self.step_config)
        self._carry = out.carry
        return out

    def _device_batch(self, scheduled, shape: BatchShape) -> tuple:
        """The step's (ints, floats, oracle tokens, static shapes) for a schedule padded to shape."""
        k, m = self.config.num_speculative_tokens, self.num_draft_modules
        batch = build_batch(scheduled, shape, self.max_pages_per_seq, self.page_size, self.cache.num_slots, k, m)
        ints, floats = jax.device_put(pack_batch(batch), replicated(self.mesh))
        shapes = (shape.num_tokens, shape.num_seqs, self.max_pages_per_seq, k, m, shape.greedy)
        return ints, floats, self.oracle_tokens, shapes

    def _copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Run (source, destination) page copies on the device, in order."""
        for i in range(0, len(copies), PAGE_COPY_BATCH):
            group = copies[i : i + PAGE_COPY_BATCH]
            self.cache = copy_pages(self.cache, *page_copy_arrays(group, self.cache.num_pages))

    def _append_tokens(self, seq: Sequence, out, i: int, count: int) -> None:
        params = seq.params
        for j in range(count):
            token = int(out.tokens[i, j])
            seq.output_token_ids.append(token)
            self.stats.generation_tokens += 1
            if params.logprobs is not None:
                entry = {token: float(out.logprobs[i, j])}
                for t, lp in zip(out.top_token_ids[i, j, : params.logprobs], out.top_logprobs[i, j, : params.logprobs]):
                    entry.setdefault(int(t), float(lp))
                seq.output_logprobs.append(entry)
            if token in seq.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
            elif len(seq.output_token_ids) >= params.max_tokens:
                seq.finish_reason = "length"
            elif self._update_text(seq):
                seq.finish_reason = "stop"
            if seq.finish_reason:
                self._update_text(seq)
                self.scheduler.finish(seq)
                return
        self._update_text(seq)

    def _update_text(self, seq: Sequence) -> bool:
        """Detokenise the output and cut it at the first stop string; True if one matched."""
        if self.tokenizer is None:
            return False
        ids = seq.output_token_ids
        if seq.stop_reason in seq.stop_token_ids:
            ids = ids[:-1]
        text = self.tokenizer.decode_continuation(seq.prompt_token_ids, ids)
        for stop in seq.params.stop:
            at = text.find(stop)
            if at >= 0:
                seq.text, seq.stop_reason = text[:at], stop
                return True
        seq.text = text
        return False

    def _request_output(self, request: Request) -> RequestOutput:
        completions = []
        for index, seq in enumerate(request.seqs):
            completions.append(
                CompletionOutput(
                    index=index,
                    text=seq.text,
                    token_ids=list(seq.output_token_ids),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
                    cumulative_logprob=(
                        sum(next(iter(e.values())) for e in seq.output_logprobs)
                        if seq.params.logprobs is not None
                        else None
                    ),
                )
            )
        first = request.seqs[0]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=list(first.prompt_token_ids),
            outputs=completions,
            finished=all(s.finished for s in request.seqs),
            spec_stats=first.spec_stats.as_dict() if self.config.num_speculative_tokens else None,
            error=request.error,
        )

    def _fail_request(self, request: Request, err: Exception) -> None:
        request.error = f"{type(err).__name__}: {err}"
        for seq in request.seqs:
            if not seq.finished:
                seq.finish_reason = "error"
                self.scheduler.finish(seq)

    def _finish_request(self, request: Request) -> RequestOutput:
        self.requests.pop(request.request_id, None)
        self.stats.requests_finished += 1
        return self._request_output(request)

    # ----- warm-up --------------------------------------------------------------------

    def warmup(self, num_threads: int = 1) -> int:
        """Compile the step for every bucket shape; returns the number of shapes.

        num_threads > 1 first compiles the shapes side by side into JAX's persistent
        compilation cache (it must be configured: jax_compilation_cache_dir), from
        which the pass that follows loads them."""
        shapes = self.buckets.all_shapes()
        if num_threads > 1:
            if not jax.config.jax_compilation_cache_dir:
                raise ValueError("warmup(num_threads > 1) needs jax_compilation_cache_dir set")
            with concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
                list(pool.map(lambda shape: self.lower_step(shape).compile(), shapes))
        for shape in shapes:
            jax.block_until_ready(self._run([], shape))  # an empty batch: every write dropped
        if self.prefix_cache:  # compiles the page copy; all padding, it changes nothing
            self.cache = copy_pages(self.cache, *page_copy_arrays([], self.cache.num_pages))
        return len(shapes)

    def lower_step(self, shape: BatchShape):
        """The step lowered for one bucket shape (compile it to warm up or inspect);
        its batch is placed as _run places it, so it is the same compiled step."""
        return jitted_step.lower(self.params, self.cache, self._carry, *self._device_batch([], shape), self.step_config)

    def cache_copies(self, shape: BatchShape) -> list[str]:
        """Lines of the compiled step's optimised HLO that copy a KV page array, for
        tests and benchmarks: with the cache donated there should be none."""
        pages = self.cache.k[0].shape
        names = [",".join(map(str, pages)), ",".join(map(str, (pages[0] * pages[1],) + pages[2:]))]
        text = self.lower_step(shape).compile().as_text()
        return [line.strip() for line in text.splitlines() if " copy(" in line and any(f"[{n}]" in line for n in names)]
