"""Block-scaled fp8 matmul: activations times float8_e4m3fn weights whose scales come
one per block_k x block_n block (DeepSeek-V3's format, 128 x 128), as one Pallas
kernel lowered through Triton, and its jnp reference (same signature).

Layout (jaxmtp/models/linear.py puts every linear layer's weight in it):
  x          [M, K]               activations (float32, bfloat16 or float16)
  weight     [K, P, N]            float8_e4m3fn; P column groups of N (gate and up of a
                                  stacked MLP: P = 2; a plain matrix: P = 1)
  scale_inv  [ceil(K / block_k), P, ceil(N / block_n)]  float32; the weight is
                                  weight * scale_inv of its block, and the last block
                                  of each dimension may be partial
  -> [M, P, N] in out_dtype (default x.dtype), accumulated in float32

The kernel streams [block_k, block_n_tile] fp8 tiles of the weight (1 byte a weight:
decode reads half bf16's bytes), converts each to x's dtype in registers (exact: every
e4m3 value is a bfloat16, float16 and float32 value), multiplies with the x tile on the
tensor cores and applies the tile's per-column block scales to the float32 product
before accumulating, so a scale is applied exactly once per block and product. The K
step is block_k, so one row of scales serves a whole step. Edge tiles are masked
(rows past M, columns past N, the part of the last K block past K), so any shape runs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# `CompilerParams` since jax 0.6.2 (0.10 and 0.11 included); `TritonCompilerParams` before
_TritonCompilerParams = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams


@dataclasses.dataclass(frozen=True)
class Fp8MatmulConfig:
    """Static tiling of one call; `default_config` picks it from the shapes."""

    block_m: int  # x rows per program (16 at least: the MMA minimum)
    block_n: int  # output columns per program
    num_warps: int
    num_stages: int


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def default_config(m: int, n: int) -> Fp8MatmulConfig:
    """Decode and verify (few rows) want many programs streaming narrow column tiles,
    prefill wide tiles that reuse each weight tile over many rows (docs/kernels.md)."""
    block_m = min(max(_next_power_of_2(m), 16), 64)
    block_n = 32 if m <= 16 else 64
    # 4 stages at decode: the most frequent best of the 2026-12-01 H200 sweep over the
    # Llama-3-8B projections (docs/benchmarks/2026-12-01_H200_fp8_sweep.json)
    num_stages = 4 if m <= 16 else 3
    return Fp8MatmulConfig(block_m, min(block_n, max(16, _next_power_of_2(n))), num_warps=4, num_stages=num_stages)


def dequantize_blocks(weight: jax.Array, scale_inv: jax.Array, block: tuple[int, ...]) -> jax.Array:
    """weight * its blocks' scales in float32; block[i] is the block's size along axis
    i (1 for an axis every index of which has its own scale, such as P or experts)."""
    scale = scale_inv.astype(jnp.float32)
    for axis, size in enumerate(block):
        if size > 1:
            scale = jnp.repeat(scale, size, axis=axis)
    scale = scale[tuple(slice(0, n) for n in weight.shape)]
    return weight.astype(jnp.float32) * scale


def fp8_matmul_reference(x, weight, scale_inv, *, block_k: int, block_n: int, out_dtype=None) -> jax.Array:
    """Dequantize, then one float32 matmul (the engine's path off the GPU)."""
    w = dequantize_blocks(weight, scale_inv, (block_k, 1, block_n))
    out = jnp.einsum("mk,kpn->mpn", x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)
    return out.astype(out_dtype or x.dtype)


def _kernel(x_ref, w_ref, s_ref, o_ref, *, block_m, block_n, block_k, scale_block_n):
    row_block, part, col_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m, k = x_ref.shape
    n = w_ref.shape[-1]
    rows = row_block * block_m + jnp.arange(block_m, dtype=jnp.int32)
    cols = col_block * block_n + jnp.arange(block_n, dtype=jnp.int32)
    row_ok, col_ok = rows < m, cols < n
    scale_cols = lax.div(cols, scale_block_n)  # each column's block (non-negative: div, not //)
    # float32 inputs get true float32 products, not Triton's default tf32
    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

    def step(kb, acc):
        ks = kb * block_k + jnp.arange(block_k, dtype=jnp.int32)
        k_ok = ks < k
        x = plgpu.load(x_ref.at[rows[:, None], ks[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0)
        w = plgpu.load(w_ref.at[ks[:, None], part, cols[None, :]], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        scale = plgpu.load(s_ref.at[kb, part, scale_cols], mask=col_ok, other=0)
        return acc + plgpu.dot(x, w.astype(x.dtype), precision=precision) * scale[None, :]

    acc = lax.fori_loop(0, pl.cdiv(k, block_k), step, jnp.zeros((block_m, block_n), jnp.float32))
    plgpu.store(o_ref.at[rows[:, None], part, cols[None, :]], acc.astype(o_ref.dtype),
                mask=row_ok[:, None] & col_ok[None, :])


@functools.partial(jax.jit, static_argnames=("block_k", "block_n", "out_dtype", "interpret", "config"))
def fp8_matmul(
    x: jax.Array, weight: jax.Array, scale_inv: jax.Array, *, block_k: int, block_n: int, out_dtype=None,
    interpret: bool = False, config: Fp8MatmulConfig | None = None,
) -> jax.Array:
    """Pallas (Triton) block-scaled fp8 matmul; see the module docstring for the layout.
    block_k (the scales' K block, and the kernel's K step) must be a power of 2 >= 16."""
    m, k = x.shape
    _, parts, n = weight.shape
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"the fp8 kernel steps K by the scale block: block_k={block_k} must be a power of 2 >= 16")
    expected = (pl.cdiv(k, block_k), parts, pl.cdiv(n, block_n))
    if weight.shape[0] != k or scale_inv.shape != expected:
        raise ValueError(f"x {x.shape}, weight {weight.shape} and scale_inv {scale_inv.shape} do not fit "
                         f"(scale_inv should be {expected} for blocks of {block_k} x {block_n})")
    config = config or default_config(m, n)
    kernel = functools.partial(_kernel, block_m=config.block_m, block_n=config.block_n, block_k=block_k,
                               scale_block_n=block_n)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, config.block_m), parts, pl.cdiv(n, config.block_n)),
        out_shape=jax.ShapeDtypeStruct((m, parts, n), out_dtype or x.dtype),
        compiler_params=_TritonCompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="fp8_matmul",
    )(x, weight, scale_inv.astype(jnp.float32))
