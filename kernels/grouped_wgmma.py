"""Grouped matmul for Hopper's prefill regime, as one Mosaic GPU kernel (wgmma, TMA): the
expert FFNs of a mixture of experts where their rows are many, for the row counts
where the MMA rate decides and kernels/grouped_matmul.py's Triton tiles, which run
without wgmma, reach about half of it (docs/kernels.md).

Layout (kernels/grouped_matmul.py's, less its row gather: TMA copies whole tiles, so the
rows come in sorted):
  lhs          [M, K]     bfloat16 sorted rows, group g's rows sum(group_sizes[:g]) ..
                          sum(group_sizes[:g+1]) - 1; rows past the sum (padding) come
                          out 0
  rhs          [G, K, N]  bfloat16; swiglu: [G, K, 2, N], the gate and the up projection
                          side by side; fp8 experts (with scale_inv): float8_e4m3fn held
                          K-major, [G, N, K] (swiglu [G, 2, N, K]), as the engine holds
                          them on one device
  scale_inv    fp8: float32 [G, K / 128, (2,) N / 128], one scale per 128 x 128 block
  group_sizes  int32 [G]
  -> [M, N] (swiglu: silu(lhs @ gate) * (lhs @ up) on the float32 accumulators)

Work split (JAX's ragged_dot_mgpu's): the rows are cut into blocks of block_m on one
grid over all groups, so that every tile's TMA copy is whole and aligned. A block that
two groups share is computed once for each, and each stores only its own rows. The
tiles are (group, block) pairs, at most cdiv(M, block_m) + G of them with the padding
rows' blocks, which store zeros and compute nothing; `tile_table` lists them in XLA
before the call, so a program reads its group, block and rows from four scalars. Each
program computes one [block_m, block_n] tile: a pipeline of TMA copies streams the row
and weight tiles of each K step into shared memory and wgmma accumulates in float32,
each step's products left in flight while the next step's are issued. A compute
warpgroup owns 64 rows (wgmma's M); with block_m 128 two compute warpgroups share each
weight tile, fed by a third warpgroup that only issues the copies (Mosaic GPU's
warp-specialized pipeline). The tile goes out through shared memory by TMA copies of
2^i rows (ragged_dot_mgpu's ladder), which store exactly the group's rows.

fp8 experts run DeepSeek-V3's math, as kernels/fp8_wgmma.py does for dense weights: the
rows quantized to e4m3 per row and 128 columns (fp8_matmul.quantize_activations), K
steps of one scale block, each step's e4m3 x e4m3 product in a fresh float32
accumulator added into registers times the rows' and the columns' scales of the step.
Mosaic GPU's interpreter (the CPU tests) has no transposed wgmma operand, so there the
fp8 weight goes in as [G, K, N] and its tiles are read as they lie.

Not yet measured on a GPU: benchmarks/grouped_sweep.py times it beside the Triton tiles
for prefill cases, and the grouped table names it {"wgmma": [block_m, block_n, block_k,
max_concurrent_steps]} where it wins, the only way the engine reaches it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmtp.kernels.fp8_matmul import quantize_activations
from jaxmtp.kernels.fp8_wgmma import SCALE_BLOCK, WARPGROUP_LOWERING, WGMMA_ROWS, column_scales, tile_transforms


@dataclasses.dataclass(frozen=True)
class GroupedWgmmaConfig:
    """Static tiling of one call, as benchmarks/grouped_sweep.py times it."""

    block_m: int = 128  # WGMMA_ROWS a compute warpgroup: 64 (one) or 128 (two sharing each weight tile)
    block_n: int = 128  # output columns per program: a multiple of 8, at most max_block_n
    block_k: int = 64  # K step: 64 bf16 values are one 128-byte swizzle row; fp8: the scale block, 128
    max_concurrent_steps: int = 4  # K steps in flight in the TMA pipeline


def max_block_n(swiglu: bool, scaled: bool) -> int:
    """The widest tile whose float32 accumulators fit a warpgroup's registers: 256
    columns in one, 128 in swiglu's two; fp8 also holds each step's products apart
    (128, or 64 for swiglu)."""
    return (64 if swiglu else 128) if scaled else (128 if swiglu else 256)


# a Hopper multiprocessor's shared memory that one block may take (227 KiB), less 1 KiB
# for the pipeline's barriers
SMEM_BYTES = 227 * 1024 - 1024


def smem_bytes(config: GroupedWgmmaConfig, swiglu: bool, scaled: bool) -> int:
    """Shared memory of one program: the pipeline's K steps in flight (a row tile and the
    weights' tiles; fp8: their scales too) and the bf16 output tile."""
    block_k = SCALE_BLOCK if scaled else config.block_k
    columns = (2 if swiglu else 1) * config.block_n
    tiles = config.block_m + columns
    step = block_k * tiles * (1 if scaled else 2) + (4 * tiles if scaled else 0)
    return config.max_concurrent_steps * step + 2 * config.block_m * config.block_n


def fits(k: int, n: int, config: GroupedWgmmaConfig, swiglu: bool = False, scaled: bool = False) -> bool:
    """Whether rhs with K rows and N output columns runs at this tiling (scaled: fp8
    experts, whose K step is the scale block) within a multiprocessor's shared memory."""
    block_k = SCALE_BLOCK if scaled else config.block_k
    # a bf16 step's tiles are released a step late: the pipeline holds two at the least
    return (config.block_m in (WGMMA_ROWS, 2 * WGMMA_ROWS) and k % block_k == 0 and n % config.block_n == 0
            and config.block_n % 8 == 0 and config.block_n <= max_block_n(swiglu, scaled)
            and config.max_concurrent_steps >= 2 and (not scaled or config.block_k == SCALE_BLOCK)
            and smem_bytes(config, swiglu, scaled) <= SMEM_BYTES)


def takes(dtype, k: int, n: int, swiglu: bool, scale_block, k_major: bool, config: GroupedWgmmaConfig) -> bool:
    """Whether the kernel takes grouped_matmul's call at this tiling: bf16 rows, and bf16
    experts as loaded or fp8 ones K-major in 128 x 128 blocks (n: the weight's columns,
    swiglu's gate and up)."""
    scaled = scale_block is not None
    layout_ok = scale_block == (SCALE_BLOCK, SCALE_BLOCK) and k_major if scaled else not k_major
    return dtype == jnp.bfloat16 and layout_ok and fits(k, n // 2 if swiglu else n, config, swiglu, scaled)


def tile_table(group_sizes: jax.Array, num_rows: int, block_m: int) -> tuple[jax.Array, jax.Array]:
    """The call's tiles: (groups [T], bounds [T, 3]) for T = cdiv(num_rows, block_m) +
    G, each tile's group (G: the padding rows, past the groups' sum; G + 1: no tile),
    block (its rows block * block_m ..) and first and last-plus-one row within the
    block. The groups' tiles come in order, then the padding's."""
    num_groups = group_sizes.shape[0]
    num_tiles = -(-num_rows // block_m) + num_groups
    # the padding rows as one more group, so that their blocks are listed as the groups' are
    sizes = jnp.concatenate([group_sizes.astype(jnp.int32), (num_rows - jnp.sum(group_sizes))[None].astype(jnp.int32)])
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first_block, last_block = starts // block_m, (ends - 1) // block_m
    tiles_per_group = jnp.where(sizes > 0, last_block - first_block + 1, 0)
    tiles_end = jnp.cumsum(tiles_per_group)
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    group = jnp.sum(tiles_end[None, :] <= tile[:, None], axis=1).astype(jnp.int32)  # num_groups + 1: no tile
    live = jnp.minimum(group, num_groups)
    block = first_block[live] + tile - (tiles_end[live] - tiles_per_group[live])
    lo = jnp.clip(starts[live] - block * block_m, 0, block_m)
    hi = jnp.clip(ends[live] - block * block_m, 0, block_m)
    bounds = jnp.stack([block, lo, hi], axis=1)
    return group, jnp.where((group <= num_groups)[:, None], bounds, 0).astype(jnp.int32)  # no tile: no rows


def _store_rows(tile, o_smem, out_gmem, row0, lo, hi, col0):
    """tile [rows, block_n] into o_smem, then its rows lo .. hi - 1 to out_gmem's rows
    row0 + lo .., one TMA copy of 2^i rows for each bit i of their count."""
    rows, block_n = o_smem.shape
    o_smem[...] = tile.astype(o_smem.dtype)
    plgpu.commit_smem()
    start, count = lo, hi - lo
    for bit in reversed(range(int(math.log2(rows)) + 1)):
        length = 1 << bit

        @pl.when(count & length != 0)
        def _():
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, length)],
                                    out_gmem.at[pl.ds(row0 + start, length), pl.ds(col0, block_n)])

        start = start + (count & length)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _body(groups_gmem, bounds_gmem, lhs_gmem, rhs_gmem, *scales_and_out, config: GroupedWgmmaConfig, k_steps: int,
          num_groups: int, swiglu: bool, interpret: bool):
    """One [block_m, block_n] output tile (grid axes "m": the tile, "n": its columns),
    WGMMA_ROWS rows a compute warpgroup: one runs the pipeline itself; two share each row
    and weight tile that a third, the memory warpgroup, copies in (axis "wg"). With
    scales (fp8: the rows' [K / 128, rows] and the group's columns' [G, K / 128, N]) each
    K step's product goes to a fresh accumulator and is added into registers scaled."""
    *scales, out_gmem = scales_and_out
    block_m, block_n = config.block_m, config.block_n
    block_k = SCALE_BLOCK if scales else config.block_k
    k_major = bool(scales) and not interpret  # the interpreter's wgmma takes no transposed operand
    warpgroups = block_m // WGMMA_ROWS
    weights = 2 if swiglu else 1
    tile, col_block = lax.axis_index("m"), lax.axis_index("n")
    group, block = groups_gmem[tile], bounds_gmem[tile, 0]
    lo, hi = bounds_gmem[tile, 1], bounds_gmem[tile, 2]
    live_group = jnp.minimum(group, num_groups - 1)
    columns = out_gmem.shape[1]  # swiglu: the up projection's columns start here in rhs

    def layout(value, register_layout):
        """value in register_layout: a hint to the GPU's lowering (Mosaic GPU's
        interpreter has no registers, nor a rule for the cast)."""
        return value if interpret else plgpu.layout_cast(value, register_layout)

    def warpgroup():
        return 0 if warpgroups == 1 else lax.axis_index("wg")

    def rows():
        return pl.ds(warpgroup() * WGMMA_ROWS, WGMMA_ROWS)

    def col(part: int):
        """The gate's column block (part 0), or swiglu's up projection's, `columns` further on."""
        return col_block + part * (columns // block_n)

    def store(values, o_smem):
        """The tile from its accumulators' values (swiglu: silu(gate) * up; the padding's:
        zeros), this warpgroup's rows of the tile's group."""
        out = values[0] if not swiglu else values[0] / (1 + jnp.exp(-values[0])) * values[1]
        first = warpgroup() * WGMMA_ROWS

        def put(tile):
            _store_rows(tile, o_smem.at[warpgroup()], out_gmem, block * block_m + first,
                        jnp.clip(lo - first, 0, WGMMA_ROWS), jnp.clip(hi - first, 0, WGMMA_ROWS), col_block * block_n)

        # two branches, not a select: the GPU lowering broadcasts no scalar predicate over
        # a warpgroup's registers
        pl.when(group < num_groups)(lambda: put(out))
        pl.when(group >= num_groups)(lambda: put(layout(jnp.zeros_like(out), plgpu.Layout.WGMMA)))

    def weight_tile(w_smem):
        return plgpu.transpose_ref(w_smem, (1, 0)) if k_major else w_smem

    def step(_, x_smem, *w_smem_and_accs):
        """bf16: the step's products into the accumulators, left in flight while the
        next step's are issued (its tiles are released a step late: delay_release)."""
        w_smem, accs = w_smem_and_accs[:weights], w_smem_and_accs[weights:]

        @pl.when(group < num_groups)  # the padding's tiles and the unused ones multiply nothing
        def _():
            for w, acc in zip(w_smem, accs):
                plgpu.wgmma(acc, x_smem.at[rows()], weight_tile(w))
            plgpu.wgmma_wait(1)

        return accs

    def scaled_step(_, x_smem, *refs):
        """fp8: each weight's product of the step into a fresh accumulator, then into the
        carried one times the rows' and the columns' scales of the step."""
        w_smem, xs_smem, ws_smem, carried = refs[:weights], refs[weights], refs[weights + 1:-1], refs[-1]
        row_scale = lax.broadcast_in_dim(layout(xs_smem[0, rows()], plgpu.Layout.WGMMA.reduce(1)),
                                         (WGMMA_ROWS, block_n), [0])
        out = []
        for w, ws, acc in zip(w_smem, ws_smem, carried):
            def product(acc_ref):
                plgpu.wgmma(acc_ref, x_smem.at[rows()], weight_tile(w))
                return acc_ref[...]

            products = pl.run_scoped(product, plgpu.ACC((WGMMA_ROWS, block_n), jnp.float32))
            col_scale = layout(ws[0], plgpu.Layout.WGMMA.reduce(0))
            out.append(acc + products * row_scale * lax.broadcast_in_dim(col_scale, (WGMMA_ROWS, block_n), [1]))
        return tuple(out)

    delay = 0 if scales else 1
    operand = tile_transforms(block_k, lhs_gmem.dtype)
    if k_major:
        weight_specs = [plgpu.BlockSpec((block_n, block_k), functools.partial(lambda p, k: (col(p), k), part),
                                        transforms=operand, delay_release=delay) for part in range(weights)]
    else:
        weight_specs = [plgpu.BlockSpec((block_k, block_n), functools.partial(lambda p, k: (k, col(p)), part),
                                        transforms=tile_transforms(block_n, rhs_gmem.dtype), delay_release=delay)
                        for part in range(weights)]
    in_specs = [plgpu.BlockSpec((block_m, block_k), lambda k: (block, k), transforms=operand, delay_release=delay)]
    in_specs += weight_specs
    operands = [lhs_gmem] + [rhs_gmem.at[live_group]] * weights
    if scales:
        xs_gmem, ws_gmem = scales
        in_specs.append(plgpu.BlockSpec((1, block_m), lambda k: (k, block)))
        in_specs += [plgpu.BlockSpec((1, block_n), functools.partial(lambda p, k: (k, col(p)), part))
                     for part in range(weights)]
        operands += [xs_gmem] + [ws_gmem.at[live_group]] * weights
    accumulators = [plgpu.ACC((WGMMA_ROWS, block_n), jnp.float32) for _ in range(weights)]
    zeros = tuple(layout(jnp.zeros((WGMMA_ROWS, block_n), jnp.float32), plgpu.Layout.WGMMA) for _ in range(weights))

    def one_warpgroup(o_smem):
        if scales:
            store(plgpu.emit_pipeline(scaled_step, grid=(k_steps,), in_specs=in_specs, init_carry=zeros,
                                      max_concurrent_steps=config.max_concurrent_steps)(*operands), o_smem)
            return

        def with_accs(*accs):
            def body(k, *refs):
                step(k, *refs, *accs)

            plgpu.emit_pipeline(body, grid=(k_steps,), in_specs=in_specs,
                                max_concurrent_steps=config.max_concurrent_steps)(*operands)
            store([acc[...] for acc in accs], o_smem)

        pl.run_scoped(with_accs, *accumulators)

    def warp_specialized(o_smem):
        if scales:
            body, context = scaled_step, lambda pipeline: store(pipeline(zeros), o_smem)
        else:
            def body(k, *refs):
                return step(k, *refs[:-1], *refs[-1])

            def context(pipeline):
                pl.run_scoped(lambda *accs: store([acc[...] for acc in pipeline(accs)], o_smem), *accumulators)

        plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_steps,), in_specs=in_specs, max_concurrent_steps=config.max_concurrent_steps,
            memory_registers=40, wg_axis="wg", num_compute_wgs=warpgroups, compute_context=context,
        )(*operands)

    # shared memory of a kernel with several warpgroups is allocated by all of them together
    pl.run_scoped(one_warpgroup if warpgroups == 1 else warp_specialized,
                  plgpu.SMEM((warpgroups, WGMMA_ROWS, block_n), out_gmem.dtype),
                  collective_axes=() if warpgroups == 1 else "wg")


@functools.partial(jax.jit, static_argnames=("config", "swiglu", "interpret"))
def grouped_wgmma(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, scale_inv: jax.Array | None = None,
                  config: GroupedWgmmaConfig = GroupedWgmmaConfig(), swiglu: bool = False, interpret=None) -> jax.Array:
    """lhs [M, K] sorted rows times their groups' rhs -> [M, N] in lhs's dtype (swiglu:
    silu(gate) * up); see the module docstring. rhs: bf16 [G, K, N] (swiglu [G, K, 2,
    N]), or with scale_inv fp8 experts K-major, [G, N, K] (swiglu [G, 2, N, K]), with
    their 128 x 128 block scales [G, K / 128, (2,) N / 128]: the rows are quantized to
    e4m3 per row and 128 columns (fp8_matmul.quantize_activations) and each K step's
    product scaled by both (DeepSeek-V3's math, as kernels/fp8_wgmma.py). interpret:
    Mosaic GPU's interpreter's parameters (CPU tests), or None."""
    m, k = lhs.shape
    scaled = scale_inv is not None
    num_groups, n = rhs.shape[0], (rhs.shape[-2] if scaled else rhs.shape[-1])
    if rhs.shape[-1 if scaled else 1] != k or not fits(k, n, config, swiglu, scaled):
        raise ValueError(f"grouped_wgmma: lhs {lhs.shape} and {'fp8 ' if scaled else ''}rhs {rhs.shape} do not fit "
                         f"{config} (K a multiple of block_k, {SCALE_BLOCK} for fp8; N of block_n, at most "
                         f"{max_block_n(swiglu, scaled)}; block_m {WGMMA_ROWS} or {2 * WGMMA_ROWS})")
    rows = -(-m // config.block_m) * config.block_m
    groups, bounds = tile_table(group_sizes, m, config.block_m)
    block_k = SCALE_BLOCK if scaled else config.block_k
    kernel = plgpu.kernel(
        functools.partial(_body, config=config, k_steps=k // block_k, num_groups=num_groups, swiglu=swiglu,
                          interpret=interpret is not None),
        out_type=jax.ShapeDtypeStruct((rows, n), lhs.dtype),
        grid=(groups.shape[0], n // config.block_n),
        grid_names=("m", "n"),
        # two compute warpgroups and the memory warpgroup that feeds them
        **({} if config.block_m == WGMMA_ROWS else {"num_threads": 3, "thread_name": "wg"}),
        compiler_params=WARPGROUP_LOWERING,
        interpret=interpret,
    )
    padded = jnp.pad(lhs, ((0, rows - m), (0, 0)))
    if not scaled:
        return kernel(groups, bounds, padded, rhs.reshape(num_groups, k, -1))[:m]
    x8, x_scale = quantize_activations(padded, SCALE_BLOCK)
    weight = rhs.reshape(num_groups, -1, k)  # [G, (2 *) N, K]
    if interpret is not None:
        weight = weight.transpose(0, 2, 1)
    # each group's block scales as fp8_wgmma's column_scales lays a dense weight's out:
    # [G, K / 128, (2 *) N], one scale a column per K step
    per_block = scale_inv.reshape(num_groups, scale_inv.shape[1], -1, scale_inv.shape[-1])
    scales = jax.vmap(functools.partial(column_scales, n=n))(per_block)
    return kernel(groups, bounds, x8, weight, x_scale.T, scales)[:m]
