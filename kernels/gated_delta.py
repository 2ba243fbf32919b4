"""Gated DeltaNet's recurrence (Qwen3-Next / Qwen3.5 linear attention) as Pallas kernels
lowered through Triton: the recurrent form for decode and MTP verification, and the
chunked form's scan over chunks for prefill.

Contracts: `scan_rows_kernel` is jaxmtp.models.gated_delta.scan_rows' (the recurrent
form over inputs already normalised and spread over the value heads), `scan_chunks_kernel`
that module's scan_chunks', the second phase of gated_delta_chunked (the first, every
chunk's UT transform at once, is batched matrix products that XLA runs well). The
references run the whole batch as one scan over rows or chunks; here one program takes
one request, one value head and `block_dv` columns of its [dk, dv] state (the columns
never mix: every update of S is a product with S on the right), keeps that block of the
state in registers through the request's rows or chunks, and writes only what the
contract returns. Requests, heads and column blocks run side by side.

The state is float32 throughout, products at full float32 precision (no TF32), as the
references. Every memory access is an explicit gather (index vectors), so the same
kernels run under Triton on the GPU and under `interpret=True` on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxmtp.kernels.triton_common import TritonCompilerParams, mma_sizes
from jaxmtp.kernels.tiling_table import read_tilings, row_bucket

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class DeltaKernelConfig:
    """Static tiling of one call."""

    block_dv: int  # state columns per program
    num_warps: int
    num_stages: int


# First choices, not yet measured (benchmarks/gated_delta.py sweeps them): decode keeps
# a [dk, 16] block per program (batch 1 of Qwen3-Next: 32 heads x 8 blocks = 256
# programs); the scan's products are [C, dk] x [dk, 32].
ROWS_CONFIG = DeltaKernelConfig(16, 4, 1)
CHUNKS_CONFIG = DeltaKernelConfig(32, 4, 2)

# gated_delta_paths.json, as benchmarks/gated_delta.py writes it: (form: 0 for "rows",
# 1 for "chunks", Hv, dk, dv) -> {bucket: the kernel's tiling, where it beat XLA's
# reference, or "xla"}; the bucket: the batch's requests (rows) or chunks (chunks, as
# jaxmtp.models.gated_delta.chunk_count counts them), rounded up to a power of 2.
# Shapes and buckets it has not measured run XLA's reference.
FORMS = ("rows", "chunks")
MEASURED_PATHS = read_tilings("gated_delta_paths.json", DeltaKernelConfig)


def supports(dk: int, dv: int, chunk: int) -> bool:
    """Triton tiles dk, dv and the chunk as powers of 2 of at least 16 (an MMA minimum)."""
    return mma_sizes(dk, dv, chunk)


def measured_tiling(form: str, num_heads: int, dk: int, dv: int, size: int) -> DeltaKernelConfig | None:
    """The kernel's tiling where the table measured it faster than XLA's reference at
    this shape and size bucket; None where XLA's was faster or nothing was measured."""
    tiling = MEASURED_PATHS.get((FORMS.index(form), num_heads, dk, dv), {}).get(row_bucket(size))
    return None if tiling is None or tiling == "xla" else tiling


def _check_shapes(dv: int, block_dv: int, *arrays: jax.Array) -> None:
    """Column blocks must tile dv (the grid has dv // block_dv of them), and the kernels'
    element offsets are int32."""
    if dv % block_dv:
        raise ValueError(f"the gated delta kernels' block_dv {block_dv} does not divide linear_value_head_dim {dv}")
    for a in arrays:
        if a.size > 2**31 - 1:
            raise ValueError(f"the gated delta kernels index in int32: an operand of {a.size} values is too large")


def _load_start(state_ref, slot, is_fresh, head, keys, cols, num_heads: int):
    """The program's block of its request's starting state: its table row, zeros when
    fresh (whatever the table holds, NaN included)."""
    rows = (slot * num_heads + head) * keys.shape[0] + keys
    mask = jnp.broadcast_to(is_fresh == 0, (keys.shape[0], cols.shape[0]))
    return plgpu.load(state_ref.at[rows[:, None], cols[None, :]], mask=mask, other=0).astype(F32)


def _recurrent_kernel(query_start_ref, slots_ref, fresh_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, state_ref,
                      o_ref, tail_ref, *, num_heads: int, keep: int, block_dv: int):
    request, head, block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dk, dv = q_ref.shape[0] // g_ref.shape[0], v_ref.shape[0] // g_ref.shape[0]
    start, count = query_start_ref[request], query_start_ref[request + 1] - query_start_ref[request]
    keys = jnp.arange(dk, dtype=jnp.int32)
    cols = block * block_dv + jnp.arange(block_dv, dtype=jnp.int32)
    state = _load_start(state_ref, slots_ref[request], fresh_ref[request], head, keys, cols, num_heads)

    def store_tail(i, s, ok):
        rows = ((request * keep + i) * num_heads + head) * dk + keys
        plgpu.store(tail_ref.at[rows[:, None], cols[None, :]], s, mask=jnp.broadcast_to(ok, s.shape))

    # tail[i] is the state after row count - keep + i: the starting one where that precedes the first row
    for i in range(keep):
        store_tail(i, state, i < keep - count)

    def row(r, s):
        at = (start + r) * num_heads + head
        q = plgpu.load(q_ref.at[at * dk + keys])
        k = plgpu.load(k_ref.at[at * dk + keys])
        v = plgpu.load(v_ref.at[at * dv + cols])
        s = s * jnp.exp(g_ref[at])
        delta = (v - jnp.sum(k[:, None] * s, axis=0)) * beta_ref[at]
        s = s + k[:, None] * delta[None, :]
        plgpu.store(o_ref.at[at * dv + cols], jnp.sum(q[:, None] * s, axis=0))
        i = r - (count - keep)
        store_tail(jnp.maximum(i, 0), s, i >= 0)
        return s

    lax.fori_loop(0, count, row, state)


@functools.partial(jax.jit, static_argnames=("keep", "interpret", "config"))
def scan_rows_kernel(q, k, v, g, beta, state, query_start, slots, fresh, keep: int, *, interpret: bool = False,
                     config: DeltaKernelConfig | None = None):
    """jaxmtp.models.gated_delta.scan_rows (arguments and results as there) as one
    kernel; `config` overrides ROWS_CONFIG (for tuning)."""
    num_rows, num_heads, dv = v.shape
    dk, num_requests = q.shape[-1], slots.shape[0]
    config = config or ROWS_CONFIG
    block_dv = min(config.block_dv, dv)
    _check_shapes(dv, block_dv, state, q)
    tail_rows = num_requests * keep * num_heads * dk
    o, tail = pl.pallas_call(
        functools.partial(_recurrent_kernel, num_heads=num_heads, keep=keep, block_dv=block_dv),
        grid=(num_requests, num_heads, dv // block_dv),
        out_shape=[jax.ShapeDtypeStruct((num_rows * num_heads * dv,), F32),
                   jax.ShapeDtypeStruct((tail_rows, dv), F32)],
        compiler_params=TritonCompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="gated_delta_recurrent",
    )(query_start.astype(jnp.int32), slots.astype(jnp.int32), fresh.astype(jnp.int32), q.reshape(-1), k.reshape(-1),
      v.reshape(-1), g.reshape(-1), beta.reshape(-1), state.reshape(-1, dv))
    valid = jnp.arange(num_rows) < query_start[-1]  # rows no request owns were never written
    o = jnp.where(valid[:, None, None], o.reshape(num_rows, num_heads, dv), 0.0)
    return o, tail.reshape(num_requests, keep, num_heads, dk, dv)


def _chunks_kernel(chunk_start_ref, slots_ref, fresh_ref, u_ref, w_ref, q_ref, attn_ref, k_ref, decay_ref, state_ref,
                   o_ref, final_ref, *, num_heads: int, block_dv: int):
    request, head, block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dk, chunk = q_ref.shape[-1], attn_ref.shape[-1]
    keys = jnp.arange(dk, dtype=jnp.int32)
    cols = block * block_dv + jnp.arange(block_dv, dtype=jnp.int32)
    chunk_rows = jnp.arange(chunk, dtype=jnp.int32)
    state = _load_start(state_ref, slots_ref[request], fresh_ref[request], head, keys, cols, num_heads)
    dot = functools.partial(plgpu.dot, precision=lax.Precision.HIGHEST)

    def one_chunk(c, s):
        rows = ((c * num_heads + head) * chunk + chunk_rows)[:, None]
        u = plgpu.load(u_ref.at[rows, cols[None, :]])
        w = plgpu.load(w_ref.at[rows, keys[None, :]])
        q = plgpu.load(q_ref.at[rows, keys[None, :]])
        attn = plgpu.load(attn_ref.at[rows, chunk_rows[None, :]])
        k = plgpu.load(k_ref.at[rows, keys[None, :]])
        v_new = u - dot(w, s)
        plgpu.store(o_ref.at[rows, cols[None, :]], dot(q, s) + dot(attn, v_new))
        return s * decay_ref[c * num_heads + head] + dot(k, v_new, trans_a=True)

    state = lax.fori_loop(chunk_start_ref[request], chunk_start_ref[request + 1], one_chunk, state)
    final_rows = (request * num_heads + head) * dk + keys
    plgpu.store(final_ref.at[final_rows[:, None], cols[None, :]], state)


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def scan_chunks_kernel(terms, chunk_start, state, slots, fresh, *, interpret: bool = False,
                       config: DeltaKernelConfig | None = None):
    """jaxmtp.models.gated_delta.scan_chunks (arguments and results as there; terms: its
    ChunkTerms, in their order) as one kernel; `config` overrides CHUNKS_CONFIG (for
    tuning)."""
    u, w, q_decayed, attn, k_to_end, decay = terms
    num_chunks, num_heads, chunk, dv = u.shape
    dk, num_requests = w.shape[-1], slots.shape[0]
    config = config or CHUNKS_CONFIG
    block_dv = min(config.block_dv, dv)
    _check_shapes(dv, block_dv, state, attn)
    rows = num_chunks * num_heads * chunk
    o, final = pl.pallas_call(
        functools.partial(_chunks_kernel, num_heads=num_heads, block_dv=block_dv),
        grid=(num_requests, num_heads, dv // block_dv),
        out_shape=[jax.ShapeDtypeStruct((rows, dv), F32),
                   jax.ShapeDtypeStruct((num_requests * num_heads * dk, dv), F32)],
        compiler_params=TritonCompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="gated_delta_scan_chunks",
    )(chunk_start.astype(jnp.int32), slots.astype(jnp.int32), fresh.astype(jnp.int32), u.reshape(rows, dv),
      w.reshape(rows, dk), q_decayed.reshape(rows, dk), attn.reshape(rows, chunk), k_to_end.reshape(rows, dk),
      decay.reshape(-1), state.reshape(-1, dv))
    return o.reshape(num_chunks, num_heads, chunk, dv), final.reshape(num_requests, num_heads, dk, dv)

