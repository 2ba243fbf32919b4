"""Block-scaled fp8 x fp8 GEMM for Hopper, as one Mosaic GPU kernel (wgmma, TMA):
DeepSeek-V3's math, x quantized to e4m3 per row and 128-column block (fp8_matmul.
quantize_activations) times an e4m3 weight with one scale per 128 x 128 block, for the
row counts where the MMA rate decides (prefill chunks, large batches), where the
Triton tiles of kernels/fp8_matmul.py ran without wgmma (docs/kernels.md).

Layout (the engine's K-major fp8 weight, fp8_matmul's `k_major`):
  x8         [M, K]              float8_e4m3fn, quantize_activations' values
  x_scale    [M, K / 128]        float32, quantize_activations' scales
  weight     [P, N, K]           float8_e4m3fn, K contiguous (wgmma's 8-bit operands
                                 must be K-major in shared memory)
  scale_inv  [K / 128, P, N / 128]  float32
  -> [M, P, N] in out_dtype

Each program computes one [block_m, block_n] tile: a pipeline of TMA copies streams the
x and weight tiles of each 128-wide K step (the scale block) into shared memory, one
wgmma multiplies them into a fresh float32 accumulator, and its result, scaled by the
row's x scale and the column's weight scale of that K step, is added into a float32
accumulator kept in registers (DeepGEMM's promotion: a K step's scales differ per row
and per column block, so no single accumulator can carry them). The weight's scales
reach the kernel one per column (`column_scales`), so a tile may span several scale
blocks. A compute warpgroup owns 64 rows (wgmma's M), and block_n up to 128 keeps its
two accumulators within the registers; with block_m 128 two compute warpgroups share
each weight tile (half the weight's reads from L2 per row), fed by a third warpgroup
that only issues the copies (Mosaic GPU's warp-specialized pipeline). M is padded to
block_m; K and N must be whole scale blocks and N whole tiles (`fits`). Mosaic GPU's
interpreter (the CPU tests) has no transposed wgmma operand, so there the weight goes
in as [K, P * N] and its tiles are read as they lie; the rest of the kernel is the GPU's.

Not yet measured on a GPU: benchmarks/fp8_sweep.py times it beside the Triton tiles
from 64 rows and writes {"wgmma": [block_m, block_n, max_concurrent_steps]} into
kernels/fp8_tilings.json where it wins, the only way the engine reaches it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

SCALE_BLOCK = 128  # DeepSeek-V3's, and the K step: 128 e4m3 bytes are one 128-byte swizzle row
WGMMA_ROWS = 64  # wgmma's M: the rows of one warpgroup's accumulators
# the lowering jax 0.11 takes by default (jax 0.10: the lane one), named so that both
# versions lower these kernels alike, the CPU's lowering tests included
WARPGROUP_LOWERING = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


@dataclasses.dataclass(frozen=True)
class WgmmaConfig:
    """Static tiling of one call, as benchmarks/fp8_sweep.py times it."""

    block_m: int = 64  # WGMMA_ROWS a compute warpgroup: 64 (one) or 128 (two sharing each weight tile)
    block_n: int = 128  # output columns per program, a multiple of 8 and at most 128
    max_concurrent_steps: int = 4  # K steps in flight in the TMA pipeline


def fits(k: int, n: int, block: tuple[int, int], config: WgmmaConfig) -> bool:
    """Whether a [P, N, K] weight with block scales can run here at this tiling."""
    return (block == (SCALE_BLOCK, SCALE_BLOCK) and k % SCALE_BLOCK == 0 and n % config.block_n == 0
            and config.block_m in (WGMMA_ROWS, 2 * WGMMA_ROWS))


def column_scales(scale_inv: jax.Array, n: int) -> jax.Array:
    """[K / 128, P, N / 128] block scales as [K / 128, P * N]: each column's scale per K
    step, so a program loads its tile's row of them as one TMA copy."""
    return jnp.repeat(scale_inv.astype(jnp.float32), SCALE_BLOCK, axis=2)[:, :, :n].reshape(scale_inv.shape[0], -1)


def tile_transforms(columns: int, dtype):
    """Shared-memory tiling and swizzle for wgmma operands and TMA copies of tiles whose
    rows are `columns` values of dtype."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(128, columns * itemsize)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _body(x_gmem, xs_gmem, w_gmem, ws_gmem, out_gmem, *, config: WgmmaConfig, k_steps: int, interpret: bool):
    """One [block_m, block_n] output tile (grid axes "m" and "n"), WGMMA_ROWS rows a
    compute warpgroup: one runs the pipeline itself; two share each x and weight tile
    that a third, the memory warpgroup, copies in (axis "wg")."""
    block_m, block_n = config.block_m, config.block_n
    warpgroups = block_m // WGMMA_ROWS

    def layout(value, register_layout):
        """value in register_layout: a hint to the GPU's lowering (Mosaic GPU's
        interpreter has no registers, nor a rule for the cast)."""
        return value if interpret else plgpu.layout_cast(value, register_layout)

    row_block, col_block = lax.axis_index("m"), lax.axis_index("n")
    operand = tile_transforms(SCALE_BLOCK, x_gmem.dtype)

    def warpgroup():
        """The index of this compute warpgroup (its rows are the tile's WGMMA_ROWS-th)."""
        return 0 if warpgroups == 1 else lax.axis_index("wg")

    def k_step(_, x_smem, w_smem, xs_smem, ws_smem, acc):
        """This warpgroup's rows of one K step, scaled into acc."""
        rows = pl.ds(warpgroup() * WGMMA_ROWS, WGMMA_ROWS)

        def product(acc_ref):
            plgpu.wgmma(acc_ref, x_smem.at[rows], w_smem if interpret else plgpu.transpose_ref(w_smem, (1, 0)))
            return acc_ref[...]

        step = pl.run_scoped(product, plgpu.ACC((WGMMA_ROWS, block_n), jnp.float32))
        row_scale = layout(xs_smem[0, rows], plgpu.Layout.WGMMA.reduce(1))
        col_scale = layout(ws_smem[0], plgpu.Layout.WGMMA.reduce(0))
        scale = (lax.broadcast_in_dim(row_scale, (WGMMA_ROWS, block_n), [0])
                 * lax.broadcast_in_dim(col_scale, (WGMMA_ROWS, block_n), [1]))
        return acc + step * scale

    def store(acc, o_smem):
        """This warpgroup's rows of the tile, through its part of o_smem by TMA."""
        part = o_smem.at[warpgroup()]
        part[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        first_row = row_block * block_m + warpgroup() * WGMMA_ROWS
        plgpu.copy_smem_to_gmem(part, out_gmem.at[pl.ds(first_row, WGMMA_ROWS),
                                                   pl.ds(col_block * block_n, block_n)])
        plgpu.wait_smem_to_gmem(0)

    in_specs = [
        plgpu.BlockSpec((block_m, SCALE_BLOCK), lambda k: (row_block, k), transforms=operand),
        # the interpreter's wgmma takes no transposed operand: it gets the weight [K, N]
        plgpu.BlockSpec((SCALE_BLOCK, block_n), lambda k: (k, col_block),
                        transforms=tile_transforms(block_n, w_gmem.dtype)) if interpret
        else plgpu.BlockSpec((block_n, SCALE_BLOCK), lambda k: (col_block, k), transforms=operand),
        plgpu.BlockSpec((1, block_m), lambda k: (k, row_block)),
        plgpu.BlockSpec((1, block_n), lambda k: (k, col_block)),
    ]
    zeros = layout(jnp.zeros((WGMMA_ROWS, block_n), jnp.float32), plgpu.Layout.WGMMA)

    def run(o_smem):
        if warpgroups == 1:
            acc = plgpu.emit_pipeline(k_step, grid=(k_steps,), in_specs=in_specs,
                                      max_concurrent_steps=config.max_concurrent_steps,
                                      init_carry=zeros)(x_gmem, w_gmem, xs_gmem, ws_gmem)
            store(acc, o_smem)
            return
        plgpu.emit_pipeline_warp_specialized(
            k_step, grid=(k_steps,), in_specs=in_specs, max_concurrent_steps=config.max_concurrent_steps,
            memory_registers=40, wg_axis="wg", num_compute_wgs=warpgroups,
            compute_context=lambda pipeline: store(pipeline(zeros), o_smem),
        )(x_gmem, w_gmem, xs_gmem, ws_gmem)

    # shared memory of a kernel with several warpgroups is allocated by all of them together
    pl.run_scoped(run, plgpu.SMEM((warpgroups, WGMMA_ROWS, block_n), out_gmem.dtype,
                                  transforms=tile_transforms(block_n, out_gmem.dtype)),
                  collective_axes=() if warpgroups == 1 else "wg")


@functools.partial(jax.jit, static_argnames=("config", "out_dtype", "interpret"))
def fp8_wgmma_matmul(x8: jax.Array, x_scale: jax.Array, weight: jax.Array, scale_inv: jax.Array, *,
                     config: WgmmaConfig = WgmmaConfig(), out_dtype=jnp.bfloat16, interpret=None) -> jax.Array:
    """x8 [M, K] (e4m3) with x_scale [M, K / 128] times a K-major weight [P, N, K] (e4m3)
    with scale_inv [K / 128, P, N / 128] -> [M, P, N] in out_dtype; see the module
    docstring. interpret: Mosaic GPU's interpreter's parameters (CPU tests), or None."""
    m, k = x8.shape
    parts, n, k_weight = weight.shape
    steps = k // SCALE_BLOCK
    if k_weight != k or not fits(k, n, (SCALE_BLOCK, SCALE_BLOCK), config):
        raise ValueError(f"fp8_wgmma_matmul: x {x8.shape} and weight {weight.shape} need K a multiple of "
                         f"{SCALE_BLOCK}, N a multiple of block_n={config.block_n} and block_m "
                         f"{WGMMA_ROWS} or {2 * WGMMA_ROWS} (got {config.block_m})")
    if x_scale.shape != (m, steps) or scale_inv.shape != (steps, parts, n // SCALE_BLOCK + (n % SCALE_BLOCK > 0)):
        raise ValueError(f"fp8_wgmma_matmul: x_scale {x_scale.shape} and scale_inv {scale_inv.shape} do not "
                         f"fit x {x8.shape} and weight {weight.shape}")
    rows = pl.cdiv(m, config.block_m) * config.block_m
    x8 = jnp.pad(x8, ((0, rows - m), (0, 0)))
    x_scale_t = jnp.pad(x_scale.astype(jnp.float32), ((0, rows - m), (0, 0))).T  # [K / 128, rows]
    columns = parts * n
    kernel = plgpu.kernel(
        functools.partial(_body, config=config, k_steps=steps, interpret=interpret is not None),
        out_type=jax.ShapeDtypeStruct((rows, columns), out_dtype),
        grid=(rows // config.block_m, columns // config.block_n),
        grid_names=("m", "n"),
        # two compute warpgroups and the memory warpgroup that feeds them
        **({} if config.block_m == WGMMA_ROWS else {"num_threads": 3, "thread_name": "wg"}),
        compiler_params=WARPGROUP_LOWERING,
        interpret=interpret,
    )
    weight = weight.reshape(columns, k)
    out = kernel(x8, x_scale_t, weight.T if interpret is not None else weight, column_scales(scale_inv, n))
    return out[:m].reshape(m, parts, n)
