"""What the Triton-lowered Pallas kernels share: the compiler parameters' name across JAX
versions, the H200's multiprocessor count their grids aim at, integer helpers, and the
attention kernels' q-block lookup and split merge."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# `CompilerParams` since jax 0.6.2 (0.10 and 0.11 included); `TritonCompilerParams`
# before, removed in 0.7.2.
TritonCompilerParams = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams

# The grids' programs are counted against the H200's multiprocessors.
NUM_SMS = 132


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def cdiv(a, b):
    return (a + b - 1) // b


def mma_sizes(*dims: int) -> bool:
    """Whether each size tiles as a power of 2 of at least 16 (a Triton MMA minimum)."""
    return all(d >= 16 and d & (d - 1) == 0 for d in dims)


def q_blocks_per_seq(rows, *, block_q: int, min_rows: int = 1, max_rows: int | None = None):
    """Each sequence's q blocks of block_q rows in a call that takes the sequences with
    between min_rows and max_rows rows (the others have none)."""
    # lax.div, not //: operands are non-negative, so skip jnp's floor fix-ups.
    blocks = lax.div(rows + block_q - 1, block_q)
    if min_rows > 1:
        blocks = jnp.where(rows >= min_rows, blocks, 0)
    if max_rows is not None:
        blocks = jnp.where(rows <= max_rows, blocks, 0)
    return blocks


def q_block_bound(num_rows: int, num_seqs: int, block_q: int, min_rows: int, max_rows: int | None) -> int:
    """A static bound on the q blocks: at most num_rows // min_rows sequences are taken,
    each with cdiv(rows, block_q) <= rows // block_q + 1 blocks (one when its rows fit a
    block)."""
    taken = min(num_seqs, num_rows // min_rows)
    if max_rows is not None and max_rows <= block_q:
        return max(1, taken)
    return max(1, min(num_rows, num_rows // block_q + taken))


def locate_q_block(query_start_ref, kv_lens_ref, block, *, block_q: int, min_rows: int = 1,
                   max_rows: int | None = None):
    """The rows of q block `block`: each sequence with between min_rows and max_rows rows
    (the others have none) has cdiv(rows, block_q) blocks of block_q rows, in order.
    Returns (seq, row_start, num_rows, first_pos): the block's sequence, first row, row
    count (0 for a block past the last one, which then does nothing) and the position of
    its first row in the sequence."""
    num_seqs = kv_lens_ref.shape[0]
    seq_ids = jnp.arange(next_power_of_2(num_seqs), dtype=jnp.int32)
    seq_ok = seq_ids < num_seqs
    seq_starts = plgpu.load(query_start_ref.at[seq_ids], mask=seq_ok, other=0)
    seq_ends = plgpu.load(query_start_ref.at[seq_ids + 1], mask=seq_ok, other=0)
    blocks_per_seq = q_blocks_per_seq(seq_ends - seq_starts, block_q=block_q, min_rows=min_rows, max_rows=max_rows)
    blocks_end = jnp.cumsum(blocks_per_seq)
    seq = jnp.sum((blocks_end <= block).astype(jnp.int32))
    live = seq < num_seqs
    seq = jnp.minimum(seq, num_seqs - 1)
    first_block = jnp.sum(jnp.where(seq_ids == seq, blocks_end - blocks_per_seq, 0))
    seq_start, seq_end = query_start_ref[seq], query_start_ref[seq + 1]
    offset = (block - first_block) * block_q  # rows of this sequence before the block
    row_start = seq_start + offset
    num_rows = jnp.where(live, jnp.minimum(seq_end - row_start, block_q), 0)
    first_pos = jnp.where(live, kv_lens_ref[seq] - (seq_end - seq_start) + offset, 0)
    return seq, row_start, num_rows, first_pos


MERGE_TILE = 8192  # values of a merge program's [splits, columns] tile: 64 registers a thread of 4 warps


def merged_rows(acc: jax.Array, row_max: jax.Array, row_sum: jax.Array, part_rows: jax.Array, *, num_heads: int,
                dtype, interpret: bool = False) -> jax.Array:
    """The split token ranges' partial results (flash decoding: per split, the unnormalised
    rows `acc`, their base-2 maxima and sums) merged and placed, in one Pallas kernel:
    out [T * num_heads, R] in dtype, row t * num_heads + h the splits' results of
    partial row part_rows[t] * num_heads + h merged, 0 where part_rows[t] < 0. In XLA
    the merge took three kernels (the maximum, the weighted sum, the division) and a
    gather where the partial rows are not the output's. A program takes one
    output row's columns, every split at once (no loop over the splits: each load's
    latency would add up), as many columns as keep its tile within MERGE_TILE."""
    num_splits, num_parts, rank = acc.shape
    num_rows = part_rows.shape[0] * num_heads
    block_r = min(rank, max(16, MERGE_TILE // next_power_of_2(num_splits)))
    kernel = functools.partial(_merge_kernel, num_splits=num_splits, num_heads=num_heads, block_r=block_r)
    return pl.pallas_call(
        kernel,
        grid=(num_rows, cdiv(rank, block_r)),
        out_shape=jax.ShapeDtypeStruct((num_rows, rank), dtype),
        compiler_params=TritonCompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="merge_splits",
    )(part_rows.astype(jnp.int32), acc.reshape(num_splits * num_parts, rank), row_max.reshape(-1), row_sum.reshape(-1))


def _merge_kernel(part_rows_ref, acc_ref, max_ref, sum_ref, out_ref, *, num_splits: int, num_heads: int,
                  block_r: int):
    row, chunk = pl.program_id(0), pl.program_id(1)
    rank = out_ref.shape[1]
    num_parts = max_ref.shape[0] // num_splits
    part_row = part_rows_ref[lax.div(row, num_heads)]
    split = jnp.arange(next_power_of_2(num_splits), dtype=jnp.int32)
    ok = (split < num_splits) & (part_row >= 0)
    index = split * num_parts + jnp.maximum(part_row, 0) * num_heads + lax.rem(row, num_heads)
    split_max = plgpu.load(max_ref.at[index], mask=ok, other=-jnp.inf)
    overall = jnp.max(split_max)
    weight = jnp.exp2(split_max - jnp.where(overall > -jnp.inf, overall, 0.0))  # 0 for an empty split
    total = jnp.sum(weight * plgpu.load(sum_ref.at[index], mask=ok, other=0.0))
    column = chunk * block_r + jnp.arange(block_r, dtype=jnp.int32)
    tile_ok = ok[:, None] & (column[None, :] < rank)
    acc = plgpu.load(acc_ref.at[index[:, None], column[None, :]], mask=tile_ok, other=0.0)
    out = jnp.sum(weight[:, None] * acc, axis=0) / jnp.where(total > 0, total, 1.0)
    plgpu.store(out_ref.at[row, column], out.astype(out_ref.dtype), mask=column < rank)


def step_slots(page_table_ref, page_table_offset, kv_step, *, block_kv: int, page_size: int, kv_end,
               masked: bool):
    """The tokens of one block_kv step over a sequence's pages, their cache slots, and
    (masked) which lie below kv_end, else None: a masked step never reads a page-table
    entry past kv_end (its slots may be stale or belong to nobody)."""
    token = kv_step * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
    page_index = page_table_ref.at[page_table_offset + lax.div(token, page_size)]
    token_ok = token < kv_end if masked else None
    page = plgpu.load(page_index, mask=token_ok, other=0 if masked else None)
    return token, page * page_size + lax.rem(token, page_size), token_ok


def online_softmax_step(carry, logits, load_values, *, masked: bool, precision):
    """(acc, row max, row sum) after one step's base-2 logits [rows, tokens] and their
    values [tokens, D] (load_values(), loaded after the probabilities are formed)."""
    acc, row_max, row_sum = carry
    new_max = jnp.maximum(row_max, jnp.max(logits, axis=1))
    # a row that has seen nothing yet keeps max -inf: subtract 0 so exp2 gives 0, not NaN
    new_max_safe = jnp.where(new_max == -jnp.inf, 0.0, new_max) if masked else new_max
    correction = jnp.exp2(row_max - new_max_safe)
    probs = jnp.exp2(logits - new_max_safe[:, None])
    row_sum = row_sum * correction + jnp.sum(probs, axis=1)
    values = load_values()
    acc = acc * correction[:, None] + plgpu.dot(probs.astype(values.dtype), values, precision=precision)
    return acc, new_max, row_sum
