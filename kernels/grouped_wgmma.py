"""Grouped matmul for Hopper's prefill regime, as one Mosaic GPU kernel (wgmma, TMA): the
expert FFNs of a mixture of experts where their rows are many, for the row counts
where the MMA rate decides and kernels/grouped_matmul.py's Triton tiles, which run
without wgmma, reach about half of it (docs/kernels.md).

Layout (kernels/grouped_matmul.py's, less its row gather: TMA copies whole tiles, so the
rows come in sorted):
  lhs          [M, K]     sorted rows, group g's rows sum(group_sizes[:g]) ..
                          sum(group_sizes[:g+1]) - 1; rows past the sum (padding) come
                          out 0
  rhs          [G, K, N]  bfloat16; swiglu: [G, K, 2, N], the gate and the up projection
                          side by side
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
each step's products left in flight while the next step's are issued. A
compute warpgroup owns 64 rows (wgmma's M); with block_m 128 two compute warpgroups
share each weight tile, fed by a third warpgroup that only issues the copies (Mosaic
GPU's warp-specialized pipeline). The tile goes out through shared memory by TMA
copies of 2^i rows (ragged_dot_mgpu's ladder), which store exactly the group's rows.

Not yet measured on a GPU: benchmarks/grouped_sweep.py times it beside the Triton tiles
(`--wgmma`), and the grouped table names it {"wgmma": [block_m, block_n, block_k,
max_concurrent_steps]} where it wins.
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

from jaxmtp.kernels.fp8_wgmma import WGMMA_ROWS, tile_transforms



@dataclasses.dataclass(frozen=True)
class GroupedWgmmaConfig:
    """Static tiling of one call, as benchmarks/grouped_sweep.py times it."""

    block_m: int = 128  # WGMMA_ROWS a compute warpgroup: 64 (one) or 128 (two sharing each weight tile)
    block_n: int = 128  # output columns per program: a multiple of 8, at most 128 with swiglu's two accumulators
    block_k: int = 64  # K step: 64 bf16 values are one 128-byte swizzle row
    max_concurrent_steps: int = 4  # K steps in flight in the TMA pipeline


def fits(k: int, n: int, config: GroupedWgmmaConfig, swiglu: bool = False) -> bool:
    """Whether rhs [G, K, N] (swiglu: N the output columns) runs at this tiling."""
    # a step's tiles are released a step late: the pipeline holds two at the least
    return (config.block_m in (WGMMA_ROWS, 2 * WGMMA_ROWS) and k % config.block_k == 0 and n % config.block_n == 0
            and config.block_n % 8 == 0 and config.block_n <= (128 if swiglu else 256)
            and config.max_concurrent_steps >= 2)


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


def _body(groups_gmem, bounds_gmem, lhs_gmem, rhs_gmem, out_gmem, *, config: GroupedWgmmaConfig, k_steps: int,
          num_groups: int, swiglu: bool):
    """One [block_m, block_n] output tile (grid axes "m": the tile, "n": its columns),
    WGMMA_ROWS rows a compute warpgroup: one runs the pipeline itself; two share each row
    and weight tile that a third, the memory warpgroup, copies in (axis "wg")."""
    block_m, block_n, block_k = config.block_m, config.block_n, config.block_k
    warpgroups = block_m // WGMMA_ROWS
    tile, col_block = lax.axis_index("m"), lax.axis_index("n")
    group, block = groups_gmem[tile], bounds_gmem[tile, 0]
    lo, hi = bounds_gmem[tile, 1], bounds_gmem[tile, 2]
    columns = out_gmem.shape[1]  # swiglu: the up projection's columns start here in rhs
    operand = tile_transforms(block_k, lhs_gmem.dtype)
    weight = tile_transforms(block_n, rhs_gmem.dtype)

    def warpgroup():
        return 0 if warpgroups == 1 else lax.axis_index("wg")

    def store(tile_value, o_smem):
        """This warpgroup's rows of the tile, those of the tile's group."""
        first = warpgroup() * WGMMA_ROWS
        _store_rows(tile_value, o_smem.at[warpgroup()], out_gmem, block * block_m + first,
                    jnp.clip(lo - first, 0, WGMMA_ROWS), jnp.clip(hi - first, 0, WGMMA_ROWS), col_block * block_n)

    def product(accs, o_smem):
        """The tile from its accumulators (the padding's: zeros), stored."""
        gate = accs[0][...]
        out = gate if not swiglu else gate / (1 + jnp.exp(-gate)) * accs[1][...]
        store(jnp.where(group < num_groups, out, 0.0), o_smem)

    def k_step(_, x_smem, *w_smem_and_accs):
        w_smem, accs = w_smem_and_accs[:len(w_smem_and_accs) // 2], w_smem_and_accs[len(w_smem_and_accs) // 2:]
        rows = pl.ds(warpgroup() * WGMMA_ROWS, WGMMA_ROWS)

        @pl.when(group < num_groups)  # the padding's tiles and the unused ones multiply nothing
        def _():
            for w, acc in zip(w_smem, accs):
                plgpu.wgmma(acc, x_smem.at[rows], w)
            # this step's products stay in flight while the next step's are issued: its
            # tiles are released a step late (the specs' delay_release)
            plgpu.wgmma_wait(1)

        return accs

    def weight_spec(part: int):
        """The gate's columns (part 0), or swiglu's up projection's, `columns` further on."""
        return plgpu.BlockSpec((block_k, block_n), lambda k: (k, col_block + part * (columns // block_n)),
                               transforms=weight, delay_release=1)

    weights = 2 if swiglu else 1
    in_specs = [plgpu.BlockSpec((block_m, block_k), lambda k: (block, k), transforms=operand, delay_release=1)]
    in_specs += [weight_spec(part) for part in range(weights)]
    group_rhs = rhs_gmem.at[jnp.minimum(group, num_groups - 1)]
    accumulators = [plgpu.ACC((WGMMA_ROWS, block_n), jnp.float32) for _ in range(weights)]

    def compute(o_smem):
        if warpgroups == 1:
            def with_accs(*accs):
                def step(k, x, *w):
                    k_step(k, x, *w, *accs)

                plgpu.emit_pipeline(step, grid=(k_steps,), in_specs=in_specs,
                                    max_concurrent_steps=config.max_concurrent_steps)(lhs_gmem, *[group_rhs] * weights)
                product(accs, o_smem)

            pl.run_scoped(with_accs, *accumulators)
            return

        def compute_context(pipeline):
            pl.run_scoped(lambda *accs: product(pipeline(accs), o_smem), *accumulators)

        plgpu.emit_pipeline_warp_specialized(
            lambda k, x, *rest: k_step(k, x, *rest[:-1], *rest[-1]), grid=(k_steps,), in_specs=in_specs,
            max_concurrent_steps=config.max_concurrent_steps, memory_registers=40, wg_axis="wg",
            num_compute_wgs=warpgroups, compute_context=compute_context,
        )(lhs_gmem, *[group_rhs] * weights)

    # shared memory of a kernel with several warpgroups is allocated by all of them together
    pl.run_scoped(compute, plgpu.SMEM((warpgroups, WGMMA_ROWS, block_n), out_gmem.dtype),
                  collective_axes=() if warpgroups == 1 else "wg")


@functools.partial(jax.jit, static_argnames=("config", "swiglu", "interpret"))
def grouped_wgmma(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                  config: GroupedWgmmaConfig = GroupedWgmmaConfig(), swiglu: bool = False, interpret=None) -> jax.Array:
    """lhs [M, K] sorted rows times their groups' rhs [G, K, N] (swiglu: [G, K, 2, N],
    silu(gate) * up) -> [M, N] in lhs's dtype; see the module docstring. interpret:
    Mosaic GPU's interpreter's parameters (CPU tests), or None."""
    m, k = lhs.shape
    num_groups, n = rhs.shape[0], rhs.shape[-1]
    if rhs.shape[1] != k or not fits(k, n, config, swiglu):
        raise ValueError(f"grouped_wgmma: lhs {lhs.shape} and rhs {rhs.shape} need K a multiple of block_k="
                         f"{config.block_k}, N of block_n={config.block_n} (at most {128 if swiglu else 256}) and "
                         f"block_m {WGMMA_ROWS} or {2 * WGMMA_ROWS} (got {config.block_m})")
    rows = -(-m // config.block_m) * config.block_m
    groups, bounds = tile_table(group_sizes, m, config.block_m)
    kernel = plgpu.kernel(
        functools.partial(_body, config=config, k_steps=k // config.block_k, num_groups=num_groups, swiglu=swiglu),
        out_type=jax.ShapeDtypeStruct((rows, n), lhs.dtype),
        grid=(groups.shape[0], n // config.block_n),
        grid_names=("m", "n"),
        # two compute warpgroups and the memory warpgroup that feeds them
        **({} if config.block_m == WGMMA_ROWS else {"num_threads": 3, "thread_name": "wg"}),
        interpret=interpret,
    )
    padded = jnp.pad(lhs, ((0, rows - m), (0, 0)))
    return kernel(groups, bounds, padded, rhs.reshape(num_groups, k, -1))[:m]
