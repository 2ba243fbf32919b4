"""Weight-streaming matmul for few rows, as one Pallas kernel lowered through Triton:
activations times a weight in the activations' dtype (`dense_matmul`: bfloat16,
float16, float32) or in float8_e4m3fn with one scale per block_k x block_n block
(`fp8_matmul`: DeepSeek-V3's format, 128 x 128), each with its jnp reference.

Layout (jaxmtp/models/linear.py puts every linear layer's weight in it):
  x          [M, K]               activations (float32, bfloat16 or float16)
  weight     [K, P, N]            P column groups of N (gate and up of a stacked MLP:
                                  P = 2; a plain matrix: P = 1); dense: x's dtype
  scale_inv  [ceil(K / block_k), P, ceil(N / block_n)]  fp8 only, float32; the weight
                                  is weight * scale_inv of its block, and the last block
                                  of each dimension may be partial
  -> [M, P, N] in out_dtype (default x.dtype), accumulated in float32

Each program streams [block_k, block_n tile] weight tiles down K for one tile of rows
and columns: decode and verify (M <= 256) read every weight byte once, so the kernel is
a stream of the weight at the memory's rate when enough programs have loads in flight.
An fp8 tile is converted to x's dtype in registers (exact: every e4m3 value is a
bfloat16, float16 and float32 value), multiplied with the x tile on the tensor cores,
and its per-column block scales multiply the float32 product before it is accumulated,
so a scale is applied exactly once per block and product (the fp8 K step is the scale
block, so one row of scales serves a whole step). With `x_fp8` each K step's x tile is
quantized in registers to e4m3 per row, one float32 scale each (DeepSeek-V3's
activations, as `quantize_activations` gives them), and multiplied fp8 x fp8 on the
tensor cores, scaled by its row and column scales into the float32 accumulator: the
e4m3 rounding of x (relative 2**-4 at most) buys fp8 operands in every register and
shared-memory tile, and no pass over x before the call.
Where N / block_n leaves too few programs for the GPU (narrow projections), `split_k`
programs share a column tile, each over its own run of K steps, and their float32
partials are summed after the call. Edge tiles are masked (rows past M, columns past N,
the part of the last K step past K), and masks are left out where the shapes divide the
tiles, so any shape runs.

On the GPU the engine calls `fp8_matmul_measured`: per weight shape, scale block and
row bucket, the tiling that benchmarks/fp8_sweep.py measured fastest (kernels/
fp8_tilings.json), or XLA's dot of the weight dequantized to x's dtype where that beat
every tiling (`fp8_matmul_dequantized`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxmtp.kernels.fp8_wgmma import WgmmaConfig, fp8_wgmma_matmul
from jaxmtp.kernels.tiling_table import bucket_at_or_above, read_tilings, row_bucket

# `CompilerParams` since jax 0.6.2 (0.10 and 0.11 included); `TritonCompilerParams` before
_TritonCompilerParams = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Static tiling of one call; `default_config` picks it from the shapes."""

    block_m: int  # x rows per program: 16 or more, MMA tiles; 1 to 8, products on the vector units
    block_n: int  # output columns per program
    num_warps: int
    num_stages: int
    block_k: int = 128  # the dense kernel's K step (the fp8 kernel steps by its scale block)
    split_k: int = 1  # programs per column tile, each over a run of K steps (float32 partials)
    x_fp8: bool = False  # the fp8 kernel in MMA tiles: each x tile quantized to e4m3 per row


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def default_config(m: int, n: int) -> MatmulConfig:
    """Decode and verify (few rows) want many programs streaming narrow column tiles,
    prefill wide tiles that reuse each weight tile over many rows (docs/kernels.md)."""
    block_m = min(max(_next_power_of_2(m), 16), 64)
    block_n = 32 if m <= 16 else 64
    # 4 stages at decode: the most frequent best of the 2026-12-01 H200 sweep over the
    # Llama-3-8B projections (docs/benchmarks/2026-12-01_H200_fp8_sweep.json)
    num_stages = 4 if m <= 16 else 3
    return MatmulConfig(block_m, min(block_n, max(16, _next_power_of_2(n))), num_warps=4, num_stages=num_stages)


# The dense kernel's tiling where it beat XLA's dot in the 2026-12-02 H200 sweep
# (docs/benchmarks/2026-12-02_H200_dense_gemm_sweep.md: bfloat16, kernel time with the
# split-K sum, by at least 5% and past the spread of the sweep's best tilings), by the
# weight's (K, P, N) and the rows rounded up to a power of 2 (16 at least); every other
# shape and row count is XLA's. Llama-3-8B's down projection, and its q, k and v merged
# into one weight (qkv_layout.with_merged_qkv: the shape "q, k, v merged" of the sweep, the
# dot XLA made of the three). The kernel also beat XLA's isolated dot at 4096 x 4096
# (o_proj) from 64 rows, but not XLA's o_proj inside the step (its profile), so that
# shape stays XLA's.
DENSE_TILINGS = {
    (14336, 1, 4096): {64: MatmulConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, block_k=256, split_k=2)},
    (4096, 1, 6144): {
        32: MatmulConfig(block_m=32, block_n=64, num_warps=4, num_stages=4, block_k=256, split_k=1),
        64: MatmulConfig(block_m=64, block_n=64, num_warps=4, num_stages=4, block_k=128, split_k=1),
        128: MatmulConfig(block_m=64, block_n=128, num_warps=4, num_stages=4, block_k=128, split_k=1),
        256: MatmulConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, block_k=128, split_k=1),
    },
}


def dense_tiling(m: int, weight_shape: tuple[int, int, int], dtype) -> MatmulConfig | None:
    """The measured tiling for m rows times a [K, P, N] weight in dtype, or None where
    XLA's dot was as fast (the table holds bfloat16 measurements only)."""
    if jnp.dtype(dtype) != jnp.bfloat16:
        return None
    return DENSE_TILINGS.get(tuple(weight_shape), {}).get(max(16, row_bucket(m)))


# fp8_tilings.json, as benchmarks/fp8_sweep.py writes it: (K, P, N, block_k, block_n) ->
# {row bucket: the tiling measured fastest (this kernel's, or {"wgmma": fields} for the
# Hopper kernel of fp8_wgmma.py), or "dequantize" where XLA's dot of the dequantized
# weight beat every tiling}
FP8_TILINGS = read_tilings("fp8_tilings.json", MatmulConfig, kernels={"wgmma": WgmmaConfig})


def fp8_tiling(m: int, weight_shape: tuple[int, int, int], block: tuple[int, int]) -> MatmulConfig | WgmmaConfig | str:
    """For m rows times a [K, P, N] fp8 weight with block_k x block_n scales: the entry of
    the smallest measured row bucket at or above m's (the largest past them all), or
    default_config for a weight the table has not measured."""
    buckets = FP8_TILINGS.get((*weight_shape, *block))
    if not buckets:
        return default_config(m, weight_shape[-1])
    bucket = bucket_at_or_above(buckets, m)
    return buckets[max(buckets) if bucket is None else bucket]


def dequantize_blocks(weight: jax.Array, scale_inv: jax.Array, block: tuple[int, ...]) -> jax.Array:
    """weight * its blocks' scales in float32; block[i] is the block's size along axis
    i (1 for an axis every index of which has its own scale, such as P or experts)."""
    scale = scale_inv.astype(jnp.float32)
    for axis, size in enumerate(block):
        if size > 1:
            scale = jnp.repeat(scale, size, axis=axis)
    scale = scale[tuple(slice(0, n) for n in weight.shape)]
    return weight.astype(jnp.float32) * scale


def fp8_matmul_dequantized(x, weight, scale_inv, *, block_k: int, block_n: int, out_dtype=None,
                           k_major: bool = False) -> jax.Array:
    """XLA's dot of x and the weight dequantized to x's dtype (one rounding of each
    weight * scale), accumulated in float32: the GPU's path where the table measured it
    faster than every tiling of the kernel. k_major: the weight is [P, N, K]."""
    weight = jnp.moveaxis(weight, -1, 0) if k_major else weight
    w = dequantize_blocks(weight, scale_inv, (block_k, 1, block_n)).astype(x.dtype)
    out = jnp.einsum("mk,kpn->mpn", x, w, preferred_element_type=jnp.float32)
    return out.astype(out_dtype or x.dtype)


def dense_matmul_reference(x, weight, *, out_dtype=None) -> jax.Array:
    """One float32 matmul of [M, K] by [K, P, N]."""
    out = jnp.einsum("mk,kpn->mpn", x.astype(jnp.float32), weight.astype(jnp.float32),
                     precision=lax.Precision.HIGHEST)
    return out.astype(out_dtype or x.dtype)


def fp8_matmul_reference(x, weight, scale_inv, *, block_k: int, block_n: int, out_dtype=None) -> jax.Array:
    """Dequantize, then one float32 matmul (the engine's path off the GPU)."""
    return dense_matmul_reference(x, dequantize_blocks(weight, scale_inv, (block_k, 1, block_n)), out_dtype=out_dtype)


def is_k_step(block_k: int) -> bool:
    """Whether the kernel can step K by block_k: a power of 2, 16 at least (the MMA's K)."""
    return block_k >= 16 and not block_k & (block_k - 1)


MMA_ROWS = 16  # the smallest row tile of Triton's MMA; fewer rows multiply on the vector units
E4M3_MAX = 448.0  # the largest float8_e4m3fn value


def e4m3_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., B] as float8_e4m3fn with one float32 scale per row of B values (the row's
    largest magnitude maps to 448): the kernel's x_fp8 tiles and quantize_activations."""
    x = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.abs(x).max(axis=-1), jnp.finfo(jnp.float32).tiny) / E4M3_MAX
    return (x / scale[..., None]).astype(jnp.float8_e4m3fn), scale


def quantize_activations(x: jax.Array, block_k: int) -> tuple[jax.Array, jax.Array]:
    """x [M, K] as float8_e4m3fn with one float32 scale per row and block of block_k
    columns ([M, ceil(K / block_k)]), the activations of DeepSeek-V3's fp8 GEMMs; x8 *
    scale is x to e4m3's precision."""
    m, k = x.shape
    blocks = pl.cdiv(k, block_k)
    x8, scale = e4m3_rows(jnp.pad(x, ((0, 0), (0, blocks * block_k - k))).reshape(m, blocks, block_k))
    return x8.reshape(m, blocks * block_k)[:, :k], scale


# bfloat16 activations times an fp8 weight in MMA tiles run as float16 x float16
# products: e4m3 to float16 is one hardware conversion for two values, e4m3 to bfloat16
# a run of integer operations that made the kernel compute-bound at the bf16 kernel's
# speed (2026-12-03 H200 sweep). x enters float16 times 2**-F16_SHIFT (the block scales
# carry 2**F16_SHIFT back, both exact): every bfloat16 x of magnitude 2**-8 to 2**24 is
# a float16 value after the shift, so the products are the bfloat16 ones; smaller magnitudes round to
# float16's subnormal step (2**-24, an absolute error of at most 2**-17 in x), larger
# ones overflow.
F16_SHIFT = 8


def _outer_mask(rows_ok, cols_ok):
    """rows_ok[:, None] & cols_ok[None, :], where None stands for a mask that is
    statically all true (the shape divides the tile)."""
    if rows_ok is None and cols_ok is None:
        return None
    if cols_ok is None:
        return rows_ok[:, None]
    if rows_ok is None:
        return cols_ok[None, :]
    return rows_ok[:, None] & cols_ok[None, :]


def _kernel(x_ref, w_ref, *refs, block_m, block_n, block_k, k_steps, scale_block_n, f16_shift, k_major, x_fp8):
    """One [block_m, block_n] tile of one column group over k_steps K steps (the
    program's run of K); refs are (scale_inv, out) for an fp8 weight, (out,) else.
    out is [split_k, M, P, N]: each run of K writes its own partial."""
    s_ref, o_ref = refs if scale_block_n else (None, *refs)
    row_block, part, col_block, split = (pl.program_id(axis) for axis in range(4))
    m, k = x_ref.shape
    n = w_ref.shape[1 if k_major else -1]
    rows = row_block * block_m + jnp.arange(block_m, dtype=jnp.int32)
    cols = col_block * block_n + jnp.arange(block_n, dtype=jnp.int32)
    row_ok = None if m % block_m == 0 else rows < m
    col_ok = None if n % block_n == 0 else cols < n
    first_step = split * k_steps
    vector = block_m < MMA_ROWS
    # float32 inputs get true float32 products, not Triton's default tf32
    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

    def step(i, acc):
        kb = first_step + i
        ks = kb * block_k + jnp.arange(block_k, dtype=jnp.int32)
        k_ok = None if k % block_k == 0 else ks < k
        x_mask, w_mask = _outer_mask(row_ok, k_ok), _outer_mask(k_ok, col_ok)
        x = plgpu.load(x_ref.at[rows[:, None], ks[None, :]], mask=x_mask, other=None if x_mask is None else 0)
        if k_major:  # [P, N, K]: a K-contiguous tile, transposed in registers
            w_mask = _outer_mask(col_ok, k_ok)
            w = plgpu.load(w_ref.at[part, cols[:, None], ks[None, :]], mask=w_mask,
                           other=None if w_mask is None else 0.0).T
        else:
            w = plgpu.load(w_ref.at[ks[:, None], part, cols[None, :]], mask=w_mask,
                           other=None if w_mask is None else 0.0)
        scale = None if s_ref is None else plgpu.load(
            s_ref.at[kb, part, lax.div(cols, scale_block_n)], mask=col_ok, other=None if col_ok is None else 0)
        if x_fp8:  # fp8 x fp8 on the tensor cores, both scales on the float32 product
            x8, x_scale = e4m3_rows(x)  # the rows past M and the columns past K are zeros
            return acc + plgpu.dot(x8, w) * x_scale[:, None] * scale[None, :]
        if vector:  # float32 products on the vector units, summed over K after the loop
            if w.dtype == jnp.float8_e4m3fn:
                w = w.astype(jnp.float16)  # exact, and one hardware conversion for two values
            w = w.astype(jnp.float32) if scale is None else w.astype(jnp.float32) * scale[None, :]
            return acc + x.astype(jnp.float32)[:, :, None] * w[None]
        if f16_shift:
            x = (x.astype(jnp.float32) * 2.0**-f16_shift).astype(jnp.float16)
        product = plgpu.dot(x, w.astype(x.dtype), precision=precision)
        if scale is not None:
            product = product * (scale * 2.0**f16_shift)[None, :]
        return acc + product

    acc_shape = (block_m, block_k, block_n) if vector else (block_m, block_n)
    acc = lax.fori_loop(0, k_steps, step, jnp.zeros(acc_shape, jnp.float32))
    if vector:
        acc = acc.sum(axis=1)
    out_mask = _outer_mask(row_ok, col_ok)
    plgpu.store(o_ref.at[split, rows[:, None], part, cols[None, :]], acc.astype(o_ref.dtype), mask=out_mask)


def _streaming_matmul(x, weight, scale_inv, *, block_k, scale_block_n, out_dtype, interpret, config, name,
                      k_major=False):
    """The kernel over the grid (row tiles, P, column tiles, K runs); the K runs'
    float32 partials summed after it when there are several."""
    m, k = x.shape
    parts, n = weight.shape[:2] if k_major else weight.shape[1:]
    total_steps = pl.cdiv(k, block_k)
    if total_steps % config.split_k:
        raise ValueError(f"split_k={config.split_k} does not divide the {total_steps} K steps of {block_k}")
    k_steps = total_steps // config.split_k
    out_dtype = out_dtype or x.dtype
    if config.x_fp8 and (scale_inv is None or config.block_m < MMA_ROWS):
        raise ValueError(f"x_fp8 is the fp8 kernel's in MMA tiles (block_m >= {MMA_ROWS}): {config}")
    # bfloat16 x times an fp8 weight in MMA tiles multiply in float16 (see F16_SHIFT)
    f16_shift = F16_SHIFT if (scale_block_n and x.dtype == jnp.bfloat16 and config.block_m >= MMA_ROWS
                              and not config.x_fp8) else 0
    kernel = functools.partial(_kernel, block_m=config.block_m, block_n=config.block_n, block_k=block_k,
                               k_steps=k_steps, scale_block_n=scale_block_n, f16_shift=f16_shift, k_major=k_major,
                               x_fp8=config.x_fp8)
    operands = (x, weight) if scale_inv is None else (x, weight, scale_inv.astype(jnp.float32))
    partial_dtype = out_dtype if config.split_k == 1 else jnp.float32
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, config.block_m), parts, pl.cdiv(n, config.block_n), config.split_k),
        out_shape=jax.ShapeDtypeStruct((config.split_k, m, parts, n), partial_dtype),
        compiler_params=_TritonCompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name=name,
    )(*operands)
    return out[0] if config.split_k == 1 else out.sum(axis=0).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("block_k", "block_n", "out_dtype", "interpret", "config", "k_major"))
def fp8_matmul(
    x: jax.Array, weight: jax.Array, scale_inv: jax.Array, *, block_k: int, block_n: int, out_dtype=None,
    interpret: bool = False, config: MatmulConfig | WgmmaConfig | None = None, k_major: bool = False,
) -> jax.Array:
    """Pallas (Triton) block-scaled fp8 matmul; see the module docstring for the layout.
    block_k (the scales' K block, and the kernel's K step) must be a power of 2 >= 16;
    config.block_k is not used. k_major: the weight is [P, N, K]. A WgmmaConfig runs the
    Hopper kernel of fp8_wgmma.py instead (a K-major weight; x quantized before it)."""
    m, k = x.shape
    parts, n = weight.shape[:2] if k_major else weight.shape[1:]
    if not is_k_step(block_k):
        raise ValueError(f"the fp8 kernel steps K by the scale block: block_k={block_k} must be a power of 2 >= 16")
    expected = (pl.cdiv(k, block_k), parts, pl.cdiv(n, block_n))
    if weight.shape[-1 if k_major else 0] != k or scale_inv.shape != expected:
        raise ValueError(f"x {x.shape}, weight {weight.shape} and scale_inv {scale_inv.shape} do not fit "
                         f"(scale_inv should be {expected} for blocks of {block_k} x {block_n})")
    if isinstance(config, WgmmaConfig):
        if not k_major or interpret:
            raise ValueError(f"{config} (the Hopper kernel) reads a K-major weight and has no Triton interpreter "
                             f"(k_major={k_major}, interpret={interpret})")
        return fp8_wgmma_matmul(*quantize_activations(x, block_k), weight, scale_inv, config=config,
                                out_dtype=out_dtype or x.dtype)
    return _streaming_matmul(x, weight, scale_inv, block_k=block_k, scale_block_n=block_n, out_dtype=out_dtype,
                             interpret=interpret, config=config or default_config(m, n), name="fp8_matmul",
                             k_major=k_major)


def fp8_matmul_measured(x: jax.Array, weight: jax.Array, scale_inv: jax.Array, *, block_k: int, block_n: int,
                        out_dtype=None, interpret: bool = False, k_major: bool = False) -> jax.Array:
    """The engine's fp8 matmul on the GPU: the kernel at fp8_tiling's tiling, the Hopper
    kernel (fp8_wgmma.py) or the dequantized dot where the table names them. k_major:
    the weight is [P, N, K]."""
    shape = (weight.shape[-1], *weight.shape[:-1]) if k_major else weight.shape
    tiling = fp8_tiling(x.shape[0], shape, (block_k, block_n))
    blocks = dict(block_k=block_k, block_n=block_n, out_dtype=out_dtype, k_major=k_major)
    if tiling == "dequantize" or (isinstance(tiling, WgmmaConfig) and not k_major):  # a Hopper entry, [K, P, N]
        return fp8_matmul_dequantized(x, weight, scale_inv, **blocks)
    return fp8_matmul(x, weight, scale_inv, **blocks, interpret=interpret, config=tiling)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "config"))
def dense_matmul(x: jax.Array, weight: jax.Array, *, out_dtype=None, interpret: bool = False,
                 config: MatmulConfig | None = None) -> jax.Array:
    """Pallas (Triton) matmul of x [M, K] by a weight [K, P, N] in x's dtype; see the
    module docstring. config.block_k (the K step) must be a power of 2 >= 16."""
    m, k = x.shape
    config = config or default_config(m, weight.shape[-1])
    if weight.shape[0] != k or weight.dtype != x.dtype:
        raise ValueError(f"x {x.shape} {x.dtype} and weight {weight.shape} {weight.dtype} do not fit")
    if not is_k_step(config.block_k):
        raise ValueError(f"block_k={config.block_k} must be a power of 2 >= 16")
    return _streaming_matmul(x, weight, None, block_k=config.block_k, scale_block_n=None, out_dtype=out_dtype,
                             interpret=interpret, config=config, name="dense_matmul")
