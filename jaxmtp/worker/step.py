"""The jitted engine step: main forward over a mixed batch of prefill chunks and
decode/verify rows, sampling or verification, and the MTP draft pass. The KV cache
(and a hybrid model's recurrent state) goes in and comes out donated; the host reads back only tokens and counts.

The carry lets the host dispatch step N+1 before it has read step N: requests whose
step N emits tokens are scheduled with placeholder rows, which this step fills from
step N's carry on the device (batch.apply_carry).

A step with constrained requests (a masked shape) runs as two programs, forward and
finish, so that the part that needs no grammar mask, nearly all of the step's time,
runs while the host reads step N and computes step N+1's masks from its tokens."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxmtp.models import hybrid, model
from jaxmtp.models.config import ModelConfig
from jaxmtp.models.linear import dense_kernels, dense_kernels_for
from jaxmtp.models.params import Params, pytree_dataclass
from jaxmtp.worker import mtp
from jaxmtp.worker.batch import Batch, BatchShape, Carry, apply_carry, lookahead_width, unpack_batch
from jaxmtp.worker.cache import KVCache
from jaxmtp.worker.logits_processors import LogitsState, process_logits, record_emitted
from jaxmtp.worker.packed_params import ParamLayout
from jaxmtp.worker.prompt_logprobs import PromptLogprobs, prompt_logprobs
from jaxmtp.worker.recurrent import RecurrentState, commit, constrain_recurrent
from jaxmtp.worker.sampling import accept_drafts, chosen_logprobs, verify_and_sample
from jaxmtp.worker.sharding import argmax_vocab, gather_vocab, replicated


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static facts the step is compiled for."""

    model: ModelConfig
    num_speculative_tokens: int = 0
    num_draft_modules: int = 0  # M: MTP modules the draft pass runs, min(k, modules loaded)
    attention_backend: str = "auto"
    mtp_boundary: str = "next_chunk"
    num_top_logprobs: int = 0
    mesh: Mesh | None = None  # tensor parallelism (jaxmtp.worker.sharding); None: one device, no shard_map
    # step and forward take their params packed in this layout (jaxmtp/worker/packed_params.py); None: as a tree
    param_layout: ParamLayout | None = None


@pytree_dataclass
class StepOutput:
    tokens: jax.Array  # [B, k+1] emitted tokens; request b emits tokens[b, :num_accepted[b] + 1]
    num_accepted: jax.Array  # [B]
    # None in greedy shapes (no request asks for logprobs); the top ones also when the
    # engine serves no top logprobs (num_top_logprobs 0)
    logprobs: jax.Array | None  # [B, k+1] log-probability of each emitted token
    ranks: jax.Array | None  # [B, k+1] its rank in the model's distribution
    top_logprobs: jax.Array | None  # [B, k+1, n]
    top_token_ids: jax.Array | None  # [B, k+1, n]
    drafts: jax.Array  # [B, k] next proposals (k = 0: empty; oracle_drafts when an oracle is given)
    boundary_token: jax.Array  # [B] token the draft pass used at each request's boundary row
    carry: Carry  # for the next step's carried requests
    prompt: PromptLogprobs | None  # [T] rows, in a step compiled with BatchShape.prompt_logprobs


def step(
    params: Params | tuple,
    cache: KVCache,
    recurrent: RecurrentState,
    logits_state: LogitsState,
    carry: Carry,
    ints: jax.Array,
    floats: jax.Array,
    oracle_tokens: jax.Array | None,
    shape: BatchShape,
    config: StepConfig,
) -> tuple[KVCache, RecurrentState, LogitsState, StepOutput]:
    """The step of an unmasked shape, one program. recurrent: a hybrid model's
    linear-attention states (jaxmtp/worker/recurrent.py; empty for the others) and
    logits_state: what logits processing reads across steps, both donated as the cache
    is; carry: the previous step's StepOutput.carry; ints/floats: the batch packed by batch.pack_batch; oracle_tokens:
    None, or a benchmark's table whose tokens replace the MTP drafts (oracle_drafts);
    shape (static): how to unpack the batch, and whether no row samples, asks for top
    logprobs or for logits processing (BatchShape.greedy). params: packed as config.param_layout says."""
    params = _unpacked(params, config)
    with dense_kernels(dense_kernels_for(config.attention_backend, config.mesh)):
        batch = _batch_in(ints, floats, carry, shape, config, cache.page_size)
        cache, recurrent, hidden = _main_forward(params, cache, recurrent, batch, shape, config)
        return _sample_and_draft(params, cache, recurrent, logits_state, carry, batch, hidden, None, oracle_tokens,
                                 shape, config)


def forward(params: Params | tuple, cache: KVCache, recurrent: RecurrentState, carry: Carry, ints: jax.Array,
            floats: jax.Array, shape: BatchShape, config: StepConfig) -> tuple[KVCache, RecurrentState, jax.Array]:
    """A masked shape's first program: the main forward, the cache and recurrent state
    donated (the latter holding the verify rows' states until finish commits one);
    returns the hidden rows [T, H]. It needs no grammar mask, so the host dispatches it before it
    has read the previous step, whose tokens the masks depend on, and computes the masks
    while it runs. params: as step's."""
    params = _unpacked(params, config)
    with dense_kernels(dense_kernels_for(config.attention_backend, config.mesh)):
        batch = _batch_in(ints, floats, carry, shape, config, cache.page_size)
        return _main_forward(params, cache, recurrent, batch, shape, config)


def _unpacked(params: Params | tuple, config: StepConfig) -> Params:
    return params if config.param_layout is None else config.param_layout.unpack(params)


def finish(params: Params, cache: KVCache, recurrent: RecurrentState, logits_state: LogitsState, carry: Carry,
           ints: jax.Array, floats: jax.Array, hidden: jax.Array, token_bitmask: jax.Array,
           oracle_tokens: jax.Array | None, shape: BatchShape, config: StepConfig, page_size: int
           ) -> tuple[KVCache, RecurrentState, LogitsState, StepOutput]:
    """A masked shape's second program, on forward's hidden rows and the same batch and
    carry: verification and sampling under token_bitmask [B, k+1, W] (per verify row the
    tokens its grammar allows; structured_outputs.step_bitmask), the draft pass and the
    carry. params and cache: finish_inputs' parts of them; page_size (static): the cache's."""
    with dense_kernels(dense_kernels_for(config.attention_backend, config.mesh)):
        batch = _batch_in(ints, floats, carry, shape, config, page_size)
        return _sample_and_draft(params, cache, recurrent, logits_state, carry, batch, hidden, token_bitmask,
                                 oracle_tokens, shape, config)


def finish_inputs(params: Params, cache: KVCache, num_kv_layers: int) -> tuple[Params, KVCache]:
    """What finish reads of the parameters and the cache: all but the decoder layers, and
    the cache's draft part. Its compiled call takes only these: the host's dispatch costs
    a few microseconds an argument, and in a constrained step this dispatch is on the
    host's serial path between reading a step and queueing the next."""
    return dataclasses.replace(params, layers=[]), cache.draft_part(num_kv_layers)


def _batch_in(ints, floats, carry, shape: BatchShape, config: StepConfig, page_size: int) -> Batch:
    # Named scopes label the step's parts in the compiled program's metadata, so that
    # benchmarks/profile_step.py can sum device time per part (STEP_PARTS).
    with jax.named_scope("batch_in"):
        batch = unpack_batch(ints, floats, shape, config.num_speculative_tokens, lookahead_width(config.num_draft_modules))
        return apply_carry(batch, carry, page_size)


def _layer_ops(shape: BatchShape, config: StepConfig):
    # a verify step's k + 1 rows of a request, and fewer, are decode rows (MLA); a
    # decode-only step's real rows are at most those of its requests (the draft pass's too)
    decode_rows = config.num_speculative_tokens + 1
    return model.layer_ops(config.model, config.attention_backend, config.mesh, decode_rows=decode_rows,
                           prefill_rows=not shape.decode_only,
                           max_rows=shape.num_seqs * decode_rows if shape.decode_only else None)


def _main_forward(params, cache, recurrent, batch, shape: BatchShape, config: StepConfig):
    with jax.named_scope("main_forward"):
        if config.model.hybrid is None:
            hidden, cache = model.forward(params, config.model, batch, cache, _layer_ops(shape, config))
        else:
            hidden, cache, recurrent = hybrid.forward(params, config.model, batch, cache, recurrent,
                                                      _layer_ops(shape, config))
    if config.mesh is not None:  # as finish's compiled program takes it (ModelRunner.lower_programs)
        hidden = jax.lax.with_sharding_constraint(hidden, replicated(config.mesh))
    return cache, constrain_recurrent(recurrent, config.mesh), hidden


def _sample_and_draft(params, cache, recurrent, logits_state, carry, batch, hidden, token_bitmask, oracle_tokens,
                      shape, config):
    k, cfg = config.num_speculative_tokens, config.model
    prompt = prompt_logprobs(params, cfg, hidden, batch, config.num_top_logprobs, config.mesh) if shape.prompt_logprobs else None
    with jax.named_scope("verify"):
        tokens, num_accepted, logits_state, logprobs, ranks, top_values, top_ids = _verify(
            params, hidden, batch, logits_state, token_bitmask, shape, config)
        # the recurrent state after the last kept row (a prefill chunk's rows: all kept)
        has_rows = batch.query_start[1:] > batch.query_start[:-1]
        recurrent = constrain_recurrent(commit(recurrent, batch.recurrent_slot, batch.num_drafts - num_accepted,
                                               has_rows), config.mesh)
    b = batch.kv_len.shape[0]
    with jax.named_scope("draft"):
        if k:
            drafts, cache, boundary = mtp.propose(
                params, cfg, hidden, batch, tokens, num_accepted, cache, _layer_ops(shape, config), k, config.mtp_boundary,
                config.mesh,
            )
            if oracle_tokens is not None:  # before the carry: the next step's carried rows read it
                drafts = oracle_drafts(oracle_tokens, batch, num_accepted, drafts)
        else:
            drafts, boundary = jnp.zeros((b, 0), jnp.int32), jnp.zeros((b,), jnp.int32)
    with jax.named_scope("carry_out"):
        last = jnp.take_along_axis(tokens, num_accepted[:, None], axis=1)[:, 0]
        new_carry = jax.tree.map(
            lambda old, new: jnp.zeros_like(old).at[:b].set(new.astype(old.dtype)), carry, Carry(num_accepted, last, drafts)
        )
    return cache, recurrent, logits_state, StepOutput(
        tokens, num_accepted, logprobs, ranks, top_values, top_ids, drafts, boundary, new_carry, prompt
    )


# The parts of the step, in order, as its named scopes call them (profile_step.py).
STEP_PARTS = ("batch_in", "main_forward", "verify", "draft", "carry_out")


def _verify(params: Params, hidden: jax.Array, batch: Batch, logits_state: LogitsState, token_bitmask: jax.Array | None,
            shape: BatchShape, config: StepConfig):
    """The LM head at the verify rows, the grammar masks (a masked shape's token_bitmask),
    logits processing, and acceptance or sampling: (tokens [B, k+1], num_accepted [B],
    logits_state, logprobs, ranks, top values, top ids)."""
    k, cfg = config.num_speculative_tokens, config.model
    logits = model.logits(params.head(), params.final_norm, cfg, hidden[batch.sample_index])  # [B, k+1, V]
    # the draft checked at verify row j is the input id of row j+1
    t = batch.input_ids.shape[0]
    drafts_in = batch.input_ids[jnp.minimum(batch.sample_index[:, :k] + 1, t - 1)]
    if shape.greedy:
        if shape.masked:
            logits = apply_token_bitmask(logits, token_bitmask)
        # the argmax is all a greedy batch reads of its rows: no logits gather under TP
        tokens, num_accepted = accept_drafts(argmax_vocab(logits, config.mesh), drafts_in, batch.num_drafts)
        return tokens, num_accepted, logits_state, None, None, None, None  # no request asked for logprobs
    if config.mesh is not None:
        logits = gather_vocab(logits, config.mesh)
    raw_logits = logits
    if shape.masked:
        logits = apply_token_bitmask(logits, token_bitmask)
    logits = process_logits(logits, logits_state, batch, drafts_in)
    tokens, num_accepted = verify_and_sample(logits, drafts_in, batch.num_drafts, batch)
    logits_state = record_emitted(logits_state, batch, tokens, num_accepted)
    logprobs, ranks, top_values, top_ids = chosen_logprobs(raw_logits, tokens, config.num_top_logprobs)
    return tokens, num_accepted, logits_state, logprobs, ranks, top_values, top_ids


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """logits [B, R, V] with the tokens whose bit is clear in bitmask [B, R, W] at -inf."""
    v = logits.shape[-1]
    token = jnp.arange(v)
    allowed = (bitmask[..., token // 32] >> (token % 32)) & 1
    return jnp.where(allowed != 0, logits, -jnp.inf)


def oracle_drafts(table: jax.Array, batch: Batch, num_accepted: jax.Array, drafts: jax.Array) -> jax.Array:
    """Benchmark hook: the drafts [B, k] replaced by the next k tokens of each request's
    row of table [R, L], the output of an earlier plain greedy run, so that every draft
    verification checks is accepted (the speedup's ceiling at the same step cost: the
    MTP modules still ran). Requests without output this step (mid-prefill chunks,
    padding) keep the module's drafts: nothing verifies them.

    A request's row is its sampling seed: greedy requests, the only ones a plain run's
    tokens are an oracle for, ignore the seed, and the batch already carries it, so a
    benchmark-only field need not run through SamplingParams, Sequence and the packed
    batch. Indices are clamped into the table; past a row's end any token will do."""
    rows, length = table.shape
    row = jnp.minimum(batch.seed, rows - 1).astype(jnp.int32)
    emitted = batch.output_index + num_accepted + 1  # tokens the request has after this step
    index = jnp.minimum(emitted[:, None] + jnp.arange(drafts.shape[1]), length - 1)
    return jnp.where(batch.has_output[:, None], table[row[:, None], index], drafts)


# The device state the runner holds across steps, as the step's arguments after params
# name it; the step donates the first three. ModelRunner.reset rebuilds every one of them
# after a failed step, so a state added here is rebuilt too (tests/test_reliability.py).
STEP_STATE = ("cache", "recurrent", "logits_state", "carry")
DONATED_STATE = ("cache", "recurrent", "logits_state")
jitted_step = jax.jit(step, static_argnames=("config", "shape"), donate_argnames=DONATED_STATE)
jitted_forward = jax.jit(forward, static_argnames=("config", "shape"), donate_argnames=("cache", "recurrent"))
jitted_finish = jax.jit(finish, static_argnames=("config", "shape", "page_size"), donate_argnames=DONATED_STATE)


def matmul_precision(dtype: str):
    """The precision the step's XLA dots trace at (the Pallas kernels pick theirs from
    their operands' dtype): a float32 model computes in float32, where a GPU's default
    float32 dot rounds its operands to TF32; bf16 (and fp8, which computes in bf16)
    keeps the default, the fast path."""
    return jax.default_matmul_precision("highest") if dtype == "float32" else contextlib.nullcontext()
