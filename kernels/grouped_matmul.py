"""Grouped matmul: the expert FFNs of a mixture of experts, one Pallas kernel per
projection, lowered through Triton; its plain-jnp references, of the same signatures, are
in kernels/grouped_reference.py.

Layout (fixed by jaxmtp/models/moe.py):
  lhs          [M0, K]    the rows; with `rows`, sorted row i is lhs[rows[i]] (the
                          token gather fused into the kernel's loads), else lhs itself
  rows         int32 [M]  optional: which lhs row each sorted row reads
  rhs          [G, K, N]  one matrix per group (expert); swiglu: [G, K, 2, N], the
                          gate and the up projection side by side; k_major: held with
                          K last, [G, N, K] (swiglu: [G, 2, N, K]), as fp8 experts are
  group_sizes  int32 [G]  sorted rows per group: group g owns rows
                          sum(group_sizes[:g]) .. sum(group_sizes[:g+1]) - 1; they sum to
                          at most M, and rows past the sum (padding) come out 0
  scale_inv    optional, for an rhs in float8_e4m3fn with block scales (DeepSeek-V3's
                          fp8 experts): float32 [G, ceil(K / bk), ceil(N / bn)] (swiglu:
                          [G, ceil(K / bk), 2, ceil(N / bn)]), scale_block = (bk, bn); the
                          weight is rhs * the scale of its block

grouped_matmul gives lhs_sorted @ rhs[g] per group ([M, N]); grouped_swiglu gives
silu(lhs_sorted @ gate[g]) * (lhs_sorted @ up[g]) ([M, N]): both projections from one
read of the rows, the activation applied to the float32 accumulators, and only the
product written (half the output bytes of the fused gate/up matmul, no second pass).

Work split. The sorted rows of each group are cut into blocks of `block_m`; a program
computes one block times one `block_n` column tile of its group's matrix, walking K
`block_k` at a time. Each program finds its group from group_sizes itself (a cumsum
over the groups), so the call needs no planning ops around it. A decode step (a few
rows per expert) therefore reads exactly the routed experts' weights, once, and nothing
of the others; a prefill step runs MMA tiles of up to 128 x 128. The rows past the
groups' sum form one more group that computes nothing and stores zeros. With `split_k`
> 1, that many programs share a tile, each over its own run of K steps, and write
float32 partials that one XLA fusion after the call sums (and, for swiglu, activates):
more loads in flight where a few rows leave too few programs to stream the weights.

Paired form (paired_matmul_kernel, paired_swiglu_kernel; decode): no sort. Row i is a
(token, expert) pair of its own, of group pair_groups[i] (G: an expert held elsewhere,
whose row comes out 0); a program computes that one row (in an MMA tile of block_m
rows, the others masked) times one column tile of its group's matrix. A few tokens'
pairs then stream their experts' weights with no sort, group count or scatter around
the calls (an expert two of them share is read twice).

An fp8 rhs streams as fp8 (the routed experts' bytes only): each K step lies inside one
scale block, its tile is converted in registers and its float32 product multiplied by
the columns' block scales, as kernels/fp8_matmul.py does (bfloat16 rows multiply in
float16 after its exact F16_SHIFT). The references dequantize the experts and multiply
in float32.

Every memory access is an explicit gather (row and column index vectors), so the same
kernel runs under Triton on the GPU and under `interpret=True` on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxmtp.kernels.fp8_matmul import F16_SHIFT, is_k_step
from jaxmtp.kernels.grouped_reference import grouped_matmul_reference, grouped_swiglu_reference, silu_and_mul
from jaxmtp.kernels.grouped_wgmma import GroupedWgmmaConfig, grouped_wgmma
from jaxmtp.kernels.grouped_wgmma import takes as wgmma_takes
from jaxmtp.kernels.triton_common import NUM_SMS, TritonCompilerParams, cdiv, next_power_of_2
from jaxmtp.kernels.tiling_table import bucket_at_or_above, groups_entry, read_tilings, row_bucket

HIGHEST = lax.Precision.HIGHEST


# ----- kernel ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """Static tiling of one call; `default_config` picks it from the shapes."""

    block_m: int  # sorted rows of one group per program (the MMA tile's rows)
    block_n: int  # output columns per program
    block_k: int  # contraction step
    num_warps: int
    num_stages: int  # software-pipelining depth of the K loop's loads
    split_k: int = 1  # programs per tile, each over a run of K steps (float32 partials)


def _largest_dividing(n: int, preferred: int) -> int:
    """The largest power of 2 <= preferred that divides n (at least 16: the callers check)."""
    block = preferred
    while n % block:
        block //= 2
    return block


# The kernel's element offsets are int32.
_MAX_ELEMENTS = 2**31 - 1


def expert_dims(shape: tuple[int, ...], k_major: bool = False) -> tuple[int, int, int]:
    """(G, K, N) of an expert weight [G, K, (2,) N], or k_major [G, (2,) N, K]."""
    return (shape[0], shape[-1], shape[-2]) if k_major else (shape[0], shape[1], shape[-1])


def supports(num_groups: int, k: int, n: int) -> bool:
    """K and N multiples of 16 (tiles are powers of 2 of at least 16, a Triton MMA
    minimum), and rhs ([G, K, N]; swiglu: N = 2 x the output columns) indexable in int32."""
    return k % 16 == 0 and n % 16 == 0 and num_groups * k * n <= _MAX_ELEMENTS


def default_config(num_rows: int, num_groups: int, k: int, n: int, swiglu: bool = False,
                   scale_block: tuple[int, int] | None = None) -> GroupedMatmulConfig:
    """Tiling from static shapes (first choices; docs/kernels.md, "Grouped matmul", has
    the H200 sweep and its leads).

    block_m follows the average rows per group, 16 (the MMA minimum) to 128. Small
    blocks are a weight stream: narrow column tiles (many programs to keep enough
    loads in flight) and long K steps; large ones are MMA tiles of 128 x 128. An fp8
    rhs's K step stays inside one scale block (scale_block[0], a power of 2 >= 16).
    """
    rows_per_group = next_power_of_2(cdiv(num_rows, num_groups))
    block_m = min(max(rows_per_group, 16), 128)
    longest_k = 256 if scale_block is None else min(256, scale_block[0])
    if block_m <= 32:
        return GroupedMatmulConfig(block_m, _largest_dividing(n, 32 if swiglu else 64), _largest_dividing(k, longest_k),
                                   4, 4)
    if block_m == 64:
        return GroupedMatmulConfig(64, _largest_dividing(n, 128), _largest_dividing(k, min(64, longest_k)), 4, 4)
    return GroupedMatmulConfig(128, _largest_dividing(n, 64 if swiglu else 128), _largest_dividing(k, min(64, longest_k)),
                               8, 3)


# the paired form's programs: about two a multiprocessor (the GQA kernel's decode rule)
_TARGET_PROGRAMS = 2 * NUM_SMS


def paired_config(num_rows: int, num_groups: int, k: int, n: int, swiglu: bool = False,
                  scale_block: tuple[int, int] | None = None) -> GroupedMatmulConfig:
    """The paired form's tiling (a first choice, unmeasured): the sorted form's weight
    stream for one row a block, its K split until the grid has about two programs a
    multiprocessor (at most 8 runs)."""
    config = default_config(num_groups, num_groups, k, n, swiglu, scale_block)
    programs, split_k = num_rows * (n // config.block_n), 1
    while programs * split_k < _TARGET_PROGRAMS and split_k < 8 and (k // config.block_k) % (2 * split_k) == 0:
        split_k *= 2
    return dataclasses.replace(config, split_k=split_k)


# grouped_tilings.json, as benchmarks/grouped_sweep.py writes it: (groups, K, N, swiglu)
# (fp8 experts: and their scale block's K) -> {row bucket: the measured best tiling
# where it beat the default ({"wgmma": fields} for the Hopper kernel of
# grouped_wgmma.py), or "xla" where XLA's ragged_dot beat every tiling}; N is the
# weight's columns (swiglu: gate and up)
GROUPED_TILINGS = read_tilings("grouped_tilings.json", GroupedMatmulConfig, kernels={"wgmma": GroupedWgmmaConfig})


def grouped_tiling(num_rows: int, num_groups: int, k: int, n: int, swiglu: bool,
                   scale_block: tuple[int, int] | None = None) -> GroupedMatmulConfig | GroupedWgmmaConfig | str:
    """The tiling the table measured fastest for these shapes (fp8 experts: and their
    scale block's K) at num_rows' bucket, or at the smallest measured bucket above it;
    "xla" where XLA's ragged_dot was faster than every tiling; else default_config's."""
    key = (num_groups, k, n, int(swiglu)) + ((scale_block[0],) if scale_block else ())
    buckets = groups_entry(GROUPED_TILINGS, key)
    bucket = bucket_at_or_above(buckets, num_rows)
    return default_config(num_rows, num_groups, k, n, swiglu, scale_block) if bucket is None else buckets[bucket]


def _sorted_block(group_sizes_ref, m_block, *, num_groups: int, block_m: int, num_rows: int):
    """(group, first row, rows) of row block m_block: group g has cdiv(size_g, block_m)
    blocks, in order; group num_groups holds the padding rows. Blocks past the last
    have no rows."""
    ids = jnp.arange(next_power_of_2(num_groups + 1), dtype=jnp.int32)
    sizes = plgpu.load(group_sizes_ref.at[ids], mask=ids < num_groups, other=0)
    sizes = jnp.where(ids == num_groups, num_rows - jnp.sum(sizes), sizes)
    # lax.div, not //: operands are non-negative, so skip jnp's floor fix-ups.
    blocks = lax.div(sizes + block_m - 1, block_m)
    blocks_end = jnp.cumsum(blocks)
    group = jnp.sum((blocks_end <= m_block).astype(jnp.int32))
    mine = ids == group
    first_block = jnp.sum(jnp.where(mine, blocks_end - blocks, 0))
    group_start = jnp.sum(jnp.where(mine, jnp.cumsum(sizes) - sizes, 0))
    offset = (m_block - first_block) * block_m
    rows_here = jnp.clip(jnp.sum(jnp.where(mine, sizes, 0)) - offset, 0, block_m)
    return group, group_start + offset, rows_here


# expert_paths.json, as benchmarks/moe.py's experts part writes it: (groups, K, N) (fp8
# experts: and their scale block's K), the gate/up weight's [groups, K, 2, N] -> {pairs
# bucket: the routed-expert layer's fastest form: "paired" (paired_*_kernel), "sorted",
# or for fp8 experts "dequantized" (their weights dequantized in the step, then the
# sorted layer in the model's dtype)}. Shapes and buckets it has not measured run sorted.
EXPERT_PATHS = read_tilings("expert_paths.json", GroupedMatmulConfig)


def expert_path(num_pairs: int, gate_up_shape: tuple[int, ...], scale_block: tuple[int, int] | None = None) -> str:
    """The routed-expert layer's form for num_pairs (token, expert) pairs: "paired",
    "sorted" or (fp8 experts) "dequantized", the table's on GPUs where the kernels tile
    the shapes; "sorted" elsewhere."""
    num_groups, k, _, n = gate_up_shape
    if jax.default_backend() != "gpu" or not supports(num_groups, k, 2 * n):
        return "sorted"
    if scale_block is not None and not is_k_step(scale_block[0]):
        return "sorted"
    key = (num_groups, k, n) + ((scale_block[0],) if scale_block else ())
    path = groups_entry(EXPERT_PATHS, key).get(row_bucket(num_pairs), "sorted")
    return "sorted" if path == "dequantized" and scale_block is None else path


def _kernel(groups_ref, *refs, num_groups: int, block_m: int, block_n: int, block_k: int, swiglu: bool, n: int,
            split_k: int, scale_block: tuple[int, int] | None, f16_shift: int, paired: bool, gathered: bool,
            k_major: bool):
    """out: [M, N] (swiglu: the activated product) with one run of K, else [split_k, M,
    N] float32 partials (swiglu: [split_k, M, 2N], gate then up, activated after).
    groups_ref: group_sizes [G], or paired each row's group [M]. refs: (rows, if
    gathered,) lhs, rhs ([G * K, (2 x) N], or k_major [G * (2 x) N, K]), (scale_inv
    [G * ceil(K / bk), (2 x) ceil(N / bn)], for an fp8 rhs,) out."""
    rows_ref, lhs_ref, rhs_ref, *refs = refs if gathered else (None, *refs)
    scale_ref, out_ref = refs if scale_block else (None, *refs)
    m_block, n_block, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k_total = lhs_ref.shape[1]
    precision = HIGHEST if lhs_ref.dtype == jnp.float32 else None
    if paired:  # block m_block is row m_block alone, of its own group (G: none, stored 0)
        group, first_row, rows_here = jnp.minimum(groups_ref[m_block], num_groups), m_block, 1
    else:
        group, first_row, rows_here = _sorted_block(groups_ref, m_block, num_groups=num_groups, block_m=block_m,
                                                    num_rows=out_ref.shape[-2])

    tile = jnp.arange(block_m, dtype=jnp.int32)
    row = first_row + tile
    row_ok = tile < rows_here
    # without rows, sorted row i is lhs row i (no index array: a kernel fewer to build it)
    source = plgpu.load(rows_ref.at[row], mask=row_ok, other=0) if gathered else jnp.where(row_ok, row, 0)
    col = n_block * block_n + jnp.arange(block_n, dtype=jnp.int32)
    depth = jnp.arange(block_k, dtype=jnp.int32)
    lhs_mask = jnp.broadcast_to(row_ok[:, None], (block_m, block_k))
    # this group's first rhs row: [G * K, N] (swiglu: [G * K, 2N], up n columns after
    # gate), or k_major [G * N, K] (swiglu: [G * 2N, K], up n rows after gate)
    rhs_row = jnp.minimum(group, num_groups - 1) * ((2 if swiglu else 1) * n if k_major else k_total)
    # the padding group and blocks with no rows run no K steps: their tile stays 0
    # (a product, not where(): the Triton lowering types a select of two literals as i1)
    run_steps = k_total // block_k // split_k
    k_steps = run_steps * ((group < num_groups) & (rows_here > 0)).astype(jnp.int32)

    if scale_block:  # this group's scale rows, and each column's scale of gate (and up)
        scale_k, scale_n = scale_block
        scale_row0 = jnp.minimum(group, num_groups - 1) * cdiv(k_total, scale_k)
        scale_cols = [lax.div(col, scale_n)] + ([cdiv(n, scale_n) + lax.div(col, scale_n)] if swiglu else [])

    def weight_tile(kk, part):  # [block_k, block_n]
        if k_major:  # a K-contiguous tile, transposed in registers: an fp8 tile then feeds the
            # MMA from shared memory in 16-byte loads (along N, Triton reads it byte by byte)
            return plgpu.load(rhs_ref.at[rhs_row + part * n + col[:, None], kk[None, :]]).T
        return plgpu.load(rhs_ref.at[rhs_row + kk[:, None], part * n + col[None, :]])

    def product(a, w, part, first_k):
        if not scale_block:
            return plgpu.dot(a, w, precision=precision)
        scale = plgpu.load(scale_ref.at[scale_row0 + lax.div(first_k, scale_k), scale_cols[part]])
        return plgpu.dot(a, w.astype(a.dtype), precision=precision) * (scale * 2.0**f16_shift)[None, :]

    def step(i, accs):
        first_k = (split * run_steps + i) * block_k
        kk = first_k + depth
        a = plgpu.load(lhs_ref.at[source[:, None], kk[None, :]], mask=lhs_mask, other=0)
        if f16_shift:
            a = (a.astype(jnp.float32) * 2.0**-f16_shift).astype(jnp.float16)
        return tuple(acc + product(a, weight_tile(kk, part), part, first_k) for part, acc in enumerate(accs))

    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    accs = lax.fori_loop(0, k_steps, step, (zeros, zeros) if swiglu else (zeros,))
    store_mask = jnp.broadcast_to(row_ok[:, None], (block_m, block_n))
    if split_k > 1:  # partials: the activation waits for the whole sum
        for part, acc in enumerate(accs):
            plgpu.store(out_ref.at[split, row[:, None], part * n + col[None, :]], acc, mask=store_mask)
        return
    out = accs[0] / (1 + jnp.exp(-accs[0])) * accs[1] if swiglu else accs[0]
    plgpu.store(out_ref.at[row[:, None], col[None, :]], out.astype(out_ref.dtype), mask=store_mask)


@functools.partial(jax.jit, static_argnames=("swiglu", "paired", "scale_block", "k_major", "interpret", "config"))
def grouped_kernel(lhs: jax.Array, rhs: jax.Array, groups: jax.Array, rows: jax.Array | None = None, *, swiglu: bool,
                   paired: bool = False, scale_inv: jax.Array | None = None, scale_block: tuple[int, int] | None = None,
                   k_major: bool = False, interpret: bool = False, config: GroupedMatmulConfig | None = None
                   ) -> jax.Array:
    """The Pallas (Triton) kernel: groups is group_sizes [G], or paired each row's group [M]."""
    num_groups, k, n = expert_dims(rhs.shape, k_major)
    if lhs.shape[1] != k:
        raise ValueError(f"lhs has {lhs.shape[1]} columns, rhs {k} rows")
    if k % 16 or n % 16:
        raise ValueError(f"the grouped matmul kernel needs K and N multiples of 16, got K={k}, N={n}")
    if not supports(num_groups, k, rhs.size // (num_groups * k)):
        raise ValueError(f"the grouped matmul kernel indexes in int32: rhs of {rhs.size} elements is too large")
    num_rows = lhs.shape[0] if rows is None else rows.shape[0]
    if paired and groups.shape != (num_rows,):
        raise ValueError(f"pair_groups {groups.shape} must give each of the {num_rows} rows its group")
    if config is None:
        config = (paired_config if paired else default_config)(num_rows, num_groups, k, n, swiglu, scale_block)
    if k % (config.block_k * config.split_k) or n % config.block_n:
        raise ValueError(f"{config} does not tile K={k}, N={n}")
    if scale_block is not None:
        scales = (num_groups, cdiv(k, scale_block[0])) + ((2,) if swiglu else ()) + (cdiv(n, scale_block[1]),)
        if scale_inv.shape != scales:
            raise ValueError(f"scale_inv {scale_inv.shape} does not fit rhs {rhs.shape} in blocks of {scale_block} "
                             f"(it should be {scales})")
        if scale_block[0] % config.block_k:
            raise ValueError(f"block_k={config.block_k} must divide the scale block's K ({scale_block[0]}): "
                             "one scale per K step")
    # A static bound on the row blocks: sum_g cdiv(size_g, block_m) over the groups and
    # the padding group is at most M // block_m + G + 1, and a block holds a row.
    num_blocks = num_rows if paired else max(1, min(num_rows, num_rows // config.block_m + num_groups + 1))
    f16_shift = F16_SHIFT if scale_block is not None and lhs.dtype == jnp.bfloat16 else 0
    kernel = functools.partial(_kernel, num_groups=num_groups, block_m=config.block_m, block_n=config.block_n,
                               block_k=config.block_k, swiglu=swiglu, n=n, split_k=config.split_k,
                               scale_block=scale_block, f16_shift=f16_shift, paired=paired, gathered=rows is not None,
                               k_major=k_major)
    operands = [groups.astype(jnp.int32)] + ([] if rows is None else [rows.astype(jnp.int32)])
    operands += [lhs, rhs.reshape(-1, k) if k_major else rhs.reshape(num_groups * k, -1)]
    if scale_block is not None:
        operands.append(scale_inv.astype(jnp.float32).reshape(num_groups * scales[1], -1))
    split = config.split_k > 1
    out_shape = (config.split_k, num_rows, 2 * n if swiglu else n) if split else (num_rows, n)
    out = pl.pallas_call(
        kernel,
        grid=(num_blocks, n // config.block_n, config.split_k),
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32 if split else lhs.dtype),
        compiler_params=TritonCompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name=("paired_" if paired else "grouped_") + ("swiglu" if swiglu else "matmul"),
    )(*operands)
    if not split:
        return out
    out = out.sum(axis=0)
    return (silu_and_mul(out, n) if swiglu else out).astype(lhs.dtype)


# The four forms, each of the contract of its reference (kernels/grouped_reference.py,
# "_reference" for "_kernel"); `config` overrides the tiling that default_config (paired:
# paired_config) picks, for tuning.
grouped_matmul_kernel = functools.partial(grouped_kernel, swiglu=False)
grouped_swiglu_kernel = functools.partial(grouped_kernel, swiglu=True)  # the gate/up projection and SiLU-and-multiply
paired_matmul_kernel = functools.partial(grouped_kernel, swiglu=False, paired=True)
paired_swiglu_kernel = functools.partial(grouped_kernel, swiglu=True, paired=True)


# ----- the model's entry points -----------------------------------------------------------


def _tiling(lhs: jax.Array, rhs: jax.Array, rows: jax.Array | None, swiglu: bool,
            scale_block: tuple[int, int] | None = None, k_major: bool = False,
            real_rows: int | None = None) -> GroupedMatmulConfig | GroupedWgmmaConfig | None:
    """The kernel's tiling on GPUs where it tiles the shapes and the table does not name
    XLA for them; None: XLA's ragged_dot (the reference). fp8 experts take the kernel
    where their scale block's K can be a K step (a power of 2 >= 16). real_rows: the
    most rows that belong to some group (a decode step's bound; the rest are padding,
    which costs no K steps): the tiling of that bucket, what the table measured."""
    num_groups, k, _ = expert_dims(rhs.shape, k_major)
    n = rhs.size // (num_groups * k)
    if jax.default_backend() != "gpu" or not supports(num_groups, k, n):
        return None
    if scale_block is not None and not is_k_step(scale_block[0]):
        return None
    num_rows = lhs.shape[0] if rows is None else rows.shape[0]
    rows_bound = min(num_rows, real_rows or num_rows)
    tiling = grouped_tiling(rows_bound, num_groups, k, n, swiglu, scale_block)
    if isinstance(tiling, GroupedWgmmaConfig) and not wgmma_takes(lhs.dtype, k, n, swiglu, scale_block, k_major, tiling):
        return default_config(rows_bound, num_groups, k, n, swiglu, scale_block)
    return None if tiling == "xla" else tiling


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, rows: jax.Array | None = None, *,
                   scale_inv: jax.Array | None = None, scale_block: tuple[int, int] | None = None,
                   k_major: bool = False, real_rows: int | None = None) -> jax.Array:
    """The kernel at its measured tiling (for real_rows rows, _tiling says), or XLA's
    ragged_dot where that was faster or the kernel does not tile the shapes (and off
    GPUs)."""
    scales = dict(scale_inv=scale_inv, scale_block=scale_block, k_major=k_major)
    config = _tiling(lhs, rhs, rows, False, scale_block, k_major, real_rows=real_rows)
    if config is None:
        return grouped_matmul_reference(lhs, rhs, group_sizes, rows, **scales)
    if isinstance(config, GroupedWgmmaConfig):
        return grouped_wgmma(lhs if rows is None else lhs[rows], rhs, group_sizes, scale_inv=scale_inv, config=config)
    return grouped_matmul_kernel(lhs, rhs, group_sizes, rows, **scales, config=config)


def grouped_swiglu(lhs: jax.Array, gate_up: jax.Array, group_sizes: jax.Array, rows: jax.Array | None = None, *,
                   scale_inv: jax.Array | None = None, scale_block: tuple[int, int] | None = None,
                   k_major: bool = False, real_rows: int | None = None) -> jax.Array:
    """As grouped_matmul, for the fused gate/up projection and SiLU-and-multiply."""
    scales = dict(scale_inv=scale_inv, scale_block=scale_block, k_major=k_major)
    config = _tiling(lhs, gate_up, rows, True, scale_block, k_major, real_rows=real_rows)
    if config is None:
        return grouped_swiglu_reference(lhs, gate_up, group_sizes, rows, **scales)
    if isinstance(config, GroupedWgmmaConfig):
        return grouped_wgmma(lhs if rows is None else lhs[rows], gate_up, group_sizes, scale_inv=scale_inv,
                             config=config, swiglu=True)
    return grouped_swiglu_kernel(lhs, gate_up, group_sizes, rows, **scales, config=config)
