"""ModelRunner: everything on the device. It loads the params, owns the donated KV
cache and the carry between steps, turns a SchedulerOutput into one compiled step (page
copies first), reads a step's output back, compiles every bucket shape (warm-up, also in
the background: jaxmtp/worker/programs.py) and inspects it. The engine never touches a device array.

A step's device work is built on the host first, as StepInputs, then run (apply): on a
mesh over several processes, rank 0's runner sends it to the others' runners, which run
the same (self.peers; jaxmtp/worker/distributed.py). The records that cross to the
engine and the other processes: jaxmtp/worker/step_records.py."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import numpy as np

from jaxmtp.engine.engine_config import EngineConfig
from jaxmtp.engine.model_options import num_state_snapshots
from jaxmtp.engine.scheduler import ScheduledRows, SchedulerOutput
from jaxmtp.loading.loader import load_params
from jaxmtp.models.config import ModelConfig
from jaxmtp.worker.batch import (
    OTHER_KINDS, BatchShape, BucketPlan, Carry, build_batch, lookahead_width, mask_words, pack_batch,
)
from jaxmtp.worker.cache import PAGE_COPY_BATCH, allocate_cache, copy_pages, page_copy_arrays
from jaxmtp.worker.logits_processors import padded_state_rows, write_rows, zero_state
from jaxmtp.worker.memory import plan_kv_pool
from jaxmtp.worker.packed_params import ParamLayout
from jaxmtp.worker.param_layouts import step_layouts
from jaxmtp.worker.programs import StepPrograms
from jaxmtp.worker.recurrent import allocate_recurrent, recurrent_bytes
from jaxmtp.worker.snapshot_table import SnapshotTable
from jaxmtp.worker.sharding import (array_spec, check_divisible, host_inputs, make_mesh, param_shardings, put_replicated,
                                    replicated)
from jaxmtp.worker.step import (STEP_STATE, StepConfig, StepOutput, finish_inputs, jitted_finish, jitted_forward,
                                jitted_step, matmul_precision)
from jaxmtp.worker.step_records import InFlightStep, StepInputs, StepResult


class ModelRunner:
    def __init__(
        self, model_dir, config: EngineConfig, model_config: ModelConfig, num_draft_modules: int, max_pages_per_seq: int
    ):
        self.config = config
        self.model_config = model_config
        self.mesh = make_mesh(config.tensor_parallel_size)
        check_divisible(model_config, config.tensor_parallel_size)
        self.num_draft_modules = num_draft_modules
        self.mask_width = mask_words(model_config.vocab_size)  # 32-bit words of a grammar's token bitmask
        self.peers = None  # rank 0 of several processes: what sends them its device work (distributed.Leader)
        self.params = step_layouts(load_params(
            model_dir, model_config, config.load_format, config.seed, num_mtp_modules=num_draft_modules,
            shardings=functools.partial(param_shardings, mesh=self.mesh),
        ), model_config, config.attention_backend, self.mesh)
        self.page_size, self.max_pages_per_seq = config.page_size, max_pages_per_seq
        # placed before the pool is sized: the pool gets what the weights and these leave
        self.logits_state = self._state_builders()["logits_state"]()
        self.recurrent = self._state_builders()["recurrent"]()
        # a hybrid model's recurrent states at page boundaries, for prefix-cache hits
        self.num_state_snapshots = num_state_snapshots(config, model_config)
        self.snapshots = SnapshotTable(model_config, self.num_state_snapshots, config.max_num_seqs, self.mesh) \
            if self.num_state_snapshots else None
        # sized after the weights are placed, from the memory they leave
        self.kv_pool = plan_kv_pool(
            model_config, page_size=config.page_size, num_draft_modules=num_draft_modules,
            max_pages_per_seq=max_pages_per_seq, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, num_speculative_tokens=config.num_speculative_tokens,
            num_pages=config.num_pages, gpu_memory_utilization=config.gpu_memory_utilization,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes, devices=list(self.mesh.devices.flat),
            # each device holds its heads' share of the state tables
            state_bytes=(recurrent_bytes(model_config, config.max_num_seqs, self._recurrent_versions)
                         + recurrent_bytes(model_config, self.num_state_snapshots, 1)) // self.mesh.size,
        )
        self.num_pages = self.kv_pool.num_pages
        self.buckets = BucketPlan(config.max_num_batched_tokens, config.max_num_seqs, max_pages_per_seq,
                                  decode_rows=config.num_speculative_tokens + 1
                                  if model_config.mla or model_config.moe else None)
        self.step_config = StepConfig(
            model=model_config,
            num_speculative_tokens=config.num_speculative_tokens,
            num_draft_modules=num_draft_modules,
            attention_backend=config.attention_backend,
            mtp_boundary=config.mtp_boundary,
            num_top_logprobs=min(config.max_logprobs, model_config.vocab_size),
            mesh=self.mesh,
            param_layout=ParamLayout.of(self.params),
        )
        self.step_params = self.step_config.param_layout.pack(self.params)  # what step and forward take
        self._oracle_tokens = None
        self._pending = None  # a masked step's second program, its arguments and hidden rows, until apply_masks
        # the compiled steps, by the oracle table's shape (None: no oracle, as serving runs)
        self._programs: dict[tuple | None, StepPrograms] = {}
        self._place_state([name for name in STEP_STATE if name not in ("logits_state", "recurrent")])  # placed above
        # what the step is compiled for: the arrays' shapes, dtypes and shardings, which
        # every step keeps (the background compiler reads these, never the donated arrays)
        self._state_specs = jax.tree.map(array_spec, (self.step_params, *self.step_state()))

    def replace_params(self, params) -> None:
        """New values for the same parameter tree (a benchmark's weights), in the step's
        packed form too."""
        self.params, self.step_params = params, self.step_config.param_layout.pack(params)

    def reset(self) -> None:
        """Every state the step carries across steps (step.STEP_STATE), fresh and zeroed,
        after a failed step that consumed what it donated. A request's
        logits-state row is written when it is admitted, so zeros lose nothing that a
        request still running after the failure needs."""
        if self.peers is not None:
            self.peers.cache_lost()  # the other processes' caches cannot be brought back in step
        self._pending = None
        self._place_state(STEP_STATE)
        if self.snapshots is not None:
            self.snapshots.reset()

    def _place_state(self, names) -> None:
        """Build the STEP_STATE entries `names` fresh and place them."""
        builders = self._state_builders()
        assert builders.keys() == set(STEP_STATE), "every state the step carries is rebuilt here"
        for name in names:
            setattr(self, name, None)  # the old arrays go before their replacements are placed
            setattr(self, name, builders[name]())

    def _state_builders(self) -> dict:
        """How to build each STEP_STATE entry fresh: committed to its devices and sharded as
        the step returns it, as the compiled programs take it."""
        return {
            "cache": lambda: allocate_cache(self.model_config, self.num_pages, self.page_size, self.num_draft_modules,
                                            self.mesh),
            # a slot per running sequence (Sequence.state_slot), k + 1 versions each
            "recurrent": lambda: allocate_recurrent(self.model_config, self.config.max_num_seqs, self._recurrent_versions,
                                                    self.mesh),
            "logits_state": lambda: put_replicated(zero_state(self.config.max_num_seqs, self.model_config.vocab_size),
                                                   self.mesh),
            "carry": lambda: put_replicated(Carry.zeros(self.buckets.seq_sizes[-1], self.config.num_speculative_tokens),
                                            self.mesh),
        }

    @property
    def _recurrent_versions(self) -> int:
        """The states a recurrent slot keeps: one per row a verification may keep (recurrent.py)."""
        return self.config.num_speculative_tokens + 1

    def step_state(self) -> tuple:
        """The STEP_STATE arrays, in the step's argument order."""
        return tuple(getattr(self, name) for name in STEP_STATE)

    @property
    def cache_is_lost(self) -> bool:
        """Whether a failed step consumed any state it carries (what it donated)."""
        return any(x.is_deleted() for x in jax.tree.leaves(self.step_state()))

    @property
    def oracle_tokens(self) -> jax.Array | None:
        """Benchmarks set an [R, L] table of token ids here, row r the output of an earlier
        plain greedy run for the request whose SamplingParams.seed is r: the step then
        drafts the row's next tokens in place of the MTP module's (step.oracle_drafts),
        on the device, so async scheduling works. None (the default): the module's drafts."""
        return self._oracle_tokens

    @oracle_tokens.setter
    def oracle_tokens(self, table) -> None:
        table = None if table is None else np.asarray(table, np.int32)
        if self.peers is not None:
            self.peers.send_oracle_tokens(table)
        self._oracle_tokens = None if table is None else put_replicated(table, self.mesh)

    # ----- one step ---------------------------------------------------------------------

    def shape_for(self, rows: list[ScheduledRows]) -> BatchShape:
        masked = any(item.seq.grammar is not None for item in rows)
        greedy = all(p.temperature == 0 and p.logprobs is None and not p.processes_logits
                     for p in (item.seq.params for item in rows))
        num_pages = max((len(item.seq.pages) for item in rows), default=0)
        prompt = any(item.seq.wants_prompt_logprobs for item in rows)
        runs = [len(item.token_ids) for item in rows]
        return self.buckets.shape_for(sum(runs), len(rows), greedy, num_pages, prompt, masked, max(runs, default=0))

    def host_batch(self, rows: list[ScheduledRows], shape: BatchShape) -> tuple[np.ndarray, np.ndarray]:
        """The packed batch (ints, floats) of rows padded to shape."""
        batch = build_batch(rows, shape, self.max_pages_per_seq, self.page_size, self.num_pages * self.page_size,
                            self.config.num_speculative_tokens, lookahead_width(self.num_draft_modules))
        return pack_batch(batch)

    def dispatch(self, step_id: int, scheduled: SchedulerOutput,
                 before_device: Callable[[], None] = lambda: None) -> InFlightStep:
        """Queue the page copies, the new LogitsState rows and the step on the device;
        returns before it runs. The copies and rows go first, also when the batch then
        cannot be built: the sequences they serve already count the copied rows as computed.
        The batch is padded to a compiled shape (StepPrograms.shape_to_run). A masked
        shape's step runs its first program only: complete() gives it the masks.
        before_device: run once the host has built the step, before any of it is queued."""
        new = [item.seq for item in scheduled.rows if item.seq.params.processes_logits and not item.seq.state_written]
        groups = range(0, len(scheduled.page_copies), PAGE_COPY_BATCH)
        inputs = StepInputs([page_copy_arrays(scheduled.page_copies[i : i + PAGE_COPY_BATCH], self.num_pages)
                             for i in groups])
        if scheduled.state_restores:
            inputs.state_restores = self.snapshots.restore_arrays(scheduled.state_restores)
        if scheduled.state_saves:
            inputs.state_saves = self.snapshots.save_arrays(scheduled.state_saves)
        try:
            inputs.state_slots, inputs.state_rows = padded_state_rows(new, self.model_config.vocab_size,
                                                                      self.config.max_num_seqs)
            shape = self.programs.shape_to_run(self.shape_for(scheduled.rows))
            (inputs.ints, inputs.floats), inputs.shape = self.host_batch(scheduled.rows, shape), shape
        finally:  # what was built runs, also when the rest raised
            before_device()
            args, output = self.apply(inputs)
            for seq in new if inputs.state_slots is not None else ():
                seq.state_written = True
        preemptions = [item.seq.num_preemptions for item in scheduled.rows]
        return InFlightStep(step_id, scheduled, preemptions, output, args)

    def apply(self, inputs: StepInputs) -> tuple[tuple | None, StepOutput | None]:
        """Run a step's device work; returns the step's arguments after params, cache and
        carry (placed, for replays) and its output, or (None, None) without a batch, or
        (args, None) for a masked shape, whose second program waits for apply_masks."""
        if self.peers is not None:
            self.peers.send_step(inputs)
        if self.snapshots is not None:
            self.snapshots.run_due_saves(self.recurrent)
        for src, dst in inputs.page_copies:
            self.cache = copy_pages(self.cache, src, dst)
        if inputs.state_restores is not None:
            self.recurrent = self.snapshots.restore(self.recurrent, inputs.state_restores)
        if inputs.state_slots is not None:
            self.logits_state = write_rows(self.logits_state, *put_replicated((inputs.state_slots, inputs.state_rows), self.mesh))
        if inputs.shape is None:
            return None, None
        args = (*host_inputs((inputs.ints, inputs.floats), self.mesh), self.oracle_tokens, inputs.shape)
        output = self._run(args)
        if inputs.state_saves is not None:  # once the step ran (it may raise)
            self.snapshots.due_saves = inputs.state_saves
        return args, output

    def apply_masks(self, token_bitmask: np.ndarray) -> StepOutput:
        """Run the second program of the masked step apply() began, with its requests'
        token bitmasks [B, k+1, W] (structured_outputs.step_bitmask)."""
        if self.peers is not None:
            self.peers.send_masks(token_bitmask)
        return self._finish(host_inputs(token_bitmask, self.mesh))

    def complete(self, record: InFlightStep, masks: np.ndarray) -> None:
        """Queue a masked step's second program with its grammar masks [B, k+1, W], B the
        step shape's requests (-1: every token; padding requests allow every token)."""
        expected = (record.shape.num_seqs, self.config.num_speculative_tokens + 1, self.mask_width)
        if masks.shape != expected:
            raise ValueError(f"a masked step takes masks of shape {expected}, got {masks.shape}")
        record.token_bitmask = masks
        record.output = self.apply_masks(masks)

    def _run(self, args: tuple, token_bitmask: jax.Array | None = None) -> StepOutput | None:
        """Run a step's programs: an unmasked shape's one; a masked shape's first, and its
        second when token_bitmask is given (else that waits for apply_masks)."""
        ints, floats, oracle, shape = args
        programs = self._programs_for(oracle).program(shape)
        if not shape.masked:
            self.cache, self.recurrent, self.logits_state, output = programs[0](
                self.step_params, *self.step_state(), ints, floats, oracle)
            self.carry = output.carry
            return output
        self.cache, self.recurrent, hidden = programs[0](self.step_params, self.cache, self.recurrent, self.carry, ints,
                                                         floats)
        self._pending = (programs[1], args, hidden)
        return None if token_bitmask is None else self._finish(token_bitmask)

    def _finish(self, token_bitmask: jax.Array) -> StepOutput:
        if self._pending is None:
            raise RuntimeError("no masked step waits for its masks")
        program, (ints, floats, oracle, _), hidden = self._pending
        self._pending = None
        params, draft = finish_inputs(self.params, self.cache, self.model_config.num_kv_layers)
        draft, self.recurrent, self.logits_state, output = program(
            params, draft, self.recurrent, self.logits_state, self.carry, ints, floats, hidden, token_bitmask, oracle)
        self.cache, self.carry = self.cache.with_draft_part(draft), output.carry
        return output

    def read(self, record: InFlightStep) -> StepResult:
        """Wait for a dispatched step and bring back what the host uses."""
        out = record.output
        wants_logprobs = any(item.seq.params.logprobs is not None for item in record.scheduled.rows)
        prompt = out.prompt
        host = jax.device_get(
            (out.tokens, out.num_accepted, out.drafts, out.boundary_token)
            + ((out.logprobs, out.ranks, out.top_logprobs, out.top_token_ids) if wants_logprobs else (None,) * 4)
            + ((prompt.logprobs, prompt.ranks, prompt.top_logprobs, prompt.top_token_ids) if prompt is not None else (None,) * 4)
        )
        return StepResult(*host)

    def replay(self, record: InFlightStep) -> StepOutput:
        """Run a step's batch again, on the cache as it is now (benchmarks time it alone)."""
        if self.peers is not None:
            raise ValueError("replay runs a step on one process; with num_nodes > 1 every process must run it")
        if isinstance(record.args[0], np.ndarray):  # placed once: a replay times the device, not the transfer
            record.args = (*put_replicated(record.args[:2], self.mesh), *record.args[2:])
        masks = None if record.token_bitmask is None else put_replicated(record.token_bitmask, self.mesh)
        return self._run(record.args, masks)

    # ----- compilation ------------------------------------------------------------------

    @property
    def programs(self) -> StepPrograms:
        """The compiled steps that run with the current oracle table (normally none)."""
        return self._programs_for(self._oracle_tokens)

    def _programs_for(self, oracle: jax.Array | None) -> StepPrograms:
        key = None if oracle is None else oracle.shape
        if key not in self._programs:
            spec = None if oracle is None else array_spec(oracle)
            self._programs[key] = StepPrograms(lambda shape: self.lower_programs(shape, spec))
        return self._programs[key]

    def warmup(self, num_threads: int = 1, with_page_copies: bool = False, background: bool = False) -> int:
        """Compile the step for every plain bucket shape, smallest first, and the largest
        shape of each other kind (constrained, prompt logprobs: it holds any batch of
        its kind), num_threads at a time (a progress bar shows the shapes left); returns
        the number of shapes. From then on nothing compiles inside a step: a batch whose
        shape was left out runs on the smallest compiled one that holds it.
        background: compile the largest plain shape and return; the other kinds' largest
        shapes, the plain ones and the other kinds' smaller ones compile in that order on
        a thread of their own while steps run (programs.wait()); requests of the other
        kinds wait in the queue until theirs are in (other_kinds_ready)."""
        if self.peers is not None:
            self.peers.send_warmup(num_threads, with_page_copies, background)
        shapes = self.buckets.all_shapes()
        kinds = [self.buckets.largest(*kind) for kind in OTHER_KINDS]
        if with_page_copies:  # all padding, it changes nothing
            self.cache = copy_pages(self.cache, *page_copy_arrays([], self.num_pages))
        if self.snapshots is not None:
            self.recurrent = self.snapshots.warm(self.recurrent)
        self.programs.warmed_up = True
        if background:
            self.programs.compile_all([self.buckets.largest()])
            rest = [shape for kind in OTHER_KINDS for shape in self.buckets.all_shapes(*kind)]
            order = list(dict.fromkeys(kinds + shapes + rest))
        else:
            order = shapes + kinds
        self.programs.compile_all(order, num_threads, background)
        return len(order)

    @property
    def other_kinds_ready(self) -> bool:
        """Whether a constrained or prompt-logprob request can be admitted without a
        step compiling: no warm-up (such an engine compiles when it must), the largest
        shape of every other kind compiled (it holds any mix of them), or a background
        compilation that ended without them (they then compile when first needed)."""
        programs = self.programs
        return (not programs.warmed_up or not programs.compiling
                or all(programs.compiled(self.buckets.largest(*kind)) for kind in OTHER_KINDS))

    def full_shape(self, shape: BatchShape) -> BatchShape:
        """shape with its page-table width filled in (None: the widest)."""
        return dataclasses.replace(shape, pages_per_seq=shape.pages_per_seq or self.max_pages_per_seq)

    def lower_step(self, shape: BatchShape, oracle: jax.ShapeDtypeStruct | None = None):
        """An unmasked shape's step lowered (compile it to run or inspect)."""
        return self.lower_programs(shape, oracle)[0]

    def lower_programs(self, shape: BatchShape, oracle: jax.ShapeDtypeStruct | None = None) -> tuple:
        """The programs of one bucket shape lowered, in the order they run: the step, or a
        masked shape's forward and finish (jaxmtp/worker/step.py); for arguments placed as
        dispatch places them; oracle: the oracle table's spec."""
        shape = self.full_shape(shape)
        batch = build_batch([], shape, self.max_pages_per_seq, self.page_size, self.num_pages * self.page_size,
                            self.config.num_speculative_tokens, lookahead_width(self.num_draft_modules))
        ints, floats = (array_spec(x, replicated(self.mesh)) for x in pack_batch(batch))
        params, cache, recurrent, logits_state, carry = self._state_specs
        static = (shape, self.step_config)
        with matmul_precision(self.model_config.dtype):
            if not shape.masked:
                return (jitted_step.lower(params, cache, recurrent, logits_state, carry, ints, floats, oracle, *static),)
            forward = jitted_forward.lower(params, cache, recurrent, carry, ints, floats, *static)
            hidden = jax.ShapeDtypeStruct(forward.out_info[2].shape, forward.out_info[2].dtype,
                                          sharding=replicated(self.mesh))
            bitmask = jax.ShapeDtypeStruct((shape.num_seqs, self.config.num_speculative_tokens + 1, self.mask_width),
                                           np.int32, sharding=replicated(self.mesh))
            finish = jitted_finish.lower(*finish_inputs(jax.tree.map(array_spec, self.params), cache,
                                                        self.model_config.num_kv_layers), recurrent,
                                         logits_state, carry, ints, floats, hidden, bitmask, oracle, *static,
                                         self.page_size)
        return forward, finish

    def cache_copies(self, shape: BatchShape) -> list[str]:
        """Lines of the compiled step's optimised HLO that copy a KV page array, for
        tests and benchmarks: with the cache donated there should be none."""
        pages = self.cache.k[0].shape
        names = [",".join(map(str, pages)), ",".join(map(str, (pages[0] * pages[1],) + pages[2:]))]
        text = self.lower_step(shape).compile().as_text()
        return [line.strip() for line in text.splitlines() if " copy(" in line and any(f"[{n}]" in line for n in names)]
