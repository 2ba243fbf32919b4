"""MLA prefill rows in the split form: the cached prefix in the absorbed form, the step's
own rows in the expanded form, the two partial softmax results merged.

The absorbed form (kernels/mla_attention.py) multiplies every (row, token) pair through
R + Dr latent values a head and R more for the values: 2 (R + Dr + R) FLOPs, against
2 (Dn + Dr + Dv) in the expanded form (DeepSeek-V3: 2176 against 640, 3.4x). The
expanded form needs each context token's per-head keys and values, built from its
latent at 2 R (Dn + Dv) FLOPs a head; built once per token, that is cheap next to the
attention of a long chunk. A step's own rows need no gather to build them: their
latents are the step's `latent` rows, so a prefill row attends

  - to its sequence's tokens before this step (cached: prefix caching, earlier chunks)
    in the absorbed form (`mla_absorbed_attention(prefix_only=True)`), and
  - to the rows of its own sequence in this step, up to itself, in the expanded form:
    keys (latent @ W_UK, the shared rope key) and values (latent @ W_UV) from one pair
    of GEMMs over the step's rows, then a causal flash-attention kernel over them,

and the two results merge by their softmax denominators (a prefix that is empty
weighs 0). A whole prompt in one chunk runs the expanded form alone. Same contract as
the absorbed prefill call: rows of sequences with more than `decode_rows` rows this
step, others 0.

Every memory access is an explicit gather (row index vectors), so the kernel runs
under Triton on the GPU and under `interpret=True` on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxmtp.kernels.mla_attention import mla_absorbed_attention
from jaxmtp.kernels.reference import row_ownership
from jaxmtp.kernels.triton_common import (TritonCompilerParams, cdiv, locate_q_block, mma_sizes,
                                          online_softmax_step, q_block_bound)
from jaxmtp.kernels.tiling_table import nearest_bucket, nearest_context_entry, read_tilings

_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class OwnRowsConfig:
    """Static tiling of the own-rows kernel: one program takes block_q rows of one
    sequence for one head."""

    block_q: int = 64
    block_kv: int = 64
    num_warps: int = 4
    num_stages: int = 2


def supports(nope_dim: int, rope_dim: int, v_dim: int) -> bool:
    """The own-rows kernel tiles Dn, Dr and Dv as powers of 2 of at least 16."""
    return mma_sizes(nope_dim, rope_dim, v_dim)


def _own_rows_kernel(query_start_ref, kv_lens_ref, q_nope_ref, q_rope_ref, k_nope_ref, k_rope_ref, v_ref, o_ref,
                     lse_ref, *, num_heads: int, num_blocks: int, min_rows: int, block_q: int, block_kv: int,
                     sm_scale: float):
    head, program = pl.program_id(0), pl.program_id(1)
    nope_dim, rope_dim, v_dim = q_nope_ref.shape[-1], q_rope_ref.shape[-1], v_ref.shape[-1]
    precision = lax.Precision.HIGHEST if q_nope_ref.dtype == jnp.float32 else None
    # the blocks that see the most rows start first
    seq, row_start, num_rows, _ = locate_q_block(query_start_ref, kv_lens_ref, num_blocks - 1 - program,
                                                 block_q=block_q, min_rows=min_rows)
    seq_start = query_start_ref[seq]
    row = row_start + jnp.arange(block_q, dtype=jnp.int32)
    row_ok = row < row_start + num_rows
    q_index = row * num_heads + head
    nope_ids, rope_ids, v_ids = (jnp.arange(d, dtype=jnp.int32) for d in (nope_dim, rope_dim, v_dim))
    q_nope = plgpu.load(q_nope_ref.at[q_index[:, None], nope_ids[None, :]], mask=row_ok[:, None], other=0)
    q_rope = plgpu.load(q_rope_ref.at[q_index[:, None], rope_ids[None, :]], mask=row_ok[:, None], other=0)

    # kv row j of step s is seq_start + s * block_kv + j; steps below full_hi lie at or
    # before the block's first row (seen whole by every row), the rest are masked
    kv_end = row_start + num_rows
    step_hi = jnp.where(num_rows > 0, cdiv(kv_end - seq_start, block_kv), 0)  # a block past the last: nothing
    full_hi = jnp.clip((row_start - seq_start + 1) // block_kv, 0, step_hi)

    def step(kv_step, carry, *, masked: bool):
        kv_row = seq_start + kv_step * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
        kv_ok = kv_row < kv_end if masked else None
        kv_index = kv_row * num_heads + head

        def load(ref, index, ids):
            mask = None if kv_ok is None else kv_ok[:, None]
            return plgpu.load(ref.at[index[:, None], ids[None, :]], mask=mask, other=0 if masked else None)

        logits = plgpu.dot(q_nope, load(k_nope_ref, kv_index, nope_ids), trans_b=True, precision=precision)
        logits += plgpu.dot(q_rope, load(k_rope_ref, kv_row, rope_ids), trans_b=True, precision=precision)
        logits = logits * (sm_scale * _LOG2E)
        if masked:
            logits = jnp.where(kv_ok[None, :] & (kv_row[None, :] <= row[:, None]), logits, -jnp.inf)
        return online_softmax_step(carry, logits, lambda: load(v_ref, kv_index, v_ids), masked=masked,
                                   precision=precision)

    carry = (jnp.zeros((block_q, v_dim), jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    carry = lax.fori_loop(0, full_hi, functools.partial(step, masked=False), carry)
    acc, row_max, row_sum = lax.fori_loop(full_hi, step_hi, functools.partial(step, masked=True), carry)
    row_sum = jnp.where(row_ok, row_sum, 1.0)  # every owned row sees itself
    plgpu.store(o_ref.at[q_index[:, None], v_ids[None, :]], acc / row_sum[:, None], mask=row_ok[:, None])
    plgpu.store(lse_ref.at[q_index], row_max + jnp.log2(row_sum), mask=row_ok)


@functools.partial(jax.jit, static_argnames=("sm_scale", "decode_rows", "interpret", "config"))
def own_rows_attention(q_nope, q_rope, k_nope, k_rope, v, kv_lens, query_start, *, sm_scale: float,
                       decode_rows: int, interpret: bool = False, config: OwnRowsConfig | None = None):
    """q_nope [T, Hq, Dn], q_rope [T, Hq, Dr] (rotated), the step's own keys k_nope
    [T, Hq, Dn], k_rope [T, Dr] and values v [T, Hq, Dv] -> (out [T, Hq, Dv] float32,
    lse [T, Hq]): each row of a sequence with more than decode_rows rows attends causally
    to its sequence's rows of this step, up to itself; lse is log2 of its softmax
    denominator over base-2 logits. Rows of other sequences come out 0 (lse -inf)."""
    config = config or OwnRowsConfig()
    num_rows, num_heads, nope_dim = q_nope.shape
    if not supports(nope_dim, q_rope.shape[-1], v.shape[-1]):
        raise ValueError(f"the own-rows MLA kernel needs the nope, rope and value head dims powers of 2 >= 16, "
                         f"got {nope_dim}, {q_rope.shape[-1]} and {v.shape[-1]}")
    min_rows = decode_rows + 1
    num_blocks = q_block_bound(num_rows, kv_lens.shape[0], config.block_q, min_rows, None)
    flat = num_rows * num_heads
    kernel = functools.partial(_own_rows_kernel, num_heads=num_heads, num_blocks=num_blocks, min_rows=min_rows,
                               block_q=config.block_q, block_kv=config.block_kv, sm_scale=float(sm_scale))
    query_start = query_start.astype(jnp.int32)
    out, lse = pl.pallas_call(
        kernel,
        grid=(num_heads, num_blocks),
        out_shape=[jax.ShapeDtypeStruct((flat, v.shape[-1]), jnp.float32), jax.ShapeDtypeStruct((flat,), jnp.float32)],
        compiler_params=TritonCompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="mla_own_rows_attention",
    )(query_start, kv_lens.astype(jnp.int32), q_nope.reshape(flat, nope_dim), q_rope.reshape(flat, -1),
      k_nope.reshape(flat, nope_dim), k_rope, v.reshape(flat, -1))
    seq, owned = row_ownership(query_start, num_rows)
    taken = owned & ((query_start[1:] - query_start[:-1])[seq] >= min_rows)
    return (jnp.where(taken[:, None, None], out.reshape(num_rows, num_heads, -1), 0.0),
            jnp.where(taken[:, None], lse.reshape(num_rows, num_heads), -jnp.inf))


def mla_split_prefill(q_nope, q_rope, latent, rope_key, latent_pages, rope_pages, kv_lens, page_table, query_start,
                      w_uk, w_uv, *, sm_scale: float, decode_rows: int, interpret: bool = False,
                      config: OwnRowsConfig | None = None, rope_tables: tuple | None = None,
                      rope_interleave: bool = False, q_whole=None) -> jax.Array:
    """The prefill rows' attention output [T, Hq, Dv] in the split form (module
    docstring); others 0. q_nope [T, Hq, Dn] and q_rope [T, Hq, Dr] (rotated); latent
    [T, R] and rope_key [T, Dr] are the step's rows as written to the cache; w_uk
    [R, Hq, Dn] and w_uv [R, Hq, Dv] as kernels/mla_reference.py. With rope_tables the
    prefix call rotates q_whole's rope part itself (mla_absorbed_attention)."""
    cache = (latent_pages, rope_pages, kv_lens, page_table, query_start)
    q_latent = jnp.einsum("thd,rhd->thr", q_nope, w_uk)
    prefix, prefix_lse = mla_absorbed_attention(
        q_latent, q_rope if rope_tables is None else q_whole, *cache, sm_scale=sm_scale, decode_rows=decode_rows,
        prefill=True, interpret=interpret, rope_tables=rope_tables, rope_interleave=rope_interleave,
        prefix_only=True)
    # the own rows' keys and values from their latents as the cache holds them
    latent = latent.astype(latent_pages.dtype)
    k_nope = jnp.einsum("tr,rhd->thd", latent, w_uk)
    v = jnp.einsum("tr,rhd->thd", latent, w_uv)
    own, own_lse = own_rows_attention(q_nope, q_rope, k_nope, rope_key.astype(rope_pages.dtype), v, kv_lens,
                                      query_start, sm_scale=sm_scale, decode_rows=decode_rows, interpret=interpret,
                                      config=config)
    prefix_v = jnp.einsum("thr,rhv->thv", prefix, w_uv, preferred_element_type=jnp.float32)
    top = jnp.maximum(prefix_lse, own_lse)
    top = jnp.where(top > -jnp.inf, top, 0.0)
    prefix_weight, own_weight = jnp.exp2(prefix_lse - top), jnp.exp2(own_lse - top)
    total = prefix_weight + own_weight
    out = prefix_weight[..., None] * prefix_v + own_weight[..., None] * own
    return (out / jnp.where(total > 0, total, 1.0)[..., None]).astype(q_nope.dtype)


# mla_prefill_paths.json, as benchmarks/mla_sweep.py --prefill writes it: (heads, R, Dr,
# Dn, Dv, context bucket) -> {row bucket: the own-rows kernel's fastest tiling where the
# split form beat the absorbed prefill call, or "absorbed"}; the buckets: the page
# table's width in tokens and the step's rows, each rounded up to a power of 2. A shape
# the table lacks runs the absorbed call (the split form is taken where it was measured
# faster); a context or row bucket it lacks takes the nearest one measured (a step's
# rows are its chunk's plus the decode rows beside it: 2048 + 32 rows is bucket 4096).
MEASURED_PATHS = read_tilings("mla_prefill_paths.json", OwnRowsConfig)


def measured_prefill_path(num_heads: int, rank: int, rope_dim: int, nope_dim: int, v_dim: int, num_rows: int,
                          context: int) -> OwnRowsConfig | None:
    """The split form's tiling where the table measured it faster than the absorbed
    prefill call at this shape, else None (the absorbed call)."""
    if not supports(nope_dim, rope_dim, v_dim):
        return None
    entry = nearest_context_entry(MEASURED_PATHS, (num_heads, rank, rope_dim, nope_dim, v_dim), context)
    path = entry.get(nearest_bucket(entry, num_rows))
    return path if isinstance(path, OwnRowsConfig) else None
