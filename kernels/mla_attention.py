"""MLA attention over the paged latent cache, absorbed form, as one Pallas kernel lowered
through Triton: decode, verify and prefill rows.

Same contract as `kernels.mla_reference.mla_absorbed_attention_reference` (its docstring
has the layout), for the rows of the sequences a call takes: with `prefill` False those
with at most `decode_rows` rows this step (decode: 1, verify: k + 1), with `prefill`
True the longer ones (prefill chunks); the rows of the others, and rows no sequence
owns, come out exactly 0.

Every q head attends over the same latent c (R values a token) and rope key (Dr
values): scores = q_latent . c + q_rope . k_rope, output = softmax @ c. So a program
takes a block of `block_q` rows of one sequence for a block of `block_h` heads (the MMA
tile: rows x heads, padded to 16) and streams the pages its rows see `block_kv` tokens
at a time, loading each latent tile once for both products, with an online softmax in
base 2: the cache is read once per (q block, head block), and memory stays a tile's
whatever the context (the expanded form would build every context token's keys and
values per head). A decode sequence is one block. When there are too few programs to
fill the GPU (small batches), the token range is split over `num_splits` programs and
a second kernel merges their partial results into the rows (flash decoding;
triton_common.merged_rows).

Every memory access is an explicit gather (row and slot index vectors), so the same
kernel runs under Triton on the GPU and under `interpret=True` on the CPU.
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
                                          mma_sizes, next_power_of_2, online_softmax_step, q_block_bound,
                                          q_blocks_per_seq, step_slots)
from jaxmtp.kernels.reference import row_ownership
from jaxmtp.kernels.tiling_table import nearest_context_entry, read_tilings, row_bucket

_LOG2E = math.log2(math.e)
# Splits: the largest power of 2 that keeps the grid within two programs a multiprocessor
# (a program holds one SM's shared memory: two waves, none part-filled), at most 128. On
# the H200 (benchmarks/mla_sweep.py, 2026-12-04) a split count that spills a third wave
# lost up to 36% (batch 32 at 16k: 9 splits 245 us, 8 splits 181 us), and batch 1 gained
# to 64 splits at 4k and 128 at 16k (10.9 / 19.0 us; 32 splits: 13.3 / 29.8 us).
_MAX_PROGRAMS = 2 * NUM_SMS
_MAX_SPLITS = 128
_MIN_TILE_ROWS = 16  # a Triton MMA minimum


@dataclasses.dataclass(frozen=True)
class MLAKernelConfig:
    """Static tiling of one call; `default_config` picks it from the shapes."""

    block_q: int  # rows of one sequence per program (a decode call: at least decode_rows)
    block_h: int  # q heads per program (tile rows: block_q x block_h, at least 16)
    block_kv: int  # cache tokens per inner-loop step
    num_splits: int  # programs sharing one q block's token range (1 = no split)
    num_warps: int
    num_stages: int  # software-pipelining depth of the page loads


# mla_paths.json, as benchmarks/mla_sweep.py writes it: (heads, R, Dr, decode rows,
# context bucket) -> {batch bucket: the kernel's fastest tiling, or "xla" where XLA's
# absorbed form beat it}; the buckets: the page table's width in tokens and its sequences,
# each rounded up to a power of 2. A context bucket the table lacks takes the nearest one
# measured (the tiling's splits follow the batch, and each split divides the sequence's
# actual context whatever the width); a batch bucket it lacks, and every prefill call
# (XLA's forms hold each row's whole context), run the kernel with default_config.
MEASURED_PATHS = read_tilings("mla_paths.json", MLAKernelConfig)


def measured_decode_path(num_heads: int, rank: int, rope_dim: int, decode_rows: int, num_seqs: int,
                         context: int) -> MLAKernelConfig | str | None:
    """The measured table's entry for a decode call: a tiling, "xla", or None where the
    table has none."""
    entry = nearest_context_entry(MEASURED_PATHS, (num_heads, rank, rope_dim, decode_rows), context)
    return entry.get(row_bucket(num_seqs))


def supports(kv_lora_rank: int, rope_dim: int) -> bool:
    """The kernel tiles R and Dr as powers of 2 of at least 16 (a Triton MMA minimum)."""
    return mma_sizes(kv_lora_rank, rope_dim)


def default_config(num_rows: int, num_seqs: int, num_heads: int, decode_rows: int, max_context: int,
                   prefill: bool = False) -> MLAKernelConfig:
    """Tiling from static shapes (docs/kernels.md, "MLA attention"): tiles of at most 32
    rows (the float32 accumulator is 32 x R): a decode call one sequence's rows x the
    heads that fill the rest, a prefill call 16 heads x 2 rows (first choices, not yet
    swept on the GPU); 64 tokens a step, the largest power-of-2 split count that keeps
    the grid within two programs per multiprocessor."""
    if prefill:
        block_h = min(next_power_of_2(num_heads), 16)
        block_q = max(1, 32 // block_h)
        programs = cdiv(num_rows, block_q) * cdiv(num_heads, block_h)
    else:
        block_q = next_power_of_2(decode_rows)
        block_h = min(next_power_of_2(num_heads), max(1, 32 // block_q))
        programs = num_seqs * cdiv(num_heads, block_h)
    block_kv = 64
    kv_steps = max(1, cdiv(max_context, block_kv))
    fit = max(1, _MAX_PROGRAMS // programs)
    num_splits = 1 << (min(fit, kv_steps, _MAX_SPLITS).bit_length() - 1)
    return MLAKernelConfig(block_q, block_h, block_kv, num_splits, 4, 2)


def _rows_taken(decode_rows: int, prefill: bool) -> tuple[int, int | None]:
    """The row counts of the sequences a call takes: [min_rows, max_rows]."""
    return (decode_rows + 1, None) if prefill else (1, decode_rows)


def _rotated_q_rope(q_ref, cos_ref, sin_ref, q_index, row, mask, *, rope_dim: int, interleave: bool):
    """The tile's q rope part rotated (jaxmtp.models.layers.rotate, rounded as it rounds):
    from the last rope_dim columns of q_ref's rows and the tables' rows. Output column j
    < h is first_j cos_j - second_j sin_j, column h + j second_j cos_j + first_j sin_j,
    each operand gathered from memory in place (no register shuffle)."""
    half = rope_dim // 2
    column = jnp.arange(rope_dim, dtype=jnp.int32)
    pair, low = lax.rem(column, half), column < half
    first, second = (2 * pair, 2 * pair + 1) if interleave else (pair, half + pair)
    offset = q_ref.shape[-1] - rope_dim
    own = plgpu.load(q_ref.at[q_index[:, None], offset + jnp.where(low, first, second)[None, :]], mask=mask, other=0)
    partner = plgpu.load(q_ref.at[q_index[:, None], offset + jnp.where(low, second, first)[None, :]], mask=mask,
                         other=0)
    cos = plgpu.load(cos_ref.at[row[:, None], pair[None, :]], mask=mask, other=0)
    sin = plgpu.load(sin_ref.at[row[:, None], pair[None, :]], mask=mask, other=0)
    dtype, f32 = q_ref.dtype, jnp.float32

    def product(a, b):  # rounded to the query's dtype, as the model's rotation rounds it
        return (a.astype(f32) * b.astype(f32)).astype(dtype).astype(f32)

    own_term, partner_term = product(own, cos), product(partner, sin)
    return (own_term + jnp.where(low[None, :], -partner_term, partner_term)).astype(dtype)


def _kernel(query_start_ref, kv_lens_ref, page_table_ref, q_latent_ref, q_rope_ref, latent_ref, rope_ref, *refs,
            num_heads: int, rows_taken: tuple[int, int | None], num_blocks: int, block_q: int, block_h: int,
            block_kv: int, page_size: int, pages_per_seq: int, num_splits: int, sm_scale: float,
            rope_interleave: bool | None, prefix_only: bool):
    head_block, program, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rank, rope_dim = latent_ref.shape[-1], rope_ref.shape[-1]
    rope_tables, out_refs = (refs[:2], refs[2:]) if rope_interleave is not None else (None, refs)
    precision = lax.Precision.HIGHEST if q_latent_ref.dtype == jnp.float32 else None
    # the blocks that see the most cache start first
    seq, row_start, num_rows, first_pos = locate_q_block(
        query_start_ref, kv_lens_ref, num_blocks - 1 - program, block_q=block_q, min_rows=rows_taken[0],
        max_rows=rows_taken[1])
    if prefix_only:  # the tokens before the sequence's rows of this step, seen by every row
        kv_end = kv_lens_ref[seq] - (query_start_ref[seq + 1] - query_start_ref[seq])
    else:  # the tokens the block's last row sees
        kv_end = first_pos + num_rows

    # Tile row r is the block's row r // block_h, head head_block * block_h + r % block_h.
    tile_rows = max(_MIN_TILE_ROWS, block_q * block_h)
    tile = jnp.arange(tile_rows, dtype=jnp.int32)
    row_in_block, head = lax.div(tile, block_h), head_block * block_h + lax.rem(tile, block_h)
    row_ok = (row_in_block < num_rows) & (head < num_heads)
    q_index = (row_start + row_in_block) * num_heads + head
    position = first_pos + row_in_block
    rank_ids, rope_ids = jnp.arange(rank, dtype=jnp.int32), jnp.arange(rope_dim, dtype=jnp.int32)
    q_latent = plgpu.load(q_latent_ref.at[q_index[:, None], rank_ids[None, :]],
                          mask=jnp.broadcast_to(row_ok[:, None], (tile_rows, rank)), other=0)
    rope_mask = jnp.broadcast_to(row_ok[:, None], (tile_rows, rope_dim))
    if rope_tables is None:
        q_rope = plgpu.load(q_rope_ref.at[q_index[:, None], rope_ids[None, :]], mask=rope_mask, other=0)
    else:
        q_rope = _rotated_q_rope(q_rope_ref, *rope_tables, q_index, row_start + row_in_block, rope_mask,
                                 rope_dim=rope_dim, interleave=rope_interleave)

    # Steps below full_hi are seen whole by every row: no mask; the rest (the diagonal,
    # or the prefix's last part step) are masked, and never load slots at or past kv_end.
    step_hi = cdiv(kv_end, block_kv)
    full_hi = jnp.clip(jnp.minimum(first_pos + 1, kv_end) // block_kv, 0, step_hi)
    per_split = cdiv(step_hi, num_splits)
    split_lo = split * per_split
    split_hi = jnp.minimum(split_lo + per_split, step_hi)
    page_table_offset = seq * pages_per_seq

    def step(kv_step, carry, *, masked: bool):
        token, slot, token_ok = step_slots(page_table_ref, page_table_offset, kv_step, block_kv=block_kv,
                                           page_size=page_size, kv_end=kv_end, masked=masked)
        latent_mask = None if token_ok is None else jnp.broadcast_to(token_ok[:, None], (block_kv, rank))
        rope_mask = None if token_ok is None else jnp.broadcast_to(token_ok[:, None], (block_kv, rope_dim))
        other = 0 if masked else None
        latent = plgpu.load(latent_ref.at[slot[:, None], rank_ids[None, :]], mask=latent_mask, other=other)
        rope = plgpu.load(rope_ref.at[slot[:, None], rope_ids[None, :]], mask=rope_mask, other=other)
        logits = plgpu.dot(q_latent, latent, trans_b=True, precision=precision)
        logits += plgpu.dot(q_rope, rope, trans_b=True, precision=precision)
        logits = logits * (sm_scale * _LOG2E)
        if masked:
            seen = token[None, :] < kv_end if prefix_only else token[None, :] <= position[:, None]
            logits = jnp.where(seen, logits, -jnp.inf)
        # the latent tile is the values too: loaded once for both products
        return online_softmax_step(carry, logits, lambda: latent, masked=masked, precision=precision)

    carry = (jnp.zeros((tile_rows, rank), jnp.float32), jnp.full((tile_rows,), -jnp.inf, jnp.float32),
             jnp.zeros((tile_rows,), jnp.float32))
    for lo, hi, masked in ((0, full_hi, False), (full_hi, step_hi, True)):
        carry = lax.fori_loop(jnp.maximum(lo, split_lo), jnp.minimum(hi, split_hi),
                              functools.partial(step, masked=masked), carry)
    acc, row_max, row_sum = carry

    row_mask = jnp.broadcast_to(row_ok[:, None], (tile_rows, rank))
    if num_splits == 1:
        o_ref = out_refs[0]
        seen_any = row_sum > 0  # an empty prefix leaves acc and row_sum 0
        out = acc / jnp.where(seen_any, row_sum, 1.0)[:, None]
        plgpu.store(o_ref.at[q_index[:, None], rank_ids[None, :]], out.astype(o_ref.dtype), mask=row_mask)
        if prefix_only:
            (lse_ref,) = out_refs[1:]
            lse = jnp.where(seen_any, row_max + jnp.log2(jnp.where(seen_any, row_sum, 1.0)), -jnp.inf)
            plgpu.store(lse_ref.at[q_index], lse, mask=row_ok)
    else:  # partial results by q block, not by row: see mla_absorbed_attention
        acc_ref, max_ref, sum_ref = out_refs
        part_index = ((num_blocks - 1 - program) * block_q + row_in_block) * num_heads + head
        plgpu.store(acc_ref.at[split, part_index[:, None], rank_ids[None, :]], acc, mask=row_mask)
        plgpu.store(max_ref.at[split, part_index], row_max, mask=row_ok)
        plgpu.store(sum_ref.at[split, part_index], row_sum, mask=row_ok)


@functools.partial(jax.jit, static_argnames=("sm_scale", "decode_rows", "prefill", "interpret", "config",
                                             "rope_interleave", "prefix_only"))
def mla_absorbed_attention(q_latent, q_rope, latent_pages, rope_pages, kv_lens, page_table, query_start, *,
                           sm_scale: float, decode_rows: int, prefill: bool = False, interpret: bool = False,
                           config: MLAKernelConfig | None = None, rope_tables: tuple | None = None,
                           rope_interleave: bool = False, prefix_only: bool = False):
    """q_latent [T, Hq, R] (W_UK folded in), q_rope [T, Hq, Dr] -> [T, Hq, R] for the rows
    of sequences with at most decode_rows rows, or with `prefill` of those with more
    (others 0). With rope_tables (cos, sin [T, Dr / 2]: jaxmtp.models.layers.rope_tables),
    q_rope is the unrotated query whose last Dr columns the kernel rotates
    (layers.rotate, `rope_interleave` its layout): the whole [T, Hq, Dn + Dr] projection
    can be passed, with no kernel of XLA's to slice or rotate it. `config` overrides the
    tiling that `default_config` picks (for tuning).

    With `prefix_only` (prefill rows; kernels/mla_prefill.py) each row attends to its
    sequence's tokens before this step's rows alone, and the call returns (out, lse):
    lse [T, Hq] float32, each row's log2 of its softmax denominator over the logits in
    base 2 (scaled by sm_scale / ln 2), -inf where the prefix is empty (out 0 there);
    one program per q block (no splits)."""
    num_rows, num_heads, rank = q_latent.shape
    num_pages, page_size, _, _ = latent_pages.shape
    rope_dim = rope_pages.shape[-1]
    num_seqs, pages_per_seq = page_table.shape
    if not supports(rank, rope_dim):
        raise ValueError(f"the MLA kernel needs kv_lora_rank and the rope dim powers of 2 >= 16, "
                         f"got {rank} and {rope_dim}")
    if latent_pages.size > 2**31 - 1:  # the kernel's element offsets are int32
        raise ValueError(f"the MLA kernel indexes in int32: a cache layer of {latent_pages.size} latent "
                         f"values is too large")
    if config is None:
        config = default_config(num_rows, num_seqs, num_heads, decode_rows, pages_per_seq * page_size, prefill)
    if prefix_only:
        if not prefill:
            raise ValueError("prefix_only attention is for prefill rows")
        config = dataclasses.replace(config, num_splits=1)
    min_rows, max_rows = _rows_taken(decode_rows, prefill)
    num_blocks = q_block_bound(num_rows, num_seqs, config.block_q, min_rows, max_rows)
    flat_rows = num_rows * num_heads
    if config.num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((flat_rows, rank), q_latent.dtype)]
        if prefix_only:
            out_shape.append(jax.ShapeDtypeStruct((flat_rows,), jnp.float32))
    else:
        # Split results are kept per q block row (num_blocks x block_q), not per step row:
        # a decode call in a step with a prefill chunk takes a few of its rows, and the
        # merge reads every split's buffer whole.
        part_rows = num_blocks * config.block_q * num_heads
        out_shape = [jax.ShapeDtypeStruct((config.num_splits, part_rows, rank), jnp.float32),
                     jax.ShapeDtypeStruct((config.num_splits, part_rows), jnp.float32),
                     jax.ShapeDtypeStruct((config.num_splits, part_rows), jnp.float32)]
    kernel = functools.partial(
        _kernel, num_heads=num_heads, rows_taken=(min_rows, max_rows), num_blocks=num_blocks, block_q=config.block_q,
        block_h=config.block_h, block_kv=config.block_kv, page_size=page_size, pages_per_seq=pages_per_seq,
        num_splits=config.num_splits, sm_scale=float(sm_scale),
        rope_interleave=None if rope_tables is None else rope_interleave, prefix_only=prefix_only,
    )
    query_start = query_start.astype(jnp.int32)
    outs = pl.pallas_call(
        kernel,
        # the head blocks of one q block run side by side: each reads the same latent tiles
        grid=(cdiv(num_heads, config.block_h), num_blocks, config.num_splits),
        out_shape=out_shape,
        compiler_params=TritonCompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="mla_prefix_attention" if prefix_only else "mla_prefill_attention" if prefill else "mla_decode_attention",
    )(
        query_start,
        kv_lens.astype(jnp.int32),
        page_table.astype(jnp.int32).reshape(-1),
        q_latent.reshape(flat_rows, rank),
        q_rope.reshape(flat_rows, q_rope.shape[-1]),
        latent_pages.reshape(num_pages * page_size, rank),
        rope_pages.reshape(num_pages * page_size, rope_dim),
        *(() if rope_tables is None else rope_tables),
    )
    seq, owned = row_ownership(query_start, num_rows)
    blocks = q_blocks_per_seq(query_start[1:] - query_start[:-1], block_q=config.block_q, min_rows=min_rows,
                              max_rows=max_rows)
    taken = owned & (blocks[seq] > 0)
    if config.num_splits == 1:  # rows the kernel did not take were never written
        out = jnp.where(taken[:, None, None], outs[0].reshape(num_rows, num_heads, rank), 0)
        if prefix_only:
            return out, jnp.where(taken[:, None], outs[1].reshape(num_rows, num_heads), -jnp.inf)
        return out
    # a taken sequence's q blocks follow the taken sequences before it (locate_q_block)
    first_block = jnp.cumsum(blocks) - blocks
    part_row = first_block[seq] * config.block_q + jnp.arange(num_rows, dtype=jnp.int32) - query_start[seq]
    merged = merged_rows(*outs, jnp.where(taken, part_row, -1), num_heads=num_heads, dtype=q_latent.dtype,
                         interpret=interpret)
    return merged.reshape(num_rows, num_heads, rank)
