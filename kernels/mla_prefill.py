"""MLA prefill rows in the split form: the step's own rows in the expanded form, the
cached prefix in either form, the two partial softmax results merged.

The absorbed form (kernels/mla_attention.py) multiplies every (row, token) pair through
R + Dr latent values a head and R more for the values: 2 (R + Dr + R) FLOPs, against
2 (Dn + Dr + Dv) in the expanded form (DeepSeek-V3: 2176 against 640, 3.4x). The
expanded form needs each context token's per-head keys and values, built from its
latent at 2 R (Dn + Dv) FLOPs a head; built once per token, that is cheap next to the
attention of a long chunk. A prefill row attends

  - to the rows of its own sequence in this step, up to itself, in the expanded form:
    their latents are the step's `latent` rows, so keys (latent @ W_UK, the shared rope
    key) and values (latent @ W_UV) come from one pair of GEMMs over the step's rows
    with no gather, then a causal flash-attention kernel runs over them;
  - to its sequence's tokens before this step (cached: prefix caching, earlier chunks)
    either expanded too, a window of prefix tokens a pass (gathered through the page
    table, expanded by two GEMMs, attended by the same kernel without the causal mask),
    or absorbed (`mla_absorbed_attention(prefix_only=True)`), which builds nothing and
    wins where the prefix is long against the rows that read it;

and the results merge by their softmax denominators (a prefix that is empty weighs 0).
A whole prompt in one chunk runs the own rows alone. Same contract as the absorbed
prefill call: rows of sequences with more than `decode_rows` rows this step, others 0.

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
    """Static tiling of the expanded kernel (own rows and prefix passes): one program
    takes block_q rows of one sequence for one head. prefix_window: the prefix tokens
    expanded a pass (expanded_prefix); 0 takes the prefix in the absorbed form."""

    block_q: int = 64
    block_kv: int = 64
    num_warps: int = 4
    num_stages: int = 2
    prefix_window: int = 0


def supports(nope_dim: int, rope_dim: int, v_dim: int) -> bool:
    """The own-rows kernel tiles Dn, Dr and Dv as powers of 2 of at least 16."""
    return mma_sizes(nope_dim, rope_dim, v_dim)


def _expanded_kernel(query_start_ref, kv_lens_ref, kv_start_ref, kv_count_ref, q_nope_ref, q_rope_ref, k_nope_ref,
                     k_rope_ref, v_ref, o_ref, lse_ref, *, num_heads: int, num_blocks: int, min_rows: int, block_q: int,
                     block_kv: int, sm_scale: float, causal: bool):
    head, program = pl.program_id(0), pl.program_id(1)
    nope_dim, rope_dim, v_dim = q_nope_ref.shape[-1], q_rope_ref.shape[-1], v_ref.shape[-1]
    precision = lax.Precision.HIGHEST if q_nope_ref.dtype == jnp.float32 else None
    # the blocks that see the most rows start first
    seq, row_start, num_rows, _ = locate_q_block(query_start_ref, kv_lens_ref, num_blocks - 1 - program,
                                                 block_q=block_q, min_rows=min_rows)
    row = row_start + jnp.arange(block_q, dtype=jnp.int32)
    row_ok = row < row_start + num_rows
    q_index = row * num_heads + head
    nope_ids, rope_ids, v_ids = (jnp.arange(d, dtype=jnp.int32) for d in (nope_dim, rope_dim, v_dim))
    q_nope = plgpu.load(q_nope_ref.at[q_index[:, None], nope_ids[None, :]], mask=row_ok[:, None], other=0)
    q_rope = plgpu.load(q_rope_ref.at[q_index[:, None], rope_ids[None, :]], mask=row_ok[:, None], other=0)

    # kv row j of step s is kv_base + s * block_kv + j; steps below full_hi are seen whole
    # by every row of the block, the rest are masked
    if causal:  # the sequence's own rows, kv row i being q row i: each row sees those up to itself
        kv_base = query_start_ref[seq]
        kv_end = row_start + num_rows
        full = row_start - kv_base + 1
    else:  # kv_count rows from kv_start, every one seen by every row
        kv_base = kv_start_ref[seq]
        kv_end = kv_base + kv_count_ref[seq]
        full = kv_end - kv_base
    step_hi = jnp.where(num_rows > 0, cdiv(kv_end - kv_base, block_kv), 0)  # a block past the last: nothing
    full_hi = jnp.clip(full // block_kv, 0, step_hi)

    def step(kv_step, carry, *, masked: bool):
        kv_row = kv_base + kv_step * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
        kv_ok = kv_row < kv_end if masked else None
        kv_index = kv_row * num_heads + head

        def load(ref, index, ids):
            mask = None if kv_ok is None else kv_ok[:, None]
            return plgpu.load(ref.at[index[:, None], ids[None, :]], mask=mask, other=0 if masked else None)

        logits = plgpu.dot(q_nope, load(k_nope_ref, kv_index, nope_ids), trans_b=True, precision=precision)
        logits += plgpu.dot(q_rope, load(k_rope_ref, kv_row, rope_ids), trans_b=True, precision=precision)
        logits = logits * (sm_scale * _LOG2E)
        if masked:
            seen = kv_ok[None, :] & (kv_row[None, :] <= row[:, None]) if causal else kv_ok[None, :]
            logits = jnp.where(seen, logits, -jnp.inf)
        return online_softmax_step(carry, logits, lambda: load(v_ref, kv_index, v_ids), masked=masked,
                                   precision=precision)

    carry = (jnp.zeros((block_q, v_dim), jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    carry = lax.fori_loop(0, full_hi, functools.partial(step, masked=False), carry)
    acc, row_max, row_sum = lax.fori_loop(full_hi, step_hi, functools.partial(step, masked=True), carry)
    seen_any = row_sum > 0  # a row with no kv rows (none in this context) comes out 0, lse -inf
    plgpu.store(o_ref.at[q_index[:, None], v_ids[None, :]], acc / jnp.where(seen_any, row_sum, 1.0)[:, None],
                mask=row_ok[:, None])
    plgpu.store(lse_ref.at[q_index], jnp.where(seen_any, row_max + jnp.log2(row_sum), -jnp.inf), mask=row_ok)


@functools.partial(jax.jit, static_argnames=("sm_scale", "decode_rows", "interpret", "config", "causal"))
def _expanded_attention(q_nope, q_rope, k_nope, k_rope, v, kv_lens, query_start, kv_start, kv_count, *,
                        sm_scale: float, decode_rows: int, causal: bool, interpret: bool = False,
                        config: OwnRowsConfig | None = None):
    config = config or OwnRowsConfig()
    num_rows, num_heads, nope_dim = q_nope.shape
    if not supports(nope_dim, q_rope.shape[-1], v.shape[-1]):
        raise ValueError(f"the expanded MLA kernel needs the nope, rope and value head dims powers of 2 >= 16, "
                         f"got {nope_dim}, {q_rope.shape[-1]} and {v.shape[-1]}")
    min_rows = decode_rows + 1
    num_blocks = q_block_bound(num_rows, kv_lens.shape[0], config.block_q, min_rows, None)
    flat = num_rows * num_heads
    kernel = functools.partial(_expanded_kernel, num_heads=num_heads, num_blocks=num_blocks, min_rows=min_rows,
                               block_q=config.block_q, block_kv=config.block_kv, sm_scale=float(sm_scale),
                               causal=causal)
    query_start = query_start.astype(jnp.int32)
    flat_kv = k_nope.shape[0] * num_heads
    out, lse = pl.pallas_call(
        kernel,
        grid=(num_heads, num_blocks),
        out_shape=[jax.ShapeDtypeStruct((flat, v.shape[-1]), jnp.float32), jax.ShapeDtypeStruct((flat,), jnp.float32)],
        compiler_params=TritonCompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="mla_own_rows_attention" if causal else "mla_context_attention",
    )(query_start, kv_lens.astype(jnp.int32), kv_start.astype(jnp.int32), kv_count.astype(jnp.int32),
      q_nope.reshape(flat, nope_dim), q_rope.reshape(flat, -1), k_nope.reshape(flat_kv, nope_dim), k_rope,
      v.reshape(flat_kv, -1))
    seq, owned = row_ownership(query_start, num_rows)
    taken = owned & ((query_start[1:] - query_start[:-1])[seq] >= min_rows)
    return (jnp.where(taken[:, None, None], out.reshape(num_rows, num_heads, -1), 0.0),
            jnp.where(taken[:, None], lse.reshape(num_rows, num_heads), -jnp.inf))


def own_rows_attention(q_nope, q_rope, k_nope, k_rope, v, kv_lens, query_start, *, sm_scale: float,
                       decode_rows: int, interpret: bool = False, config: OwnRowsConfig | None = None):
    """q_nope [T, Hq, Dn], q_rope [T, Hq, Dr] (rotated), the step's own keys k_nope
    [T, Hq, Dn], k_rope [T, Dr] and values v [T, Hq, Dv] -> (out [T, Hq, Dv] float32,
    lse [T, Hq]): each row of a sequence with more than decode_rows rows attends causally
    to its sequence's rows of this step, up to itself; lse is log2 of its softmax
    denominator over base-2 logits. Rows of other sequences come out 0 (lse -inf)."""
    unused = jnp.zeros(kv_lens.shape, jnp.int32)
    return _expanded_attention(q_nope, q_rope, k_nope, k_rope, v, kv_lens, query_start, unused, unused,
                               sm_scale=sm_scale, decode_rows=decode_rows, causal=True, interpret=interpret,
                               config=config)


def context_attention(q_nope, q_rope, k_nope, k_rope, v, kv_start, kv_count, kv_lens, query_start, *,
                      sm_scale: float, decode_rows: int, interpret: bool = False, config: OwnRowsConfig | None = None):
    """As own_rows_attention, over other keys and values (k_nope [N, Hq, Dn], k_rope
    [N, Dr], v [N, Hq, Dv]): each row of sequence s attends to rows kv_start[s] ..
    kv_start[s] + kv_count[s] - 1 of them, all of them; a row whose count is 0 comes
    out 0, lse -inf."""
    return _expanded_attention(q_nope, q_rope, k_nope, k_rope, v, kv_lens, query_start, kv_start, kv_count,
                               sm_scale=sm_scale, decode_rows=decode_rows, causal=False, interpret=interpret,
                               config=config)


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Two softmax results over disjoint keys ([T, Hq, D] each, normalized, with their
    base-2 log denominators [T, Hq]; -inf: no keys) -> their result over the union, and
    its lse."""
    top = jnp.maximum(lse_a, lse_b)
    top = jnp.where(top > -jnp.inf, top, 0.0)
    weight_a, weight_b = jnp.exp2(lse_a - top), jnp.exp2(lse_b - top)
    total = weight_a + weight_b
    out = (weight_a[..., None] * out_a + weight_b[..., None] * out_b) / jnp.where(total > 0, total, 1.0)[..., None]
    return out, jnp.where(total > 0, top + jnp.log2(total), -jnp.inf)


def expanded_keys_values(latent, w_uk, w_uv):
    """Latent rows [N, R] -> their per-head keys' nope part [N, Hq, Dn] and values
    [N, Hq, Dv] (two GEMMs); the rope key is shared by the heads as cached."""
    return jnp.einsum("tr,rhd->thd", latent, w_uk), jnp.einsum("tr,rhd->thd", latent, w_uv)


def expanded_prefix(q_nope, q_rope, latent_pages, rope_pages, kv_lens, page_table, query_start, w_uk, w_uv, *,
                    sm_scale: float, decode_rows: int, window: int, interpret: bool = False,
                    config: OwnRowsConfig | None = None):
    """The prefill rows' attention to their cached prefixes in the expanded form ->
    (out [T, Hq, Dv] float32, lse [T, Hq]). The prefixes of the step's prefill
    sequences, laid end to end, pass `window` tokens at a time: each pass gathers its
    tokens' latent and rope rows through the page table, builds their keys and values
    (two GEMMs) and runs context_attention; the passes merge by their denominators. The
    pass count is the prefixes' total over the window, rounded up: a step without a
    prefix runs none. XLA:GPU reads that loop's condition on the host at each pass
    (docs/kernels.md weighs it)."""
    page_size, rank, rope_dim = latent_pages.shape[1], latent_pages.shape[-1], rope_pages.shape[-1]
    rows = query_start[1:] - query_start[:-1]
    prefix = jnp.where(rows > decode_rows, kv_lens - rows, 0)
    ends = jnp.cumsum(prefix)
    starts = ends - prefix
    latent_slots, rope_slots = latent_pages.reshape(-1, rank), rope_pages.reshape(-1, rope_dim)

    def one_pass(index, carry):
        token = index * window + jnp.arange(window, dtype=jnp.int32)  # in the prefixes laid end to end
        seq = jnp.minimum(jnp.sum(ends[None, :] <= token[:, None], axis=1), rows.shape[0] - 1)
        pos = token - starts[seq]
        ok = token < ends[-1]
        slot = jnp.where(ok, page_table[seq, pos // page_size] * page_size + pos % page_size, 0)
        k_nope, v = expanded_keys_values(jnp.where(ok[:, None], latent_slots[slot], 0), w_uk, w_uv)
        rope = jnp.where(ok[:, None], rope_slots[slot], 0)
        first = jnp.clip(starts - index * window, 0, window)
        count = jnp.clip(ends - index * window, 0, window) - first
        part = context_attention(q_nope, q_rope, k_nope, rope, v, first, count, kv_lens, query_start,
                                 sm_scale=sm_scale, decode_rows=decode_rows, interpret=interpret, config=config)
        return merge_partials(*carry, *part)

    num_rows, num_heads = q_nope.shape[:2]
    empty = (jnp.zeros((num_rows, num_heads, w_uv.shape[-1]), jnp.float32),
             jnp.full((num_rows, num_heads), -jnp.inf, jnp.float32))
    return lax.fori_loop(0, cdiv(ends[-1], window), one_pass, empty)


def mla_split_prefill(q_nope, q_rope, latent, rope_key, latent_pages, rope_pages, kv_lens, page_table, query_start,
                      w_uk, w_uv, *, sm_scale: float, decode_rows: int, interpret: bool = False,
                      config: OwnRowsConfig | None = None, rope_tables: tuple | None = None,
                      rope_interleave: bool = False, q_whole=None) -> jax.Array:
    """The prefill rows' attention output [T, Hq, Dv] in the split form (module
    docstring); others 0. q_nope [T, Hq, Dn] and q_rope [T, Hq, Dr] (rotated); latent
    [T, R] and rope_key [T, Dr] are the step's rows as written to the cache; w_uk
    [R, Hq, Dn] and w_uv [R, Hq, Dv] as kernels/mla_reference.py. The prefix is expanded
    config.prefix_window tokens a pass (expanded_prefix), or with a window of 0
    absorbed, where rope_tables has the call rotate q_whole's rope part itself
    (mla_absorbed_attention)."""
    config = config or OwnRowsConfig()
    cache = (latent_pages, rope_pages, kv_lens, page_table, query_start)
    if config.prefix_window:
        prefix = expanded_prefix(q_nope, q_rope, *cache, w_uk, w_uv, sm_scale=sm_scale, decode_rows=decode_rows,
                                 window=config.prefix_window, interpret=interpret, config=config)
    else:
        q_latent = jnp.einsum("thd,rhd->thr", q_nope, w_uk)
        prefix_latent, prefix_lse = mla_absorbed_attention(
            q_latent, q_rope if rope_tables is None else q_whole, *cache, sm_scale=sm_scale, decode_rows=decode_rows,
            prefill=True, interpret=interpret, rope_tables=rope_tables, rope_interleave=rope_interleave,
            prefix_only=True)
        prefix = jnp.einsum("thr,rhv->thv", prefix_latent, w_uv, preferred_element_type=jnp.float32), prefix_lse
    # the own rows' keys and values from their latents as the cache holds them
    k_nope, v = expanded_keys_values(latent.astype(latent_pages.dtype), w_uk, w_uv)
    own = own_rows_attention(q_nope, q_rope, k_nope, rope_key.astype(rope_pages.dtype), v, kv_lens, query_start,
                             sm_scale=sm_scale, decode_rows=decode_rows, interpret=interpret, config=config)
    return merge_partials(*prefix, *own)[0].astype(q_nope.dtype)


# mla_prefill_paths.json, as benchmarks/moe.py --parts mla writes it: (heads, R, Dr, Dn,
# Dv, context bucket) -> {row bucket: the fastest OwnRowsConfig (tiling and prefix window)
# where the split form beat the absorbed prefill call, or "absorbed"}; the buckets: the
# page table's width in tokens and the step's rows, each rounded up to a power of 2. A
# shape the table lacks runs the absorbed call (the split form is taken where it was
# measured faster); a context or row bucket it lacks takes the nearest one measured (a
# step's rows are its chunk's plus the decode rows beside it: 2048 + 32 rows is bucket
# 4096).
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
