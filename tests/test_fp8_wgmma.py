"""The Hopper fp8 x fp8 GEMM (jaxmtp/kernels/fp8_wgmma.py): Mosaic GPU's interpreter
on this CPU against the float64 product of the quantized rows and the dequantized
weight, the kernel lowered for the GPU (Mosaic GPU) at the engine's K-major layout, and
the measured table sending a row bucket to it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_fp8_matmul import make_case

from jaxmtp.kernels import fp8_matmul as kernel_module
from jaxmtp.kernels.fp8_matmul import (
    dequantize_blocks, fp8_matmul, fp8_matmul_measured, fp8_tiling, quantize_activations,
)
from jaxmtp.kernels.fp8_wgmma import WgmmaConfig, column_scales, fp8_wgmma_matmul


def interpreter():
    """Mosaic GPU's interpreter's parameters: exported by newer jax's plgpu, only in
    jax._src in jax 0.10."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    params = getattr(plgpu, "InterpretGPUParams", None)
    if params is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
    return params()


def quantized_rows_product(x, q, scale):
    """The float64 product the kernel computes: x rounded per row and 128-column block
    to e4m3 (quantize_activations) times the dequantized [K, P, N] weight, with the
    magnitude of each sum (for the float32 accumulation's bound)."""
    k = x.shape[1]
    x8, x_scale = quantize_activations(x, 128)
    rows = np.asarray(x8.astype(jnp.float32), np.float64) * np.repeat(np.asarray(x_scale, np.float64), 128, 1)[:, :k]
    w = np.asarray(dequantize_blocks(q, scale, (128, 1, 128)), np.float64)
    return (x8, x_scale), np.einsum("mk,kpn->mpn", rows, w), np.einsum("mk,kpn->mpn", np.abs(rows), np.abs(w))


# (M, K, P, N, config): rows padded to the tile and past one tile, two column groups,
# tiles of half a scale block and of a whole one, more K steps than the pipeline holds,
# one warpgroup and two
CASES = [(70, 256, 2, 128, WgmmaConfig(64, 128, 2)),
         (5, 384, 1, 256, WgmmaConfig(64, 64, 2)),
         (64, 128, 1, 128, WgmmaConfig(64, 128, 3)),
         (150, 256, 1, 128, WgmmaConfig(128, 128, 2))]  # two compute warpgroups fed by a memory one


@pytest.mark.parametrize("m, k, parts, n, config", CASES)
def test_the_interpreted_kernel_gives_the_float64_product_of_the_quantized_rows(rng, m, k, parts, n, config):
    """Each K step's product scaled by its row's and its columns' scales once, summed in
    float32: within float32 sums of k terms of the float64 product (e4m3 x e4m3 products
    are exact in float32). The interpreter's wgmma takes the weight [K, N] where the GPU's
    reads it K-major through a transposed view (the lowering test covers that view)."""
    x, q, scale = make_case(rng, m, k, parts, n, 128, 128, jnp.bfloat16)
    (x8, x_scale), exact, magnitude = quantized_rows_product(x, q, scale)
    got = np.asarray(fp8_wgmma_matmul(x8, x_scale, q.transpose(1, 2, 0), scale, config=config,
                                      out_dtype=jnp.float32, interpret=interpreter()))
    assert got.shape == (m, parts, n)
    assert np.all(np.abs(got - exact) <= 4 * k * np.finfo(np.float32).eps * magnitude)


def test_column_scales_give_each_column_its_blocks_scale(rng):
    scale = jnp.asarray(rng.uniform(0.5, 2.0, (3, 2, 2)), jnp.float32)
    got = np.asarray(column_scales(scale, 200))
    assert got.shape == (3, 400)
    np.testing.assert_array_equal(got[:, 127], scale[:, 0, 0])
    np.testing.assert_array_equal(got[:, 128], scale[:, 0, 1])
    np.testing.assert_array_equal(got[:, 200 + 130], scale[:, 1, 1])


@pytest.mark.parametrize("config", [WgmmaConfig(64, 128, 4), WgmmaConfig(64, 64, 2), WgmmaConfig(128, 128, 4)])
def test_the_kernel_lowers_for_the_gpu(config):
    """Mosaic GPU's lowering runs without a GPU: the wgmma operands' shapes, swizzles
    and register layouts (the scales' row and column vectors) are checked there."""
    x8 = jax.ShapeDtypeStruct((300, 512), jnp.float8_e4m3fn)
    x_scale = jax.ShapeDtypeStruct((300, 4), jnp.float32)
    weight = jax.ShapeDtypeStruct((2, 256, 512), jnp.float8_e4m3fn)
    scale = jax.ShapeDtypeStruct((4, 2, 2), jnp.float32)
    lowered = jax.jit(lambda *a: fp8_wgmma_matmul(*a, config=config)).trace(x8, x_scale, weight, scale)
    assert "mosaic_gpu" in lowered.lower(lowering_platforms=("cuda",)).as_text()


def test_shapes_the_kernel_cannot_tile_are_named():
    x8, x_scale = jnp.zeros((2, 200), jnp.float8_e4m3fn), jnp.zeros((2, 2), jnp.float32)
    with pytest.raises(ValueError, match="K a multiple of 128"):
        fp8_wgmma_matmul(x8, x_scale, jnp.zeros((1, 128, 200), jnp.float8_e4m3fn), jnp.zeros((2, 1, 1)))
    with pytest.raises(ValueError, match="do not fit"):
        fp8_wgmma_matmul(jnp.zeros((2, 256), jnp.float8_e4m3fn), x_scale[:, :1],
                         jnp.zeros((1, 128, 256), jnp.float8_e4m3fn), jnp.zeros((2, 1, 1)))
    with pytest.raises(ValueError, match="reads a K-major weight"):  # fp8_matmul at a Hopper tiling
        fp8_matmul(jnp.zeros((2, 256), jnp.bfloat16), jnp.zeros((256, 1, 128), jnp.float8_e4m3fn),
                   jnp.ones((2, 1, 1)), block_k=128, block_n=128, config=WgmmaConfig())


def test_the_measured_table_sends_a_bucket_to_the_hopper_kernel(monkeypatch, rng):
    """A {"wgmma": fields} entry of kernels/fp8_tilings.json: the K-major weight runs the
    Hopper kernel, a [K, P, N] one (which it cannot read) the dequantized dot."""
    k, parts, n = 256, 1, 128
    config = WgmmaConfig(64, 128, 2)
    monkeypatch.setitem(kernel_module.FP8_TILINGS, (k, parts, n, 128, 128), {64: config})
    assert fp8_tiling(40, (k, parts, n), (128, 128)) == config
    x, q, scale = make_case(rng, 40, k, parts, n, 128, 128, jnp.bfloat16)

    def program(weight, k_major):
        return str(jax.make_jaxpr(lambda x, w, s: fp8_matmul_measured(x, w, s, block_k=128, block_n=128,
                                                                      k_major=k_major))(x, weight, scale))

    assert "wgmma" in program(q.transpose(1, 2, 0), True)
    assert "wgmma" not in program(q, False)
