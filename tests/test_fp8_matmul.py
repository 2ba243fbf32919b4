"""The block-scaled fp8 matmul (jaxmtp/kernels/fp8_matmul.py): the Pallas kernel in
interpret mode against the jnp reference on shapes whose edge blocks are partial, the
reference against a float64 NumPy product, and the kernel lowered for the GPU
(Triton) from this CPU machine, which catches what interpret mode does not check."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp.kernels import fp8_matmul as kernel_module
from jaxmtp.kernels.fp8_matmul import (
    F16_SHIFT, MatmulConfig, default_config, dequantize_blocks, fp8_matmul, fp8_matmul_dequantized,
    fp8_matmul_measured, fp8_matmul_reference, fp8_tiling, quantize_activations,
)

E4M3_MAX = 448.0


def make_case(rng, m, k, parts, n, block_k, block_n, dtype):
    """x, and an fp8 weight [K, P, N] quantized per block from a float64 matrix whose
    blocks differ in scale by up to 2^6 (so a scale applied to the wrong block shows)."""
    blocks = (math.ceil(k / block_k), parts, math.ceil(n / block_n))
    spread = 2.0 ** rng.uniform(-3, 3, blocks)
    w = rng.standard_normal((k, parts, n)) * np.repeat(np.repeat(spread, block_k, 0)[:k], block_n, 2)[:, :, :n]
    amax = np.zeros(blocks)
    for i in range(blocks[0]):
        for j in range(blocks[2]):
            amax[i, :, j] = np.abs(w[i * block_k:(i + 1) * block_k, :, j * block_n:(j + 1) * block_n]).max(axis=(0, 2))
    scale = (amax / E4M3_MAX).astype(np.float32)
    expanded = np.repeat(np.repeat(scale, block_k, 0)[:k], block_n, 2)[:, :, :n]
    q = jnp.asarray(w / expanded, jnp.float8_e4m3fn)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    return x, q, jnp.asarray(scale)


def float64_product(x, q, scale, block_k, block_n):
    k, _, n = q.shape
    w = np.asarray(q.astype(jnp.float32), np.float64)
    w = w * np.repeat(np.repeat(np.asarray(scale, np.float64), block_k, 0)[:k], block_n, 2)[:, :, :n]
    return np.einsum("mk,kpn->mpn", np.asarray(x.astype(jnp.float32), np.float64), w)


# (M, K, P, N, block_k, block_n, dtype): partial last blocks along K and N, one row
# (decode), rows past one tile, gate/up-style column groups, blocks smaller than the
# kernel's tiles and a block_n that is no power of 2, in each activation dtype
CASES = [
    (1, 300, 1, 200, 128, 128, jnp.bfloat16),
    (5, 128, 2, 130, 128, 128, jnp.float32),
    (37, 77, 1, 64, 128, 128, jnp.float16),
    (70, 260, 2, 96, 128, 128, jnp.bfloat16),
    (3, 200, 1, 150, 64, 96, jnp.float32),
    (17, 48, 3, 40, 16, 16, jnp.bfloat16),
]


# the same cases on the vector units (row tiles below the MMA's 16), one and several row tiles
VECTOR_CASES = [(1, 300, 1, 200, 128, 128, jnp.bfloat16, MatmulConfig(1, 64, 4, 3, split_k=3)),
                (5, 128, 2, 130, 128, 128, jnp.float32, MatmulConfig(4, 32, 4, 3)),
                (3, 200, 1, 150, 64, 96, jnp.bfloat16, MatmulConfig(2, 32, 4, 3, split_k=2))]


@pytest.mark.parametrize("m, k, parts, n, block_k, block_n, dtype, config",
                         [(*case, None) for case in CASES] + VECTOR_CASES)
def test_kernel_in_interpret_mode_matches_the_reference(rng, m, k, parts, n, block_k, block_n, dtype, config):
    x, q, scale = make_case(rng, m, k, parts, n, block_k, block_n, dtype)
    blocks = dict(block_k=block_k, block_n=block_n, config=config)
    reference = np.asarray(fp8_matmul_reference(x, q, scale, block_k=block_k, block_n=block_n, out_dtype=jnp.float32))
    got = np.asarray(fp8_matmul(x, q, scale, **blocks, out_dtype=jnp.float32, interpret=True))
    exact = float64_product(x, q, scale, block_k, block_n)
    # Every product is exact in float32 (e4m3 and the inputs have few mantissa bits;
    # float32 x is multiplied at full precision), so the reference and the kernel differ
    # from the float64 product only by float32 sums of k terms, in their own order.
    magnitude = float64_product(jnp.abs(x.astype(jnp.float32)), jnp.abs(q.astype(jnp.float32)), scale, block_k, block_n)
    bound = 4 * k * np.finfo(np.float32).eps * magnitude.max()
    assert np.abs(reference - exact).max() <= bound
    assert np.abs(got - exact).max() <= bound
    # in x's dtype, each result is the float32 one rounded once
    rounded = np.asarray(fp8_matmul(x, q, scale, **blocks, interpret=True))
    assert rounded.dtype == np.dtype(dtype)
    ulp = np.abs(got) * float(jnp.finfo(dtype).eps) + float(jnp.finfo(dtype).tiny)
    assert (np.abs(rounded.astype(np.float64) - got) <= ulp + bound).all()


@pytest.mark.parametrize("m, k, parts, n, block_k, block_n, dtype, k_major", [
    (70, 260, 2, 96, 128, 128, jnp.bfloat16, False),
    (37, 77, 1, 64, 128, 128, jnp.float16, True),
    (17, 48, 3, 40, 16, 16, jnp.float32, True),
])
def test_fp8_x_multiplies_the_rows_quantized_per_k_block_by_both_scales(rng, m, k, parts, n, block_k, block_n,
                                                                        dtype, k_major):
    """x_fp8: x rounded to e4m3 per row and K block (each element within e4m3's half
    step of x: 2**-4 relative, or 2**-10 of its block's scale below e4m3's normal
    range), then the kernel's sums are the float64 product of those rows within float32
    sums of k terms (e4m3 x e4m3 products are exact in float32); partial edge blocks,
    several row tiles, the weight [K, P, N] and [P, N, K]."""
    x, q, scale = make_case(rng, m, k, parts, n, block_k, block_n, dtype)
    x8, x_scale = quantize_activations(x, block_k)
    assert x8.dtype == jnp.float8_e4m3fn and x_scale.shape == (m, math.ceil(k / block_k))
    per_element = np.repeat(np.asarray(x_scale, np.float64), block_k, 1)[:, :k]
    x_rounded = np.asarray(x8.astype(jnp.float32), np.float64) * per_element
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    assert np.all(np.abs(x_rounded - x64) <= 2.0**-4 * np.abs(x64) + 2.0**-10 * per_element)
    assert np.abs(x8.astype(jnp.float32)).max() == 448.0  # each block's largest magnitude maps to e4m3's largest
    config = MatmulConfig(16, 32, 4, 3, x_fp8=True)
    weight = q.transpose(1, 2, 0) if k_major else q
    got = np.asarray(fp8_matmul(x, weight, scale, block_k=block_k, block_n=block_n, out_dtype=jnp.float32,
                                interpret=True, config=config, k_major=k_major))
    w = np.asarray(dequantize_blocks(q, scale, (block_k, 1, block_n)), np.float64)
    exact = np.einsum("mk,kpn->mpn", x_rounded, w)
    magnitude = np.einsum("mk,kpn->mpn", np.abs(x_rounded), np.abs(w))
    assert np.all(np.abs(got - exact) <= 4 * k * np.finfo(np.float32).eps * magnitude)
    with pytest.raises(ValueError, match="x_fp8 is the fp8 kernel's in MMA tiles"):
        fp8_matmul(x, q, scale, block_k=block_k, block_n=block_n, interpret=True,
                   config=MatmulConfig(4, 32, 4, 3, x_fp8=True))


def signed_powers(rng, shape, low, high):
    """bfloat16 values of random sign with magnitudes 2**uniform(low, high)."""
    return jnp.asarray(rng.choice([-1.0, 1.0], shape) * 2.0 ** rng.uniform(low, high, shape), jnp.bfloat16)


def test_bfloat16_x_keeps_exact_products_over_the_float16_range(rng):
    """bfloat16 x of magnitudes 2**-9 to 2**24 (the kernel multiplies them in float16
    after a shift of 2**-F16_SHIFT): every product stays exact, so the result is the
    float64 product within float32 sums of k terms, as for the reference."""
    k, n = 256, 64
    _, q, scale = make_case(rng, 1, k, 1, n, 128, 32, jnp.bfloat16)
    # one row at each edge of the range (each row's bound scales with its own magnitude), one across it
    x = jnp.concatenate([signed_powers(rng, (1, k), -9, -8), signed_powers(rng, (1, k), 23, 23.99),
                         signed_powers(rng, (1, k), -9, 23.99)])
    got = np.asarray(fp8_matmul(x, q, scale, block_k=128, block_n=32, out_dtype=jnp.float32, interpret=True))
    exact = float64_product(x, q, scale, 128, 32)
    magnitude = float64_product(jnp.abs(x.astype(jnp.float32)), jnp.abs(q.astype(jnp.float32)), scale, 128, 32)
    assert np.all(np.abs(got - exact) <= 4 * k * np.finfo(np.float32).eps * magnitude)


def test_bfloat16_x_below_the_float16_range_rounds_to_its_subnormal_step(rng):
    """Magnitudes 2**-30 to 2**-9: after the shift each x is within float16's subnormal
    step 2**-24 of itself, i.e. 2**(F16_SHIFT - 25) before it: the documented bound."""
    k, n = 256, 64
    _, q, scale = make_case(rng, 1, k, 1, n, 128, 32, jnp.bfloat16)
    x = signed_powers(rng, (3, k), -30, -9)
    got = np.asarray(fp8_matmul(x, q, scale, block_k=128, block_n=32, out_dtype=jnp.float32, interpret=True))
    exact = float64_product(x, q, scale, 128, 32)
    weight_sums = float64_product(jnp.ones((1, k), jnp.float32), jnp.abs(q.astype(jnp.float32)), scale, 128, 32)
    magnitude = float64_product(jnp.abs(x.astype(jnp.float32)), jnp.abs(q.astype(jnp.float32)), scale, 128, 32)
    bound = 2.0 ** (F16_SHIFT - 25) * weight_sums + 4 * k * np.finfo(np.float32).eps * magnitude
    assert np.all(np.abs(got - exact) <= bound)


def test_split_k_sums_each_block_once(rng):
    """Five K blocks over five programs per column tile (float32 partials summed after
    the call), the last block partial: within the bound above of the float64 product."""
    m, k, parts, n, block_k, block_n = 9, 300, 2, 70, 64, 32
    x, q, scale = make_case(rng, m, k, parts, n, block_k, block_n, jnp.bfloat16)
    config = MatmulConfig(block_m=16, block_n=32, num_warps=4, num_stages=3, split_k=5)
    got = np.asarray(fp8_matmul(x, q, scale, block_k=block_k, block_n=block_n, out_dtype=jnp.float32,
                                interpret=True, config=config))
    exact = float64_product(x, q, scale, block_k, block_n)
    magnitude = float64_product(jnp.abs(x.astype(jnp.float32)), jnp.abs(q.astype(jnp.float32)), scale, block_k, block_n)
    assert np.abs(got - exact).max() <= 4 * k * np.finfo(np.float32).eps * magnitude.max()


def test_a_wrong_block_scale_shows(rng):
    """The guard behind the tests above: scales of one block moved to its neighbour
    change the result far beyond their bound."""
    x, q, scale = make_case(rng, 4, 300, 1, 200, 128, 128, jnp.float32)
    shifted = jnp.roll(scale, 1, axis=0)
    exact = float64_product(x, q, scale, 128, 128)
    got = np.asarray(fp8_matmul(x, q, shifted, block_k=128, block_n=128, out_dtype=jnp.float32, interpret=True))
    assert np.abs(got - exact).max() > 1e-2 * np.abs(exact).max()


def test_dequantize_blocks_scales_each_block_of_stacked_and_expert_weights(rng):
    """Experts [E, K, 2, N] with blocks (1, 16, 1, 8): every (expert, part) has scales
    of its own, and edge blocks along K and N are partial."""
    e, k, n, bk, bn = 3, 40, 20, 16, 8
    q = jnp.asarray(rng.standard_normal((e, k, 2, n)), jnp.float8_e4m3fn)
    scale = rng.uniform(0.5, 2, (e, math.ceil(k / bk), 2, math.ceil(n / bn))).astype(np.float32)
    got = np.asarray(dequantize_blocks(q, jnp.asarray(scale), (1, bk, 1, bn)))
    expected = np.asarray(q.astype(jnp.float32)).copy()
    for i in range(k):
        for j in range(n):
            expected[:, i, :, j] *= scale[:, i // bk, :, j // bn]
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("dtype, m, config", [(jnp.bfloat16, 1, None), (jnp.bfloat16, 300, None),
                                              (jnp.float32, 40, None), (jnp.float16, 16, None),
                                              (jnp.bfloat16, 3, MatmulConfig(4, 64, 4, 3, split_k=3)),
                                              (jnp.bfloat16, 300, MatmulConfig(64, 64, 8, 3, x_fp8=True))])
def test_kernel_lowers_for_the_gpu(dtype, m, config):
    """The Triton lowering runs without a GPU: it rejects what Triton cannot express
    (a masked fp8 load's fill value once failed there and nowhere else)."""
    x = jax.ShapeDtypeStruct((m, 300), dtype)
    q = jax.ShapeDtypeStruct((300, 2, 200), jnp.float8_e4m3fn)
    scale = jax.ShapeDtypeStruct((3, 2, 2), jnp.float32)
    lowered = jax.jit(lambda x, q, s: fp8_matmul(x, q, s, block_k=128, block_n=128, config=config)).trace(x, q, scale)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text


def test_bad_shapes_and_blocks_are_named():
    x = jnp.zeros((2, 300), jnp.bfloat16)
    q = jnp.zeros((300, 1, 200), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scale_inv should be \(3, 1, 2\)"):
        fp8_matmul(x, q, jnp.zeros((2, 1, 2)), block_k=128, block_n=128, interpret=True)
    with pytest.raises(ValueError, match="block_k=96 must be a power of 2"):
        fp8_matmul(x, q, jnp.zeros((4, 1, 2)), block_k=96, block_n=128, interpret=True)
    config = MatmulConfig(block_m=16, block_n=32, num_warps=4, num_stages=2)
    out = fp8_matmul(x, q, jnp.ones((3, 1, 2)), block_k=128, block_n=128, interpret=True, config=config)
    assert out.shape == (2, 1, 200) and not np.asarray(out).any()


def test_the_dequantized_dot_rounds_each_weight_once(rng):
    """The GPU's other path: the weight dequantized to x's dtype (bfloat16: each
    weight * scale rounded once, relative 2**-9), then one float32-accumulated dot."""
    m, k, parts, n = 3, 300, 2, 200
    x, q, scale = make_case(rng, m, k, parts, n, 128, 128, jnp.bfloat16)
    got = np.asarray(fp8_matmul_dequantized(x, q, scale, block_k=128, block_n=128, out_dtype=jnp.float32))
    exact = float64_product(x, q, scale, 128, 128)
    magnitude = float64_product(jnp.abs(x.astype(jnp.float32)), jnp.abs(q.astype(jnp.float32)), scale, 128, 128)
    assert np.all(np.abs(got - exact) <= (2.0**-9 + 4 * k * np.finfo(np.float32).eps) * magnitude)


def test_the_measured_table_picks_the_path_per_row_bucket(monkeypatch, rng):
    """kernels/fp8_tilings.json as the engine reads it: a row count takes the smallest
    measured bucket at or above its own (the largest past them all), "dequantize" sends
    the call to the dequantized dot, an unmeasured weight keeps default_config."""
    k, parts, n, block = 48, 1, 40, (16, 32)
    small = MatmulConfig(block_m=16, block_n=32, num_warps=4, num_stages=2, split_k=3)
    large = MatmulConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    monkeypatch.setitem(kernel_module.FP8_TILINGS, (k, parts, n, *block), {16: small, 64: "dequantize", 128: large})
    assert [fp8_tiling(m, (k, parts, n), block) for m in (1, 16, 17, 64, 65, 1000)] == [
        small, small, "dequantize", "dequantize", large, large]
    assert fp8_tiling(5, (k, parts, 2 * n), block) == default_config(5, 2 * n)
    x, q, scale = make_case(rng, 70, k, parts, n, *block, jnp.bfloat16)

    def runs_the_kernel(rows):
        call = functools.partial(fp8_matmul_measured, block_k=block[0], block_n=block[1], interpret=True)
        return "pallas_call" in str(jax.make_jaxpr(call)(x[:rows], q, scale))

    assert runs_the_kernel(1) and not runs_the_kernel(40) and runs_the_kernel(70)
    got = fp8_matmul_measured(x[:40], q, scale, block_k=16, block_n=32)
    np.testing.assert_array_equal(got, fp8_matmul_dequantized(x[:40], q, scale, block_k=16, block_n=32))


@pytest.mark.parametrize("m, k, parts, n, block_k, block_n, dtype, config", [
    (1, 300, 1, 200, 128, 128, jnp.bfloat16, None),
    (70, 260, 2, 96, 128, 128, jnp.bfloat16, None),
    (3, 200, 1, 150, 64, 96, jnp.float32, MatmulConfig(2, 32, 4, 3, split_k=2)),
    (17, 48, 3, 40, 16, 16, jnp.bfloat16, MatmulConfig(16, 32, 4, 3, split_k=3)),
])
def test_a_k_major_weight_gives_the_same_sums(rng, m, k, parts, n, block_k, block_n, dtype, config):
    """The weight as [P, N, K] (the engine's layout for the kernel), partial edge blocks
    included: the float64 product within float32 sums of k terms (their order is the
    CPU dot's, which follows the layout), as from [K, P, N]; and the dequantized dot
    reads it as it reads [K, P, N]."""
    x, q, scale = make_case(rng, m, k, parts, n, block_k, block_n, dtype)
    blocks = dict(block_k=block_k, block_n=block_n, out_dtype=jnp.float32)
    k_major = q.transpose(1, 2, 0)
    got = np.asarray(fp8_matmul(x, k_major, scale, **blocks, interpret=True, config=config, k_major=True))
    exact = float64_product(x, q, scale, block_k, block_n)
    magnitude = float64_product(jnp.abs(x.astype(jnp.float32)), jnp.abs(q.astype(jnp.float32)), scale, block_k, block_n)
    assert np.all(np.abs(got - exact) <= 4 * k * np.finfo(np.float32).eps * magnitude)
    dequantized = np.asarray(fp8_matmul_dequantized(x, q, scale, **blocks))
    np.testing.assert_allclose(fp8_matmul_dequantized(x, k_major, scale, **blocks, k_major=True), dequantized,
                               atol=4 * k * np.finfo(np.float32).eps * magnitude.max(), rtol=0)
    with pytest.raises(ValueError, match="do not fit"):
        fp8_matmul(x, q, scale, **blocks, interpret=True, k_major=True)


def test_a_k_major_weight_lowers_for_the_gpu():
    x = jax.ShapeDtypeStruct((2, 300), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((2, 200, 300), jnp.float8_e4m3fn)
    scale = jax.ShapeDtypeStruct((3, 2, 2), jnp.float32)
    for config in (None, MatmulConfig(2, 64, 4, 3, split_k=3), MatmulConfig(16, 64, 4, 3, split_k=3, x_fp8=True)):
        lowered = jax.jit(lambda x, q, s: fp8_matmul(x, q, s, block_k=128, block_n=128, config=config, k_major=True))
        assert "triton" in lowered.trace(x, q, scale).lower(lowering_platforms=("cuda",)).as_text()


def test_the_kernel_layout_moves_an_array_two_weights_share_once(rng):
    """with_fp8_matmul(in_place=True) frees each moved weight's old buffer: an fp8 array
    that two leaves share is moved once, both leaves get the moved one, and the way
    back to the reference's layout gives the original bytes."""
    import collections

    from jaxmtp.models.linear import with_fp8_matmul
    from jaxmtp.models.params import Fp8Weight

    _, q, scale = make_case(rng, 1, 64, 1, 32, 16, 16, jnp.float32)
    shared = Fp8Weight(q.reshape(64, 32), scale.reshape(4, 2), (16, 16))
    Layer = collections.namedtuple("Layer", "q_proj o_proj")
    moved = with_fp8_matmul(Layer(shared, shared), "pallas_interpret", in_place=True)
    assert moved.q_proj.weight is moved.o_proj.weight and moved.q_proj.k_major and moved.q_proj.weight.shape == (32, 64)
    back = with_fp8_matmul(moved, "reference")
    np.testing.assert_array_equal(np.asarray(back.o_proj.weight.astype(jnp.float32)),
                                  np.asarray(q.reshape(64, 32).astype(jnp.float32)))
