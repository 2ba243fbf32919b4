"""Ragged paged attention as one Pallas kernel, lowered through Triton.

Same contract as `jaxmtp.kernels.reference.ragged_paged_attention_reference` (read its
docstring for the layout); decode (1 row per sequence), verify (k+1 rows) and
prefill chunks (many rows) all go through the same kernel, mixed in one call.

Work split. The q rows of each sequence are cut into blocks of `block_q` rows; a
program handles one such block for the `group` q heads that share one kv head, so
its MMA tile has block_q * group rows (GQA packing: a decode row of a 32/8-head
model already fills 4 of them). Each program finds its block from query_start
itself (a cumsum over the sequences), so the call needs no planning ops around it.
It walks the sequence's pages `block_kv` tokens at a time with an online softmax,
and only over the tokens its rows can see: steps that every row sees whole run
without any mask; only the diagonal (and sliding-window edge) steps are masked.
When there are too few programs to fill the GPU (small decode batches), the KV
range of each q block is split over `num_splits` programs and one XLA fusion
merges their partial results (flash decoding); otherwise the call is exactly one
kernel launch, which also writes the zeros of the rows no sequence owns.

Every memory access is an explicit gather (row and slot index vectors), so the
same kernel runs under Triton on the GPU and under `interpret=True` on the CPU.
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

from jaxmtp.kernels.triton_common import (NUM_SMS, TritonCompilerParams, cdiv, locate_q_block, merged_rows,
                                          next_power_of_2, online_softmax_step, step_slots)

_LOG2E = math.log2(math.e)
# The KV range is split across programs only when the grid has fewer programs than the
# H200 has multiprocessors; the split then aims at about two decode programs per
# multiprocessor, or one wave of prefill tiles (which fill an SM alone); docs/kernels.md
# ("Splits") has the measurements behind both rules.
_TARGET_DECODE_PROGRAMS = 2 * NUM_SMS
_TARGET_PREFILL_PROGRAMS = NUM_SMS
# At most this many splits: the split count comes from the page table's width (a bucket
# of the longest scheduled context), and the merge reads every split's partial rows
# whether it had work or not, so many splits over a mostly empty table cost more than
# they win (docs/kernels.md, "Splits").
_MAX_SPLITS = 8
# Shared memory for the pipelined K/V tiles (the H200 allows 227 KiB per block; the
# rest is left for Triton's own scratch).
_SHARED_MEMORY_BUDGET = 200 * 1024


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static tiling of one call; `default_config` picks it from the shapes."""

    block_q: int  # q rows of one sequence per program (MMA rows = block_q * padded group)
    block_kv: int  # cache tokens per inner-loop step
    num_splits: int  # programs sharing one q block's KV range (1 = no split)
    num_warps: int
    num_stages: int  # software-pipelining depth of the page loads


def default_config(
    num_rows: int,
    num_seqs: int,
    group: int,
    num_kv_heads: int,
    max_context: int,
    head_dim: int = 128,
    itemsize: int = 2,
) -> KernelConfig:
    """Tiling from static shapes (measured on an H200, docs/kernels.md).

    block_q follows the average rows per sequence (1 for decode, k+1 for verify,
    the chunk for prefill), keeping the tile between 16 rows (the MMA minimum) and
    256 (64 for float32, whose products run on FMA units and live in registers).
    Decode-sized tiles stream 128 tokens a step, prefill tiles 64, three steps in
    flight, fewer where the K/V buffers would not fit in shared memory.
    """
    group_pad = next_power_of_2(group)
    rows_per_seq = next_power_of_2(cdiv(num_rows, num_seqs))
    max_tile_rows = 256 if itemsize <= 2 else 64
    block_q = min(max(rows_per_seq, max(1, 16 // group_pad)), max(1, max_tile_rows // group_pad))
    decode_like = block_q * group_pad <= 64
    block_kv, num_stages = (128 if decode_like else 64), 3

    def kv_buffer_bytes():  # Triton keeps num_stages - 1 K and V tiles in flight
        return (num_stages - 1) * 2 * block_kv * head_dim * itemsize

    while kv_buffer_bytes() > _SHARED_MEMORY_BUDGET and block_kv > 32:
        block_kv //= 2
    while kv_buffer_bytes() > _SHARED_MEMORY_BUDGET and num_stages > 2:
        num_stages -= 1
    # Programs that will have work: one q block per sequence at least, more when
    # sequences have more rows than a block (the grid itself uses a safe bound).
    programs = max(cdiv(num_rows, block_q), min(num_seqs, num_rows)) * num_kv_heads
    target = _TARGET_DECODE_PROGRAMS if decode_like else _TARGET_PREFILL_PROGRAMS
    kv_steps = max(1, cdiv(max_context, block_kv))
    num_splits = 1 if programs >= NUM_SMS else min(cdiv(target, programs), kv_steps, _MAX_SPLITS)
    return KernelConfig(block_q, block_kv, num_splits, 4 if decode_like else 8, num_stages)


def _kernel(
    query_start_ref,  # [B + 1]
    kv_lens_ref,  # [B]
    page_table_ref,  # [B * P]
    q_ref,  # [T * Hq, D]
    k_ref,  # [num_pages * page_size, Hkv, D]
    v_ref,  # [num_pages * page_size, Hkv, D]
    *out_refs,  # o [T * Hq, D]; or, split: acc [S, T * Hq, D], m [S, T * Hq], l [S, T * Hq]
    num_rows_total: int,
    num_q_heads: int,
    group: int,
    num_blocks: int,
    block_q: int,
    block_kv: int,
    page_size: int,
    pages_per_seq: int,
    num_splits: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    program, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_seqs = kv_lens_ref.shape[0]
    head_dim = q_ref.shape[-1]
    group_pad = next_power_of_2(group)
    tile_rows = block_q * group_pad
    # float32 inputs get true float32 products, not Triton's default tf32.
    precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None
    dim = jnp.arange(head_dim, dtype=jnp.int32)

    # programs take the q blocks last first, so the blocks that see the most cache start early
    seq, row_start, num_rows, first_pos = locate_q_block(query_start_ref, kv_lens_ref, num_blocks - 1 - program,
                                                         block_q=block_q)
    page_table_offset = seq * pages_per_seq

    # Tile row r is q row r // group_pad, head kv_head * group + r % group_pad.
    tile = jnp.arange(tile_rows, dtype=jnp.int32)
    row_in_block = lax.div(tile, group_pad)
    head_in_group = lax.rem(tile, group_pad)
    row_ok = (row_in_block < num_rows) & (head_in_group < group)
    q_index = (row_start + row_in_block) * num_q_heads + kv_head * group + head_in_group
    position = first_pos + row_in_block
    row_mask = jnp.broadcast_to(row_ok[:, None], (tile_rows, head_dim))
    q = plgpu.load(q_ref.at[q_index[:, None], dim[None, :]], mask=row_mask, other=0)

    # Cache tokens the block's rows need: [kv_start, kv_end), in block_kv steps.
    kv_end = first_pos + num_rows
    last_pos = kv_end - 1
    if sliding_window is None:
        kv_start = 0
        full_start = 0
    else:
        kv_start = jnp.maximum(first_pos - sliding_window + 1, 0)
        full_start = jnp.maximum(last_pos - sliding_window + 1, 0)
    step_lo = kv_start // block_kv
    step_hi = cdiv(kv_end, block_kv)
    # Steps in [full_lo, full_hi) are seen whole by every row: no mask needed, and
    # they lie below kv_end, so every slot there holds real data.
    full_lo = jnp.clip(cdiv(full_start, block_kv), step_lo, step_hi)
    full_hi = jnp.clip((first_pos + 1) // block_kv, full_lo, step_hi)
    if num_splits == 1:
        split_lo, split_hi = step_lo, step_hi
    else:
        per_split = cdiv(step_hi - step_lo, num_splits)
        split_lo = step_lo + split * per_split
        split_hi = jnp.minimum(split_lo + per_split, step_hi)

    def step(kv_step, carry, *, masked: bool):
        token, slot, token_ok = step_slots(page_table_ref, page_table_offset, kv_step, block_kv=block_kv,
                                           page_size=page_size, kv_end=kv_end, masked=masked)
        token_mask = None if token_ok is None else jnp.broadcast_to(token_ok[:, None], (block_kv, head_dim))
        kv_index = (slot[:, None], kv_head, dim[None, :])
        k = plgpu.load(k_ref.at[kv_index], mask=token_mask, other=0 if masked else None)
        logits = plgpu.dot(q, k, trans_b=True, precision=precision)
        # Logits in base 2 (exp2 is the fast path), soft cap applied first.
        if soft_cap is None:
            logits = logits * (sm_scale * _LOG2E)
        else:
            logits = (soft_cap * _LOG2E) * jnp.tanh(logits * (sm_scale / soft_cap))
        if masked:
            allowed = token[None, :] <= position[:, None]
            if sliding_window is not None:
                allowed &= token[None, :] > position[:, None] - sliding_window
            logits = jnp.where(allowed, logits, -jnp.inf)
        return online_softmax_step(
            carry, logits, lambda: plgpu.load(v_ref.at[kv_index], mask=token_mask, other=0 if masked else None),
            masked=masked, precision=precision)

    carry = (
        jnp.zeros((tile_rows, head_dim), jnp.float32),
        jnp.full((tile_rows,), -jnp.inf, jnp.float32),
        jnp.zeros((tile_rows,), jnp.float32),
    )
    for lo, hi, masked in ((step_lo, full_lo, True), (full_lo, full_hi, False), (full_hi, step_hi, True)):
        carry = lax.fori_loop(
            jnp.maximum(lo, split_lo),
            jnp.minimum(hi, split_hi),
            functools.partial(step, masked=masked),
            carry,
        )
    acc, row_max, row_sum = carry

    out_index = (q_index[:, None], dim[None, :])
    if num_splits == 1:
        (o_ref,) = out_refs
        # Rows with row_sum 0 are not this program's: the store masks them out.
        out = acc / row_sum[:, None]
        plgpu.store(o_ref.at[out_index], out.astype(o_ref.dtype), mask=row_mask)
        _zero_unowned_rows(o_ref, query_start_ref[0], query_start_ref[num_seqs], program, kv_head,
                           num_rows_total=num_rows_total, num_blocks=num_blocks,
                           num_q_heads=num_q_heads, group=group)
    else:
        acc_ref, max_ref, sum_ref = out_refs
        plgpu.store(acc_ref.at[(split, *out_index)], acc, mask=row_mask)
        plgpu.store(max_ref.at[split, q_index], row_max, mask=row_ok)
        plgpu.store(sum_ref.at[split, q_index], row_sum, mask=row_ok)


def _zero_unowned_rows(o_ref, owned_start, owned_end, program, kv_head, *, num_rows_total,
                       num_blocks, num_q_heads, group):
    """Writes 0 to the rows no sequence owns, so that no pass over the output is needed.

    Program p covers rows [p * n, (p + 1) * n) for its kv head's q heads (n chosen
    so that the programs cover all rows); owned rows are left to their owners.
    """
    rows_per_program = next_power_of_2(cdiv(num_rows_total, num_blocks))
    group_pad = next_power_of_2(group)
    head_dim = o_ref.shape[-1]
    tile = jnp.arange(rows_per_program * group_pad, dtype=jnp.int32)
    row = program * rows_per_program + lax.div(tile, group_pad)
    head_in_group = lax.rem(tile, group_pad)
    unowned = (row < owned_start) | (row >= owned_end)
    ok = unowned & (row < num_rows_total) & (head_in_group < group)
    index = row * num_q_heads + kv_head * group + head_in_group
    dim = jnp.arange(head_dim, dtype=jnp.int32)
    plgpu.store(
        o_ref.at[index[:, None], dim[None, :]],
        jnp.zeros((tile.shape[0], head_dim), o_ref.dtype),
        mask=jnp.broadcast_to(ok[:, None], (tile.shape[0], head_dim)),
    )


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "interpret", "config")
)
def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    query_start: jax.Array,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool = False,
    config: KernelConfig | None = None,
) -> jax.Array:
    """Pallas (Triton) ragged paged attention; see the module and reference docs.

    `config` overrides the tiling that `default_config` picks (for tuning).
    Requires a power-of-2 head_dim (>= 16 on the GPU, a Triton MMA minimum).
    """
    num_rows, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs, pages_per_seq = page_table.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} is not a multiple of {num_kv_heads=}")
    if head_dim & (head_dim - 1):
        raise ValueError(f"{head_dim=} must be a power of 2")
    group = num_q_heads // num_kv_heads
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    if config is None:
        config = default_config(num_rows, num_seqs, group, num_kv_heads, pages_per_seq * page_size,
                                head_dim, q.dtype.itemsize)

    # A static bound on the q blocks: sum_s cdiv(rows_s, block_q) <= T // block_q + B,
    # and a block holds at least one row.
    num_blocks = max(1, min(num_rows, num_rows // config.block_q + num_seqs))
    flat_rows = num_rows * num_q_heads
    if config.num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((flat_rows, head_dim), q.dtype)]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((config.num_splits, flat_rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((config.num_splits, flat_rows), jnp.float32),
            jax.ShapeDtypeStruct((config.num_splits, flat_rows), jnp.float32),
        ]
    kernel = functools.partial(
        _kernel,
        num_rows_total=num_rows,
        num_q_heads=num_q_heads,
        group=group,
        num_blocks=num_blocks,
        block_q=config.block_q,
        block_kv=config.block_kv,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        num_splits=config.num_splits,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    query_start = query_start.astype(jnp.int32)
    outs = pl.pallas_call(
        kernel,
        grid=(num_blocks, num_kv_heads, config.num_splits),
        out_shape=out_shape,
        compiler_params=TritonCompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name="ragged_paged_attention",
    )(
        query_start,
        kv_lens.astype(jnp.int32),
        page_table.astype(jnp.int32).reshape(-1),
        q.reshape(flat_rows, head_dim),
        k_pages.reshape(num_pages * page_size, num_kv_heads, head_dim),
        v_pages.reshape(num_pages * page_size, num_kv_heads, head_dim),
    )
    if config.num_splits == 1:
        out = outs[0]
    else:
        rows = jnp.arange(num_rows, dtype=jnp.int32)
        owned = (rows >= query_start[0]) & (rows < query_start[num_seqs])
        out = merged_rows(*outs, jnp.where(owned, rows, -1), num_heads=num_q_heads, dtype=q.dtype, interpret=interpret)
    return out.reshape(num_rows, num_q_heads, head_dim)
