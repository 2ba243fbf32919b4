"""The Hopper grouped matmul (jaxmtp/kernels/grouped_wgmma.py): Mosaic GPU's interpreter
on this CPU against float64, its tile table, and the kernel lowered for the GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_fp8_wgmma import interpreter
from test_moe_mla_pallas import fp8_experts, seeded

from jaxmtp.kernels.fp8_matmul import quantize_activations
from jaxmtp.kernels.grouped_wgmma import GroupedWgmmaConfig, grouped_wgmma, tile_table

BF16_ROUNDING = 2.0**-8  # the output's one rounding to bfloat16 (8-bit significand)
F32_EPS = np.finfo(np.float32).eps


def grouped_float64(x, w, sizes, swiglu):
    """Each group's rows times its matrix in float64 (swiglu: silu(gate) * up), and the
    output's float32 error bound before its rounding: sums of K products in float32
    err by at most K eps of their magnitude (an fp8 product's K steps each scaled once
    more, within that), and silu's slope is at most 1.1."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    k = x64.shape[1]
    ends = np.cumsum(sizes)
    starts = ends - sizes
    out = np.zeros((x64.shape[0], w64.shape[-1]))
    bound = np.zeros_like(out)
    for g, (start, end) in enumerate(zip(starts, ends)):
        rows = x64[start:end]
        products = np.einsum("mk,k...->m...", rows, w64[g])
        magnitude = np.einsum("mk,k...->m...", np.abs(rows), np.abs(w64[g])) * k * F32_EPS
        if not swiglu:
            out[start:end], bound[start:end] = products, magnitude
            continue
        gate, up = products[:, 0], products[:, 1]
        silu = gate / (1 + np.exp(-gate))
        out[start:end] = silu * up
        bound[start:end] = 1.1 * magnitude[:, 0] * np.abs(up) + np.abs(silu) * magnitude[:, 1] + 8 * F32_EPS * np.abs(
            silu * up)
    return out, bound


# (group sizes, rows, K, N, swiglu, config): groups that share blocks, an empty group,
# one group holding every row, padding rows past the groups (which come out 0), more K
# steps than the pipeline holds, one compute warpgroup and two
CASES = [
    ([5, 0, 70, 3], 90, 128, 64, False, GroupedWgmmaConfig(64, 64, 64, 2)),
    ([0, 130, 0], 130, 256, 128, False, GroupedWgmmaConfig(128, 128, 64, 2)),
    ([17, 40, 1, 9], 70, 192, 64, True, GroupedWgmmaConfig(64, 64, 64, 3)),
    ([33, 100, 2], 160, 128, 128, True, GroupedWgmmaConfig(128, 128, 64, 2)),
]


@pytest.mark.parametrize("sizes, m, k, n, swiglu, config", CASES)
def test_the_interpreted_kernel_gives_each_groups_float64_product(sizes, m, k, n, swiglu, config):
    """Every group's rows within the output's bf16 rounding plus the float32 sums'
    bound of the float64 product (swiglu: of silu(gate) * up); the padding rows 0."""
    rng, seed = seeded()
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    shape = (len(sizes), k, 2, n) if swiglu else (len(sizes), k, n)
    w = jnp.asarray(rng.standard_normal(shape) / np.sqrt(k), jnp.bfloat16)
    got = np.asarray(grouped_wgmma(x, w, jnp.asarray(sizes, jnp.int32), config=config, swiglu=swiglu,
                                   interpret=interpreter()), np.float64)
    want, bound = grouped_float64(x, w, np.asarray(sizes), swiglu)
    assert got.shape == (m, n)
    total = sum(sizes)
    assert (got[total:] == 0).all(), f"seed={seed}: padding rows must come out 0"
    assert np.all(np.abs(got - want) <= BF16_ROUNDING * np.abs(want) + bound), f"seed={seed}"


# fp8 experts (128 x 128 block scales, K-major): several K steps and scale blocks along
# N, one compute warpgroup and two, swiglu's gate and up with scales of their own
FP8_CASES = [
    ([20, 0, 50], 80, 256, 256, False, GroupedWgmmaConfig(64, 128, 128, 2)),
    ([3, 90, 20], 120, 384, 128, True, GroupedWgmmaConfig(128, 64, 128, 2)),
]


@pytest.mark.parametrize("sizes, m, k, n, swiglu, config", FP8_CASES)
def test_the_interpreted_kernel_gives_the_float64_product_of_the_quantized_rows(sizes, m, k, n, swiglu, config):
    """fp8 experts: the rows quantized to e4m3 per row and 128 columns, each K step's
    float32 product scaled by the rows' and the block's scales (e4m3 x e4m3 products
    are exact in float32): within the output's rounding plus four times the float32
    sums' bound of the float64 product of the quantized rows and the dequantized experts
    (a step's product takes three more roundings: two scalings and its addition into
    the carried sum)."""
    rng, seed = seeded()
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    q, scale, dequantized = fp8_experts(rng, (len(sizes), k, 2, n) if swiglu else (len(sizes), k, n), (128, 128))
    x8, x_scale = quantize_activations(x, 128)
    rows = np.asarray(x8.astype(jnp.float32), np.float64) * np.repeat(np.asarray(x_scale, np.float64), 128, 1)
    got = np.asarray(grouped_wgmma(x, jnp.moveaxis(q, 1, -1), jnp.asarray(sizes, jnp.int32), scale_inv=scale,
                                   config=config, swiglu=swiglu, interpret=interpreter()), np.float64)
    want, bound = grouped_float64(rows, dequantized, np.asarray(sizes), swiglu)
    assert (got[sum(sizes):] == 0).all(), f"seed={seed}: padding rows must come out 0"
    assert np.all(np.abs(got - want) <= BF16_ROUNDING * np.abs(want) + 4 * bound), f"seed={seed}"


def test_the_tile_table_lists_each_groups_blocks_then_the_paddings():
    """Blocks of 4 rows over groups of 3, 0, 6 and 1 rows and 2 padding rows: group 0
    in block 0 (rows 0-2), group 2 in blocks 0 (row 3), 1 (all) and 2 (row 8), group 3
    in block 2 (row 9), the padding in block 2 (rows 10-11); the bound's last tile
    unused (group G + 1)."""
    groups, bounds = tile_table(jnp.asarray([3, 0, 6, 1], jnp.int32), 12, 4)
    assert np.asarray(groups).tolist() == [0, 2, 2, 2, 3, 4, 5]
    assert np.asarray(bounds).tolist() == [[0, 0, 3], [0, 3, 4], [1, 0, 4], [2, 0, 1], [2, 1, 2], [2, 2, 4], [0, 0, 0]]


def test_fits_refuses_a_tiling_past_shared_memory():
    """Compiled for the H200 with jax 0.10.2, 128 x 256 tiles of 4 bf16 K steps of 64
    asked for 262208 bytes of shared memory against the 232448 an H200 block may take
    (its error named both); with 3 steps (212992 by smem_bytes) and at 128 x 128 x 4
    with swiglu (229376) they compiled. fits takes the second two, refuses the first."""
    from jaxmtp.kernels.grouped_wgmma import fits

    assert not fits(1408, 2048, GroupedWgmmaConfig(128, 256, 64, 4))
    assert fits(1408, 2048, GroupedWgmmaConfig(128, 256, 64, 3))
    assert fits(2048, 1408, GroupedWgmmaConfig(128, 128, 64, 4), swiglu=True)


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("fp8, config", [(False, GroupedWgmmaConfig()), (False, GroupedWgmmaConfig(64, 128, 64, 4)),
                                         (True, GroupedWgmmaConfig(128, 64, 128, 3)),
                                         (True, GroupedWgmmaConfig(64, 64, 128, 4))])
def test_the_kernel_lowers_for_the_gpu(fp8, config, swiglu):
    """Mosaic GPU's lowering runs without a GPU, at Moonlight's experts (64 of 2048 x
    1408; bf16 as loaded, or fp8 K-major with 128 x 128 block scales) for a 2048-token
    prefill's 12288 sorted rows: the operands' swizzles, the transposed fp8 weight
    tiles, the accumulators' and the scales' register layouts and the ladder of stores
    are checked there."""
    k, n = (2048, 1408) if swiglu else (1408, 2048)  # gate/up, or the down projection
    x = jax.ShapeDtypeStruct((12288, k), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((64,), jnp.int32)
    if fp8:
        w = jax.ShapeDtypeStruct((64, 2, n, k) if swiglu else (64, n, k), jnp.float8_e4m3fn)
        scale = jax.ShapeDtypeStruct((64, k // 128, 2, n // 128) if swiglu else (64, k // 128, n // 128), jnp.float32)
        traced = jax.jit(lambda x, w, g, s: grouped_wgmma(x, w, g, scale_inv=s, config=config, swiglu=swiglu)).trace(
            x, w, sizes, scale)
    else:
        w = jax.ShapeDtypeStruct((64, k, 2, n) if swiglu else (64, k, n), jnp.bfloat16)
        traced = jax.jit(lambda *a: grouped_wgmma(*a, config=config, swiglu=swiglu)).trace(x, w, sizes)
    assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()


def test_the_entry_points_take_it_where_the_table_names_it(monkeypatch):
    """grouped_swiglu and grouped_matmul on a GPU (chosen on this CPU) with a table entry
    {"wgmma": fields} for the shape and bucket: the kernel on the rows gathered into
    their sorted order, equal to XLA's ragged_dot (the reference) within the rounding
    bound; an entry that does not fit the shapes (a 256-column tile for swiglu) falls
    back to the Triton kernel's default tiling."""
    from jaxmtp.kernels import grouped_matmul as gm

    rng, seed = seeded()
    calls = []

    def recorded(*args, config, **kwargs):
        calls.append(config)
        return grouped_wgmma(*args, config=config, **kwargs, interpret=interpreter())

    monkeypatch.setattr(gm, "grouped_wgmma", recorded)
    monkeypatch.setattr(gm.jax, "default_backend", lambda: "gpu")  # the GPU's choice, computed on the CPU
    sizes = np.asarray([30, 0, 34])
    rows = jnp.asarray(rng.permutation(80)[:64], jnp.int32)  # 64 sorted rows of 80 tokens
    x = jnp.asarray(rng.standard_normal((80, 64)), jnp.bfloat16)
    gate_up = jnp.asarray(rng.standard_normal((3, 64, 2, 64)) / 8, jnp.bfloat16)
    down = jnp.asarray(rng.standard_normal((3, 64, 128)) / 8, jnp.bfloat16)
    tiling = GroupedWgmmaConfig(64, 64, 64, 2)
    monkeypatch.setitem(gm.GROUPED_TILINGS, (3, 64, 128, 1), {64: tiling})
    monkeypatch.setitem(gm.GROUPED_TILINGS, (3, 64, 128, 0), {64: GroupedWgmmaConfig(64, 128, 64, 2)})
    group_sizes = jnp.asarray(sizes, jnp.int32)
    for fn, weight, swiglu in ((gm.grouped_swiglu, gate_up, True), (gm.grouped_matmul, down, False)):
        got = np.asarray(fn(x, weight, group_sizes, rows), np.float64)
        want, bound = grouped_float64(np.asarray(x)[np.asarray(rows)], weight, sizes, swiglu)
        assert np.all(np.abs(got - want) <= BF16_ROUNDING * np.abs(want) + bound), f"seed={seed} {fn.__name__}"
    assert calls == [tiling, GroupedWgmmaConfig(64, 128, 64, 2)]
    monkeypatch.setitem(gm.GROUPED_TILINGS, (3, 64, 128, 1), {64: GroupedWgmmaConfig(64, 256, 64, 2)})
    assert gm._tiling(x[:64], gate_up, None, swiglu=True) == gm.default_config(64, 3, 64, 128, True)
    # fp8 experts: K-major in 128 x 128 blocks (the engine's layout on one device) take it
    # at a tiling of 128-wide K steps; as loaded ([K, N]), the Triton kernel
    fp8 = (3, 128, 128, 0, 128)
    monkeypatch.setitem(gm.GROUPED_TILINGS, fp8, {64: GroupedWgmmaConfig(64, 64, 128, 2)})
    down_fp8 = jnp.zeros((3, 128, 128), jnp.float8_e4m3fn)
    sorted_rows = jnp.zeros((64, 128), jnp.bfloat16)
    assert gm._tiling(sorted_rows, down_fp8, None, False, (128, 128), k_major=True) == GroupedWgmmaConfig(64, 64, 128, 2)
    assert gm._tiling(sorted_rows, down_fp8, None, False, (128, 128)) == gm.default_config(64, 3, 128, 128, False,
                                                                                            (128, 128))
    # and pass the kernel their scales and the gathered rows: the direct call's output
    q, scale, _ = fp8_experts(rng, (3, 128, 128), (128, 128))
    x = jnp.asarray(rng.standard_normal((80, 128)), jnp.bfloat16)
    got = gm.grouped_matmul(x, jnp.moveaxis(q, 1, -1), group_sizes, rows, scale_inv=scale, scale_block=(128, 128),
                            k_major=True)
    want = grouped_wgmma(x[rows], jnp.moveaxis(q, 1, -1), group_sizes, scale_inv=scale,
                         config=GroupedWgmmaConfig(64, 64, 128, 2), interpret=interpreter())
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
