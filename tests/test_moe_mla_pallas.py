"""The Pallas grouped-matmul and MLA attention kernels (interpret mode, CPU) against float64
NumPy and the jnp references, and the model's entry points that take them on GPUs.

Random inputs are fresh per test (the seed is in every failure message). Interpret mode
fills outputs with NaN before a kernel runs, so a row the kernel should have written and
did not shows up as NaN; cache slots nobody may attend hold NaN or 1e30 (make_case)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp.models.mla import mla_attention_fn, resolve_mla_backend
from jaxmtp.models.moe import Routing, routed_experts
from jaxmtp.kernels import grouped_matmul as gm
from jaxmtp.kernels.grouped_reference import paired_swiglu_reference
from jaxmtp.kernels.mla_attention import MLAKernelConfig, mla_absorbed_attention
from jaxmtp.kernels.mla_reference import mla_absorbed_attention_reference
from jaxmtp.kernels.triton_common import merged_rows
from jaxmtp.models.layers import rotate
from test_kernels import make_case, relative_error
from test_moe_kernels import experts_float64, grouped_matmul_float64, mla_float64, seeded
from tolerances import assert_within, attention_float64, gamma, swiglu_relative

# Small tiles: groups span several row blocks, K several steps, N several column tiles.
SMALL = gm.GroupedMatmulConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)
# and K's two steps in two programs, their float32 partials summed (and activated) after
SPLIT_K = dataclasses.replace(SMALL, split_k=2)


def group_sizes_for(loads, rng, groups, rows):
    if loads == "ragged":
        return rng.multinomial(rows, np.ones(groups) / groups)
    sizes = np.zeros(groups, int)
    if loads == "empty-experts":
        sizes[[1, 4]] = rng.multinomial(rows, [0.5, 0.5])
    elif loads == "one-expert-takes-all":
        sizes[groups - 1] = rows
    else:  # padding rows: 7 sorted rows owned by no group
        sizes = rng.multinomial(rows - 7, np.ones(groups) / groups)
    return sizes


@pytest.mark.parametrize("config", [None, SMALL, SPLIT_K], ids=["default-tiling", "small-tiles", "split-k"])
@pytest.mark.parametrize("loads", ["ragged", "empty-experts", "one-expert-takes-all", "padding-rows"])
def test_grouped_kernels_on_ragged_loads(loads, config):
    """Both kernels, their rows gathered from lhs through `rows`, against float64; the
    padding rows are exactly 0 and every other row is written."""
    rng, seed = seeded()
    groups, rows, k, n = 6, 40, 32, 48
    sizes = jnp.asarray(group_sizes_for(loads, rng, groups, rows), jnp.int32)
    lhs = rng.standard_normal((25, k)).astype(np.float32)
    source = rng.integers(0, 25, rows).astype(np.int32)
    rhs = rng.standard_normal((groups, k, n)).astype(np.float32)
    gate_up = (0.3 * rng.standard_normal((groups, k, 2, n))).astype(np.float32)
    args = (jnp.asarray(lhs), jnp.asarray(rhs), sizes, jnp.asarray(source))
    out = np.asarray(gm.grouped_matmul_kernel(*args, interpret=True, config=config))
    assert_within(out, *grouped_matmul_float64(lhs[source], rhs, sizes), f"seed={seed}")
    both, _ = grouped_matmul_float64(lhs[source], gate_up.reshape(groups, k, 2 * n), sizes)
    magnitude, _ = grouped_matmul_float64(np.abs(lhs[source]), np.abs(gate_up).reshape(groups, k, 2 * n), sizes)
    want = both[:, :n] / (1 + np.exp(-both[:, :n])) * both[:, n:]
    bound = swiglu_relative(k) * magnitude[:, :n] * magnitude[:, n:]
    got = np.asarray(gm.grouped_swiglu_kernel(jnp.asarray(lhs), jnp.asarray(gate_up), sizes, jnp.asarray(source),
                                              interpret=True, config=config))
    assert_within(got, want, bound, f"seed={seed}")
    reference = np.asarray(gm.grouped_swiglu_reference(jnp.asarray(lhs), jnp.asarray(gate_up), sizes,
                                                       jnp.asarray(source)))
    assert_within(reference, want, bound, f"seed={seed} reference")
    total = int(sizes.sum())
    assert (out[total:] == 0).all() and (got[total:] == 0).all(), f"seed={seed}: padding rows"


def test_grouped_kernel_in_bfloat16_and_without_rows():
    """bf16 operands (float32 accumulation), lhs already sorted (rows=None): the products
    of bf16 operands are exact in float32, so kernel and reference differ by their float32
    sums' order (gamma_32 each) and each output's one rounding to bf16 (u = 2^-8)."""
    rng, seed = seeded()
    sizes = jnp.asarray(rng.multinomial(64, np.ones(4) / 4), jnp.int32)
    lhs = jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((4, 32, 16)), jnp.bfloat16)
    out = gm.grouped_matmul_kernel(lhs, rhs, sizes, interpret=True, config=SMALL)
    assert out.dtype == jnp.bfloat16
    error = relative_error(out, gm.grouped_matmul_reference(lhs, rhs, sizes))
    assert error < 2 * (2.0**-8 + gamma(32)), f"seed={seed}: relative error {error:.2e}"


def fp8_experts(rng, shape, scale_block):
    """An fp8 expert weight [E, K, (2,) N] with float32 scales per (K, N) block that differ
    by up to 2^6 (a scale read from the wrong block shows), and its dequantized float64."""
    q = jnp.asarray(rng.standard_normal(shape), jnp.float8_e4m3fn)
    blocks = (shape[0], -(-shape[1] // scale_block[0]), *shape[2:-1], -(-shape[-1] // scale_block[1]))
    scale = (2.0 ** rng.uniform(-3, 3, blocks)).astype(np.float32)
    full = np.repeat(np.repeat(scale, scale_block[0], 1)[:, : shape[1]], scale_block[1], -1)[..., : shape[-1]]
    return q, jnp.asarray(scale), np.asarray(q.astype(jnp.float32), np.float64) * full


def k_major_experts(q, k_major: bool):
    """An expert weight [E, K, (2,) N] as the kernels take it: K-major [E, (2,) N, K] or as is."""
    return jnp.moveaxis(q, 1, -1) if k_major else q


@pytest.mark.parametrize("k_major", [False, True], ids=["k-by-n", "k-major"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("config", [SMALL, SPLIT_K, None], ids=["small-tiles", "split-k", "default-tiling"])
def test_grouped_kernels_stream_fp8_experts_with_their_block_scales(config, dtype, k_major):
    """fp8 experts with block scales (K blocks of 32 over K steps of 16; N blocks of 32
    over N = 48, the last partial, gate's and up's apart), as loaded or K-major (the
    engine's layout on one device), against float64 of the dequantized weights: the
    products are exact in float32 (bfloat16 rows through the float16 shift), so within
    one float32 evaluation's bound, plus bfloat16's one rounding of each output."""
    rng, seed = seeded()
    groups, rows, k, n, block = 5, 36, 64, 48, (32, 32)
    sizes = jnp.asarray(group_sizes_for("padding-rows", rng, groups, rows), jnp.int32)
    lhs = jnp.asarray(rng.standard_normal((20, k)), dtype)
    source = rng.integers(0, 20, rows).astype(np.int32)
    sorted_lhs = np.asarray(lhs.astype(jnp.float32), np.float64)[source]
    rounding = 0.0 if dtype == jnp.float32 else 2.0**-8
    q, scale, exact = fp8_experts(rng, (groups, k, n), block)
    fp8 = dict(scale_inv=scale, scale_block=block, k_major=k_major)
    out = gm.grouped_matmul_kernel(lhs, k_major_experts(q, k_major), sizes, jnp.asarray(source), **fp8,
                                   interpret=True, config=config)
    want, bound = grouped_matmul_float64(sorted_lhs, exact, sizes)
    assert_within(np.asarray(out, np.float64), want, bound + rounding * np.abs(want), f"seed={seed}")
    q, scale, exact = fp8_experts(rng, (groups, k, 2, n), block)
    fp8 = dict(scale_inv=scale, scale_block=block, k_major=k_major)
    q = k_major_experts(q, k_major)
    got = gm.grouped_swiglu_kernel(lhs, q, sizes, jnp.asarray(source), **fp8, interpret=True, config=config)
    both, _ = grouped_matmul_float64(sorted_lhs, exact.reshape(groups, k, 2 * n), sizes)
    magnitude, _ = grouped_matmul_float64(np.abs(sorted_lhs), np.abs(exact).reshape(groups, k, 2 * n), sizes)
    want = both[:, :n] / (1 + np.exp(-both[:, :n])) * both[:, n:]
    bound = swiglu_relative(k) * magnitude[:, :n] * magnitude[:, n:] + rounding * np.abs(want)
    assert_within(np.asarray(got, np.float64), want, bound, f"seed={seed}")
    reference = gm.grouped_swiglu_reference(lhs, q, sizes, jnp.asarray(source), **fp8)
    assert_within(np.asarray(reference, np.float64), want, bound, f"seed={seed} reference")
    total = int(sizes.sum())
    assert (np.asarray(out)[total:] == 0).all() and (np.asarray(got)[total:] == 0).all(), f"seed={seed}: padding"


def test_fp8_experts_need_a_k_step_inside_their_scale_block():
    lhs, sizes = jnp.zeros((4, 64)), jnp.asarray([4, 0], jnp.int32)
    q = jnp.zeros((2, 64, 32), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="block_k=32 must divide the scale block's K \\(16\\)"):
        gm.grouped_matmul_kernel(lhs, q, sizes, scale_inv=jnp.ones((2, 4, 1)), scale_block=(16, 32), interpret=True,
                                 config=dataclasses.replace(SMALL, block_k=32))
    with pytest.raises(ValueError, match="scale_inv \\(2, 2, 1\\) does not fit"):
        gm.grouped_matmul_kernel(lhs, q, sizes, scale_inv=jnp.ones((2, 2, 1)), scale_block=(16, 32), interpret=True)
    assert gm.default_config(4, 2, 64, 32, scale_block=(16, 32)).block_k == 16


# ----- the paired form (decode: each (token, expert) pair a row of its own) ----------------


def paired_float64(lhs, rhs, pair_groups):
    """Row i times rhs[pair_groups[i]] in float64 (0 for group G), and one float32
    evaluation's rounding bound (gamma_K |lhs| @ |rhs|)."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out, magnitude = np.zeros((lhs.shape[0], rhs.shape[-1])), np.zeros((lhs.shape[0], rhs.shape[-1]))
    for i, g in enumerate(np.asarray(pair_groups)):
        if g < rhs.shape[0]:
            out[i], magnitude[i] = lhs[i] @ rhs[g], np.abs(lhs[i]) @ np.abs(rhs[g])
    return out, gamma(lhs.shape[1]) * magnitude


def paired_case(rng, groups, pairs):
    """Pair groups with repeats and pairs held elsewhere (group G), and their lhs rows."""
    pair_groups = rng.integers(0, groups + 1, pairs).astype(np.int32)
    pair_groups[[1, pairs - 1]] = groups
    pair_groups[[2, 3]] = pair_groups[0] if pair_groups[0] < groups else 0
    source = rng.integers(0, 6, pairs).astype(np.int32)
    return pair_groups, source


def swiglu_float64(lhs, gate_up, pair_groups):
    groups, k, _, n = gate_up.shape
    both, _ = paired_float64(lhs, np.asarray(gate_up).reshape(groups, k, 2 * n), pair_groups)
    magnitude, _ = paired_float64(np.abs(lhs), np.abs(np.asarray(gate_up)).reshape(groups, k, 2 * n), pair_groups)
    bound = swiglu_relative(k) * magnitude[:, :n] * magnitude[:, n:]
    return both[:, :n] / (1 + np.exp(-both[:, :n])) * both[:, n:], bound


@pytest.mark.parametrize("config", [None, SMALL, SPLIT_K], ids=["default-tiling", "small-tiles", "split-k"])
def test_paired_kernels_match_float64(config):
    """Both paired kernels (each row its own group's matrix, rows gathered through
    `rows`, groups repeated and held elsewhere) against float64; rows of group G are
    exactly 0 and every row is written."""
    rng, seed = seeded()
    groups, pairs, k, n = 5, 14, 64, 48
    pair_groups, source = paired_case(rng, groups, pairs)
    lhs = rng.standard_normal((6, k)).astype(np.float32)
    rhs = rng.standard_normal((groups, k, n)).astype(np.float32)
    gate_up = (0.3 * rng.standard_normal((groups, k, 2, n))).astype(np.float32)
    args = (jnp.asarray(pair_groups), jnp.asarray(source))
    out = np.asarray(gm.paired_matmul_kernel(jnp.asarray(lhs), jnp.asarray(rhs), *args, interpret=True, config=config))
    assert_within(out, *paired_float64(lhs[source], rhs, pair_groups), f"seed={seed}")
    got = np.asarray(gm.paired_swiglu_kernel(jnp.asarray(lhs), jnp.asarray(gate_up), *args, interpret=True,
                                             config=config))
    want, bound = swiglu_float64(lhs[source], gate_up, pair_groups)
    assert_within(got, want, bound, f"seed={seed}")
    reference = np.asarray(paired_swiglu_reference(jnp.asarray(lhs), jnp.asarray(gate_up), *args))
    assert_within(reference, want, bound, f"seed={seed} reference")
    elsewhere = pair_groups == groups
    assert (out[elsewhere] == 0).all() and (got[elsewhere] == 0).all(), f"seed={seed}: pairs held elsewhere"


@pytest.mark.parametrize("k_major", [False, True], ids=["k-by-n", "k-major"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_paired_kernels_stream_fp8_experts_with_their_block_scales(dtype, k_major):
    """fp8 experts in non-square blocks (32 x 16: a block size read along the wrong axis
    fails), as loaded or K-major, through both paired kernels, split over K, and the
    paired reference, against float64 of the dequantized weights, as the sorted form's
    fp8 test bounds them."""
    rng, seed = seeded()
    groups, pairs, k, n, block = 4, 9, 64, 48, (32, 16)
    pair_groups, source = paired_case(rng, groups, pairs)
    lhs = jnp.asarray(rng.standard_normal((6, k)), dtype)
    rows = np.asarray(lhs.astype(jnp.float32), np.float64)[source]
    rounding = 0.0 if dtype == jnp.float32 else 2.0**-8
    args = (jnp.asarray(pair_groups), jnp.asarray(source))
    q, scale, exact = fp8_experts(rng, (groups, k, n), block)
    fp8 = dict(scale_inv=scale, scale_block=block, k_major=k_major)
    out = gm.paired_matmul_kernel(lhs, k_major_experts(q, k_major), *args, **fp8, interpret=True, config=SPLIT_K)
    want, bound = paired_float64(rows, exact, pair_groups)
    assert_within(np.asarray(out, np.float64), want, bound + rounding * np.abs(want), f"seed={seed}")
    q, scale, exact = fp8_experts(rng, (groups, k, 2, n), block)
    fp8 = dict(scale_inv=scale, scale_block=block, k_major=k_major)
    q = k_major_experts(q, k_major)
    got = gm.paired_swiglu_kernel(lhs, q, *args, **fp8, interpret=True)
    want, bound = swiglu_float64(rows, exact, pair_groups)
    assert_within(np.asarray(got, np.float64), want, bound + rounding * np.abs(want), f"seed={seed}")
    reference = paired_swiglu_reference(lhs, q, *args, **fp8)
    assert_within(np.asarray(reference, np.float64), want, bound + rounding * np.abs(want), f"seed={seed} reference")


def test_routed_experts_by_pair_equal_the_sorted_layer():
    """routed_experts_by_pair with the paired kernels (interpret mode) equals the sorted
    layer on the references, on all the experts and on a device's share of them under
    expert parallelism (pairs routed elsewhere add nothing)."""
    from jaxmtp.models.moe import routed_experts_by_pair

    rng, seed = seeded()
    t, h, inter, num_experts, k = 5, 32, 16, 6, 3
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    gate_up = jnp.asarray(0.5 * rng.standard_normal((num_experts, h, 2, inter)), jnp.float32)
    down = jnp.asarray(0.5 * rng.standard_normal((num_experts, inter, h)), jnp.float32)
    experts = np.stack([rng.choice(num_experts, size=k, replace=False) for _ in range(t)])
    routing = Routing(jnp.asarray(experts, jnp.int32), jnp.asarray(rng.random((t, k)), jnp.float32))
    kernels = dict(pair_swiglu=functools.partial(gm.paired_swiglu_kernel, interpret=True),
                   pair_matmul=functools.partial(gm.paired_matmul_kernel, interpret=True))
    _, bound, _ = experts_float64(x, experts, routing.weights, gate_up, down)
    for first, held in ((0, num_experts), (2, 3)):
        weights = (gate_up[first:first + held], down[first:first + held])
        got = routed_experts_by_pair(x, routing, *weights, first, **kernels)
        want = routed_experts(x, routing, *weights, first, expert_swiglu=gm.grouped_swiglu_reference,
                              expert_matmul=gm.grouped_matmul_reference)
        # two float32 evaluations in their own orders: twice one's rounding bound (of all experts)
        assert_within(got, want, 2 * bound, f"seed={seed} first={first}")


def test_the_measured_table_sends_few_pairs_to_the_paired_layer(monkeypatch):
    """kernels/expert_paths.json as moe_ffn reads it: on a GPU, the paired layer for the
    pair buckets the table marks "paired", fp8 experts dequantized where it says so, the
    sorted layer elsewhere, for unmeasured shapes and off GPUs; fp8 experts are keyed by
    their scale block's K."""
    import jaxmtp.models.moe as moe
    from test_moe_kernels import moe_config

    shape = (16, 32, 2, 16)
    # a "dequantized" entry for bf16 experts (nothing to dequantize) runs sorted
    monkeypatch.setitem(gm.EXPERT_PATHS, (16, 32, 16), {8: "paired", 16: "sorted", 32: "dequantized"})
    monkeypatch.setitem(gm.EXPERT_PATHS, (16, 32, 16, 16), {8: "paired", 32: "dequantized"})
    assert gm.expert_path(8, shape) == "sorted"  # on the CPU
    monkeypatch.setattr(gm.jax, "default_backend", lambda: "gpu")  # the GPU's choice, computed on the CPU
    assert gm.expert_path(5, shape) == gm.expert_path(8, shape) == "paired"  # 5 pairs: bucket 8
    assert gm.expert_path(9, shape) == gm.expert_path(64, shape) == gm.expert_path(32, shape) == "sorted"
    assert gm.expert_path(8, (16, 32, 2, 8)) == "sorted"  # not measured
    assert gm.expert_path(8, shape, (16, 16)) == "paired" and gm.expert_path(8, shape, (32, 16)) == "sorted"
    assert gm.expert_path(32, shape, (16, 16)) == "dequantized"

    calls = []
    monkeypatch.setattr(moe, "routed_experts_by_pair", lambda *a: calls.append("paired") or jnp.zeros((2, 32)))
    monkeypatch.setattr(moe, "routed_experts", lambda *a, **kw: calls.append("sorted") or jnp.zeros((2, 32)))
    rng, _ = seeded()
    cfg = moe_config(num_experts=16, k=4)
    params = moe.MoEParams(router=jnp.asarray(rng.standard_normal((32, 16)), jnp.float32), router_bias=jnp.zeros(16),
                           experts_gate_up=jnp.zeros(shape), experts_down=jnp.zeros((16, 16, 32)))
    for rows, want in ((2, "paired"), (4, "sorted")):  # 8 and 16 pairs
        moe.moe_ffn(params, cfg, jnp.ones((rows, 32)))
        assert calls[-1] == want


@pytest.mark.parametrize("k_major", [False, True], ids=["k-by-n", "k-major"])
def test_fp8_experts_dequantized_first_give_the_fp8_layers_output(monkeypatch, k_major):
    """moe_ffn where expert_path says "dequantized": the fp8 experts dequantized to the
    model's dtype (float32 here), then the sorted layer, equal to the fp8 layer through
    its references (which dequantize in float32 the same way), to the bit, held K-major
    or as loaded."""
    import jaxmtp.models.moe as moe
    from jaxmtp.models.params import Fp8Weight
    from test_moe_kernels import moe_config

    rng, seed = seeded()
    e, h, inter, block = 16, 32, 16, (16, 16)
    q_gu, s_gu, _ = fp8_experts(rng, (e, h, 2, inter), block)
    q_dn, s_dn, _ = fp8_experts(rng, (e, inter, h), block)
    params = moe.MoEParams(
        router=jnp.asarray(rng.standard_normal((h, e)), jnp.float32), router_bias=jnp.zeros(e),
        experts_gate_up=Fp8Weight(k_major_experts(q_gu, k_major), s_gu, (1, block[0], 1, block[1]), k_major=k_major),
        experts_down=Fp8Weight(k_major_experts(q_dn, k_major), s_dn, (1, *block), k_major=k_major))
    x = jnp.asarray(rng.standard_normal((6, h)), jnp.float32)
    paths = []
    outs = {}
    for path in ("sorted", "dequantized"):
        monkeypatch.setattr(moe, "expert_path", lambda *a, path=path: paths.append(path) or path)
        outs[path] = np.asarray(moe.moe_ffn(params, moe_config(num_experts=e, k=4), x))
    assert paths == ["sorted", "dequantized"]
    np.testing.assert_array_equal(outs["dequantized"], outs["sorted"], f"seed={seed}")


def routed_through_kernels_and_references(x, routing, gate_up, down) -> tuple:
    """The MoE layer with the kernels (interpret mode, small tiles) in its grouped-matmul
    slots, and with the references."""
    def interpret(fn):
        return lambda *a, **kw: fn(*a, **kw, interpret=True, config=SMALL)

    got = routed_experts(x, routing, gate_up, down, expert_swiglu=interpret(gm.grouped_swiglu_kernel),
                         expert_matmul=interpret(gm.grouped_matmul_kernel))
    return got, routed_experts(x, routing, gate_up, down, expert_swiglu=gm.grouped_swiglu_reference,
                               expert_matmul=gm.grouped_matmul_reference)


def test_routed_experts_through_the_kernels():
    """The MoE layer with the kernels in its grouped-matmul slots equals the references'
    layer (which test_moe_kernels checks against a per-token float64 loop)."""
    rng, seed = seeded()
    t, h, inter, num_experts, k = 20, 32, 16, 6, 3
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    gate_up = jnp.asarray(0.5 * rng.standard_normal((num_experts, h, 2, inter)), jnp.float32)
    down = jnp.asarray(0.5 * rng.standard_normal((num_experts, inter, h)), jnp.float32)
    experts = np.stack([rng.choice(num_experts - 1, size=k, replace=False) for _ in range(t)])  # expert 5 unused
    routing = Routing(jnp.asarray(experts, jnp.int32), jnp.asarray(rng.random((t, k)), jnp.float32))

    got, want = routed_through_kernels_and_references(x, routing, gate_up, down)
    # two float32 evaluations in their own orders: twice one's rounding bound
    _, bound, _ = experts_float64(x, experts, routing.weights, gate_up, down)
    assert_within(got, want, 2 * bound, f"seed={seed}")


def test_the_measured_table_picks_the_grouped_tiling_per_row_bucket(monkeypatch):
    """kernels/grouped_tilings.json as the engine reads it: Moonlight's gate/up at 1 token
    (6 sorted rows, bucket 8) takes the H200's measured tiling, rows round up to their
    bucket, a bucket not measured takes the smallest measured one above it (and past the
    largest, or for a shape not measured, default_config), "xla" sends the call to the
    reference, and a decode step's real rows (real_rows) pick the bucket, not its
    padding."""
    gate_up = (64, 2048, 2 * 1408, 1)
    assert gm.row_bucket(6) == 8 and gm.row_bucket(9) == 16 and gm.row_bucket(0) == 1
    assert gm.grouped_tiling(6, 64, 2048, 2 * 1408, True) == gm.GROUPED_TILINGS[gate_up][8]
    assert gm.grouped_tiling(5, 64, 2048, 2 * 1408, True) == gm.GROUPED_TILINGS[gate_up][8]
    assert gm.GROUPED_TILINGS[gate_up][8] != gm.default_config(6, 64, 2048, 2 * 1408, True)
    assert gm.grouped_tiling(6, 64, 2048, 2 * 1408, False) == gm.default_config(6, 64, 2048, 2 * 1408, False)
    down = (64, 1408, 2048, 0)
    assert 8 not in gm.GROUPED_TILINGS[down] and gm.grouped_tiling(6, 64, 1408, 2048, False) == gm.GROUPED_TILINGS[down][16]
    assert gm.grouped_tiling(1 << 17, 64, 1408, 2048, False) == gm.default_config(1 << 17, 64, 1408, 2048, False)
    monkeypatch.setitem(gm.GROUPED_TILINGS, (2, 16, 32, 1), {8: "xla"})
    assert gm.grouped_tiling(8, 2, 16, 32, True) == "xla"
    # fp8 experts have rows of their own, keyed by the scale block's K
    assert gm.grouped_tiling(8, 2, 16, 32, True, (16, 16)) == gm.default_config(8, 2, 16, 32, True, (16, 16))
    monkeypatch.setitem(gm.GROUPED_TILINGS, (2, 16, 32, 1, 16), {8: SMALL})
    assert gm.grouped_tiling(8, 2, 16, 32, True, (16, 16)) == SMALL
    monkeypatch.setattr(gm.jax, "default_backend", lambda: "gpu")  # the GPU's choice, computed on the CPU
    lhs, gate_up_2 = jnp.ones((8, 16)), jnp.ones((2, 16, 2, 16))
    assert gm._tiling(lhs, gate_up_2, None, swiglu=True) is None  # XLA's ragged_dot
    assert gm._tiling(lhs[:4], gate_up_2, None, swiglu=True) is None  # bucket 4 takes the 8 above it
    monkeypatch.setitem(gm.GROUPED_TILINGS, (2, 16, 32, 1), {4: SMALL, 8: "xla"})
    assert gm._tiling(lhs, gate_up_2, None, swiglu=True, real_rows=3) == SMALL  # 8 rows, 3 of them real
    assert gm._tiling(lhs, gate_up_2, None, swiglu=True, real_rows=16) is None  # never more than the rows


def test_shapes_the_kernels_do_not_tile_are_refused():
    lhs, sizes = jnp.zeros((8, 12)), jnp.zeros(2, jnp.int32)
    with pytest.raises(ValueError, match="K and N multiples of 16, got K=12"):
        gm.grouped_matmul_kernel(lhs, jnp.zeros((2, 12, 16)), sizes, interpret=True)
    assert gm.supports(64, 2048, 2 * 1408) and not gm.supports(256, 7168, 2 * 2048)  # DeepSeek-V3: past int32
    with pytest.raises(ValueError, match="kv_lora_rank and the rope dim powers of 2"):
        mla_absorbed_attention(jnp.zeros((2, 4, 12)), jnp.zeros((2, 4, 16)), jnp.zeros((4, 4, 1, 12)),
                             jnp.zeros((4, 4, 1, 16)), jnp.ones(2, jnp.int32), jnp.zeros((2, 1), jnp.int32),
                             jnp.arange(3, dtype=jnp.int32), sm_scale=0.1, decode_rows=1, interpret=True)
    with pytest.raises(ValueError, match="kv_lora_rank and qk_rope_head_dim powers of two >= 16, got 12 and 6"):
        resolve_mla_backend("pallas", 12, 6)
    with pytest.raises(ValueError, match="unknown attention backend 'triton'"):
        resolve_mla_backend("triton", 32, 16)
    assert resolve_mla_backend("auto", 32, 16) == "reference"  # on the CPU


# ----- MLA attention ---------------------------------------------------------------------

R, DR, HEADS = 32, 16, 4


def mla_case(rng, seqs, dtype=jnp.float32, page_size=4, shared_pages=0):
    """Latent and rope pages over shuffled pages (make_case: one kv head of R + Dr dims,
    unattended slots poisoned), fresh absorbed queries. With shared_pages, the second
    sequence's table starts with the first's pages (a prefix-cache hit)."""
    _, kv, _, kv_lens, page_table, query_start = make_case(
        rng, seqs, num_q_heads=1, num_kv_heads=1, head_dim=R + DR, page_size=page_size, dtype=dtype
    )
    if shared_pages:
        page_table = page_table.at[1, :shared_pages].set(page_table[0, :shared_pages])
    num_rows = int(query_start[-1]) + 3
    q_latent = jnp.asarray(rng.standard_normal((num_rows, HEADS, R)), dtype)
    q_rope = jnp.asarray(rng.standard_normal((num_rows, HEADS, DR)), dtype)
    return q_latent, q_rope, kv[..., :R], kv[..., R:], kv_lens, page_table, query_start


def taken_rows(query_start, num_rows, decode_rows, prefill):
    query_start = np.asarray(query_start)
    rows = np.diff(query_start)
    seq = np.searchsorted(query_start[1:], np.arange(num_rows), side="right")
    taken = np.zeros(num_rows, bool)
    owned = np.arange(num_rows) < query_start[-1]
    taken[owned] = (rows[seq[owned]] > decode_rows) == prefill
    return taken


@pytest.mark.parametrize("case", [
    # contexts either side of the page (4) and of the default tiling's 64-token steps, and
    # one past 4096: the unmasked steps run too
    dict(seqs=[(1, c) for c in (1, 15, 16, 17, 63, 64, 65, 4097)], decode_rows=1, config=None),
    # verify rows (k + 1 = 3), one prefill sequence in the batch whose rows the call leaves to the prefill call
    dict(seqs=[(3, 9), (2, 3), (0, 0), (7, 11), (1, 1), (3, 140)], decode_rows=3, config=None),
    # split token ranges (flash decoding) with short steps, several head blocks; the
    # diagonals of (1, 7) and (2, 8) end a step early, on its last token
    dict(seqs=[(2, 17), (1, 2), (1, 7), (2, 8), (2, 33)], decode_rows=2, config=MLAKernelConfig(2, 2, 4, 3, 4, 2)),
    # prefill rows: a whole prompt, chunks that start mid-page (positions 18, 30), a chunk
    # longer than a step, beside decode and verify sequences the call leaves alone
    dict(seqs=[(9, 9), (1, 7), (5, 23), (0, 0), (70, 100), (2, 5), (3, 33)], decode_rows=2, config=None,
         prefill=True),
    # prefill rows in q blocks of 4 with splits and head blocks, the second sequence's first
    # three pages the first's (a prefix-cache hit), its chunk starting mid-page
    dict(seqs=[(6, 14), (7, 19), (1, 4), (13, 13)], decode_rows=1, config=MLAKernelConfig(4, 2, 4, 3, 4, 2),
         prefill=True, shared_pages=3),
], ids=["decode", "verify-and-prefill", "splits-head-blocks", "prefill", "prefill-blocks-splits-shared-pages"])
def test_mla_kernel_matches_the_reference(case):
    rng, seed = seeded()
    prefill = case.get("prefill", False)
    args = mla_case(rng, case["seqs"], shared_pages=case.get("shared_pages", 0))
    out = np.asarray(mla_absorbed_attention(*args, sm_scale=0.3, decode_rows=case["decode_rows"], prefill=prefill,
                                            interpret=True, config=case["config"]))
    ref = np.asarray(mla_absorbed_attention_reference(*args, sm_scale=0.3))
    assert not np.isnan(out).any(), f"seed={seed}: NaN (a row not written, or a poisoned slot read)"
    taken = taken_rows(args[-1], out.shape[0], case["decode_rows"], prefill)
    assert taken.any()
    assert (out[~taken] == 0).all(), f"seed={seed}: rows the kernel does not take must be 0"
    q_latent, q_rope, latent_pages, rope_pages, *cache = args
    keys = np.concatenate([latent_pages, rope_pages], -1)
    _, bound, _ = attention_float64(np.concatenate([q_latent, q_rope], -1), keys, latent_pages, *cache, sm_scale=0.3)
    assert_within(out[taken], ref[taken], 2 * bound[taken], f"seed={seed}")  # two float32 evaluations


@pytest.mark.parametrize("interleave", [False, True], ids=["half-split", "interleaved"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_kernel_rotates_the_query_rope_part_as_the_model_does(interleave, dtype):
    """With rope tables the kernel takes the whole unrotated [T, Hq, Dn + Dr] projection
    and rotates its last Dr columns as jaxmtp.models.layers.rotate does, rounding as it
    rounds: decode rows with splits and prefill rows give the outputs of the kernel on the
    query rotated beforehand, to the bit."""
    rng, seed = seeded()
    q_latent, q_pe, latent_pages, rope_pages, *cache = mla_case(rng, [(2, 17), (1, 7), (9, 9), (5, 23)], dtype=dtype)
    num_rows = q_latent.shape[0]
    q = jnp.concatenate([jnp.asarray(rng.standard_normal((num_rows, HEADS, 12)), dtype), q_pe], axis=-1)
    angles = rng.uniform(0, 2 * np.pi, (num_rows, DR // 2))
    cos, sin = jnp.asarray(1.3 * np.cos(angles), dtype), jnp.asarray(1.3 * np.sin(angles), dtype)  # YaRN-like scale
    rotated = rotate(q_pe, cos, sin, interleave)
    for prefill, config in ((False, MLAKernelConfig(2, 2, 4, 3, 4, 2)), (True, None)):
        options = dict(sm_scale=0.3, decode_rows=2, prefill=prefill, interpret=True, config=config)
        want = mla_absorbed_attention(q_latent, rotated, latent_pages, rope_pages, *cache, **options)
        got = mla_absorbed_attention(q_latent, q, latent_pages, rope_pages, *cache, rope_tables=(cos, sin),
                                     rope_interleave=interleave, **options)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                      f"seed={seed} prefill={prefill}")


def pallas_output_shapes(jaxpr) -> list[tuple]:
    """The output shapes of every pallas_call in a jaxpr, nested jaxprs included."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            shapes += [tuple(v.aval.shape) for v in eqn.outvars]
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                shapes += pallas_output_shapes(inner)
    return shapes


def test_a_decode_calls_split_results_are_kept_per_q_block():
    """A decode call in a step that also holds a 60-row prefill chunk keeps its splits'
    partial results for its 3 q blocks (3 x 4 heads), not for the step's 65 rows; the
    merge kernel writes the step's rows (65 x 4 heads)."""
    rng, _ = seeded()
    args = mla_case(rng, [(1, 9), (60, 70), (1, 5)])
    call = functools.partial(mla_absorbed_attention, sm_scale=0.3, decode_rows=1, interpret=True,
                             config=MLAKernelConfig(1, 4, 4, 3, 4, 2))
    assert pallas_output_shapes(jax.make_jaxpr(call)(*args).jaxpr) == [(3, 12, R), (3, 12), (3, 12), (65 * 4, R)]


def test_mla_kernel_in_bfloat16():
    """As the attention kernel in bf16 (test_kernels.check_kernel): a few bf16 roundings
    (the probabilities fed to the value product, the output; u = 2^-8), 3 u at most."""
    rng, seed = seeded()
    args = mla_case(rng, [(1, 50), (1, 7), (1, 64)], dtype=jnp.bfloat16, page_size=8)
    out = mla_absorbed_attention(*args, sm_scale=0.1, decode_rows=1, interpret=True)
    assert out.dtype == jnp.bfloat16
    owned = slice(0, 3)
    error = relative_error(np.asarray(out, np.float32)[owned],
                           np.asarray(mla_absorbed_attention_reference(*args, sm_scale=0.1), np.float32)[owned])
    assert error < 3 * 2.0**-8, f"seed={seed}: relative error {error:.2e}"


def rope_case(rng, num_rows):
    """Rope tables of random angles [T, DR / 2], scaled as YaRN's are."""
    angles = rng.uniform(0, 2 * np.pi, (num_rows, DR // 2))
    return jnp.asarray(1.3 * np.cos(angles), jnp.float32), jnp.asarray(1.3 * np.sin(angles), jnp.float32)


def entry_point_args(rng, seqs, dn=8, dv=12):
    """mla_attention_fn's arguments for a step of the given sequences: fresh queries
    (the projection's [T, Hq, Dn + Dr], unrotated) and rope tables, weights and latent
    rows, each row's slot at its position in its sequence's pages."""
    q_latent, q_pe, latent_pages, rope_pages, kv_lens, page_table, query_start = mla_case(rng, seqs)
    num_rows = q_latent.shape[0]
    q = jnp.concatenate([jnp.asarray(rng.standard_normal((num_rows, HEADS, dn)), jnp.float32), q_pe], axis=-1)
    w_uk = jnp.asarray(0.4 * rng.standard_normal((R, HEADS, dn)), jnp.float32)
    w_uv = jnp.asarray(rng.standard_normal((R, HEADS, dv)), jnp.float32)
    new_latent = jnp.asarray(rng.standard_normal((num_rows, R)), jnp.float32)
    new_rope = jnp.asarray(rng.standard_normal((num_rows, DR)), jnp.float32)
    page_size = latent_pages.shape[1]
    slots = np.arange(num_rows, dtype=np.int32) + latent_pages.shape[0] * page_size  # dropped unless set below
    for s, (nq, kv_len) in enumerate(seqs):
        for j in range(nq):
            pos = kv_len - nq + j
            slots[int(query_start[s]) + j] = int(page_table[s, pos // page_size]) * page_size + pos % page_size
    return (q, *rope_case(rng, num_rows), new_latent, new_rope, latent_pages, rope_pages, jnp.asarray(slots), kv_lens,
            page_table, query_start, w_uk, w_uv)


def test_mla_entry_point_takes_the_kernel_for_every_row():
    """mla_attention_fn on the pallas_interpret backend (the kernel's decode call for the
    decode and verify rows, its prefill call for the prefill sequence) equals the
    reference backend (the absorbed and the expanded jnp forms) on a mixed step."""
    rng, seed = seeded()
    args = entry_point_args(rng, [(1, 9), (2, 3), (0, 0), (5, 11), (1, 1)])
    options = dict(sm_scale=0.3, rope_interleave=True)
    got, got_latent, got_rope = mla_attention_fn("pallas_interpret", decode_rows=2)(*args, **options)
    want, want_latent, _ = mla_attention_fn("reference", decode_rows=2)(*args, **options)
    np.testing.assert_array_equal(np.asarray(got_latent), np.asarray(want_latent))
    q, cos, sin, _, _, _, _, _, kv_lens, page_table, query_start, w_uk, w_uv = args
    q_rope = rotate(q[..., -DR:], cos, sin, True)
    _, bound = mla_float64(q[..., :-DR], q_rope, got_latent, got_rope, kv_lens, page_table, query_start, w_uk, w_uv,
                           0.3)
    assert_within(got, want, 2 * bound, f"seed={seed}")  # two float32 evaluations


def test_default_splits_keep_the_grid_within_two_waves_in_powers_of_two():
    """default_config's split count: the largest power of 2 that keeps a decode call's grid
    within two programs a multiprocessor (on the H200 a part-filled third wave cost up to
    36%), at most the context's 64-token steps and 128."""
    from jaxmtp.kernels.mla_attention import default_config

    for batch, rows, context, want in ((1, 1, 4096, 64), (1, 1, 16384, 128), (1, 1, 100, 2), (4, 1, 16384, 64),
                                       (32, 1, 4096, 8), (32, 2, 1024, 8), (128, 1, 4096, 2), (256, 1, 4096, 1)):
        config = default_config(batch * rows, batch, 16, rows, context)
        assert (config.block_q, config.block_h, config.num_splits) == (rows, 16, want), (batch, rows, context)


def test_auto_on_a_gpu_takes_the_measured_decode_path(monkeypatch):
    """"auto" on a GPU: the decode call at the tiling kernels/mla_paths.json gives its
    shape and buckets, XLA's absorbed form where the table says "xla", the kernel's
    default tiling where it has no entry; the prefill call is always the kernel's."""

    import jaxmtp.kernels.mla_attention as mk
    import jaxmtp.models.mla as mla

    rng, _ = seeded()
    seqs = [(1, 9), (2, 3), (5, 11), (1, 1)]  # 4 sequences: batch bucket 4
    args = entry_point_args(rng, seqs)
    context = args[9].shape[1] * args[5].shape[1]  # the page table's width in tokens
    calls = []

    def kernel(q_latent, *a, prefill, config, **kw):
        calls.append(("kernel", prefill, config))
        return jnp.zeros_like(q_latent)

    def reference(q_latent, *a, **kw):
        calls.append(("xla",))
        return jnp.zeros_like(q_latent)

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the GPU's choice, computed on the CPU
    monkeypatch.setattr(mla, "mla_absorbed_attention", kernel)
    monkeypatch.setattr(mla, "mla_absorbed_attention_reference", reference)
    tiling = MLAKernelConfig(2, 4, 16, 1, 4, 2)
    key = (HEADS, R, DR, 2, mk.row_bucket(context))
    for entry, want in ((tiling, ("kernel", False, tiling)), ("xla", ("xla",)), (None, ("kernel", False, None))):
        monkeypatch.setitem(mk.MEASURED_PATHS, key, {} if entry is None else {4: entry})
        calls.clear()
        mla_attention_fn("auto", decode_rows=2)(*args, sm_scale=0.3, rope_interleave=False)
        assert calls == [want, ("kernel", True, None)], (entry, calls)
    monkeypatch.setitem(mk.MEASURED_PATHS, key, {8: "xla"})  # another batch bucket's entry
    calls.clear()
    mla_attention_fn("auto", decode_rows=2)(*args, sm_scale=0.3, rope_interleave=False)
    assert calls[0] == ("kernel", False, None)


def test_engine_refuses_the_mla_kernel_for_sizes_it_cannot_tile(tmp_path):
    """At construction, before any weights load, naming the sizes."""
    import json

    from jaxmtp import LLM

    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 32,
              "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
              "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
              "kv_lora_rank": 16, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10, "vocab_size": 97,
              "max_position_embeddings": 64, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="qk_rope_head_dim powers of two >= 16, got 16 and 8"):
        LLM(tmp_path, load_format="dummy", attention_backend="pallas")


def test_a_deepseek_engine_on_the_mla_kernel_emits_the_reference_engines_tokens(tmp_path, rng, monkeypatch):
    """The whole engine with attention_backend pallas_interpret (the MLA kernel for every
    prefill, decode, verify and draft row, in interpret mode) against the jnp reference: a tiny
    DeepSeek-V3 with its MTP layer, k = 2, chunked prefill, a batch of a prefill and a
    decode: greedy tokens and per-position acceptance equal, the tokens' logprobs within
    float32 rounding. Then again with the prefill rows in the split form
    (kernels/mla_prefill.py, as its table would choose it: chunks after a cached prefix,
    which it expands a few tokens a pass)."""
    import jaxmtp.models.mla as mla
    from jaxmtp import LLM, SamplingParams
    from jaxmtp.kernels.mla_prefill import OwnRowsConfig
    from test_moe_models import random_prompt
    from conftest import prompt_logits
    from test_moe_mtp import ENGINE, L, make_mtp_checkpoint
    from tolerances import assert_within, logprob_bound

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    runs, logprobs, engines = {}, {}, {}

    def run(backend: str, folder, prompts, name: str | None = None) -> None:
        # a budget of 8 tokens (a chunk and a verify): fewer step shapes to compile in interpret mode
        llm = LLM(folder, attention_backend=backend, num_speculative_tokens=2, prefill_chunk_size=5,
                  **{**ENGINE, "max_num_batched_tokens": 8})
        name = name or backend
        engines[name] = llm.engine
        assert llm.engine.runner.step_config.attention_backend == backend
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[name] = [(o.outputs[0].token_ids, o.spec_stats["accepted_per_position"]) for o in outs]
        logprobs[name] = [[next(iter(e.values())).logprob for e in o.outputs[0].logprobs] for o in outs]

    # a checkpoint whose drafts are accepted somewhere, so that the per-position acceptance
    # compared below says something: a random one can fall into a loop of one token that
    # its MTP layer never drafts (seed 880571809 did), and then the next seed is drawn
    for attempt in range(3):
        seed = int(rng.integers(1 << 30))
        # head dims the split form's own-rows kernel tiles (powers of 2 >= 16)
        folder = make_mtp_checkpoint(tmp_path / f"ds{attempt}", "deepseek-qlora-yarn", seed, qk_rope_head_dim=16,
                                     qk_nope_head_dim=16, v_head_dim=16)[0]
        prompts = [random_prompt(rng, 13), random_prompt(rng, 9)]
        run("reference", folder, prompts)
        if sum(sum(accepted) for _, accepted in runs["reference"]) > 0:
            break
    assert sum(sum(accepted) for _, accepted in runs["reference"]) > 0, (f"seed={seed}", runs["reference"])
    run("pallas_interpret", folder, prompts)
    assert runs["pallas_interpret"] == runs["reference"], f"seed={seed}"
    # two float32 evaluations of the model's logprobs, each within logprob_bound of exact
    # (L main layers; sums of at most 64 terms, as test_moe_mtp.latent_bound says)
    logits = np.concatenate([prompt_logits(engines["reference"], p + tokens[:-1])
                             for p, (tokens, _) in zip(prompts, runs["reference"])])
    assert_within(logprobs["pallas_interpret"], logprobs["reference"], 2 * logprob_bound(logits, L, 64), f"seed={seed}")
    split_calls = []
    # the prefix expanded 4 tokens a pass: a chunk after 10 prompt tokens takes 3 passes
    split = OwnRowsConfig(16, 16, 4, 2, prefix_window=4)
    monkeypatch.setattr(mla, "measured_prefill_path", lambda *a: split_calls.append(a) or split)
    jax.clear_caches()  # the step was traced with the absorbed prefill call: trace it again
    run("pallas_interpret", folder, prompts, name="split")
    assert split_calls and runs["split"] == runs["reference"], f"seed={seed}"
    assert_within(logprobs["split"], logprobs["reference"], 2 * logprob_bound(logits, L, 64), f"seed={seed}")


def test_routed_fp8_experts_pass_their_scales_to_the_grouped_calls():
    """moe.routed_experts with fp8 expert weights (Fp8Weight, as the loader gives them):
    the kernels stream them with their scales and equal the references, which multiply
    the dequantized experts in float32; both within twice one evaluation's bound of
    float64 on the dequantized weights."""
    from jaxmtp.models.params import Fp8Weight

    rng, seed = seeded()
    t, h, inter, num_experts, k, block = 12, 32, 32, 4, 2, (16, 16)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    q_gu, s_gu, gate_up = fp8_experts(rng, (num_experts, h, 2, inter), block)
    q_dn, s_dn, down = fp8_experts(rng, (num_experts, inter, h), block)
    experts = np.stack([rng.choice(num_experts, size=k, replace=False) for _ in range(t)])
    routing = Routing(jnp.asarray(experts, jnp.int32), jnp.asarray(rng.random((t, k)), jnp.float32))
    fp8_gate_up, fp8_down = Fp8Weight(q_gu, s_gu, (1, *block[:1], 1, block[1])), Fp8Weight(q_dn, s_dn, (1, *block))

    got, want = routed_through_kernels_and_references(x, routing, fp8_gate_up, fp8_down)
    exact, bound, _ = experts_float64(x, experts, routing.weights, gate_up, down)
    assert_within(got, exact, 2 * bound, f"seed={seed}")
    assert_within(want, exact, 2 * bound, f"seed={seed} reference")


@pytest.mark.parametrize("k_major", [False, True], ids=["k-by-n", "k-major"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fp8_grouped_kernels_lower_for_the_gpu(dtype, k_major):
    """The Triton lowering of both fp8 grouped kernels, from the CPU (what interpret mode
    does not check: the fp8 load, its transpose K-major, its conversion, the scale
    gathers)."""

    lhs = jax.ShapeDtypeStruct((24, 256), dtype)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
    for shape, scales, fn in [((4, 256, 2, 96), (4, 2, 2, 1), gm.grouped_swiglu_kernel),
                              ((4, 256, 96), (4, 2, 1), gm.grouped_matmul_kernel)]:
        shape = shape[:1] + shape[2:] + shape[1:2] if k_major else shape
        q, s = jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn), jax.ShapeDtypeStruct(scales, jnp.float32)
        lowered = jax.jit(lambda a, q, g, s: fn(a, q, g, scale_inv=s, scale_block=(128, 128), k_major=k_major)
                          ).trace(lhs, q, sizes, s)
        assert "triton" in lowered.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_mla_kernel_lowers_for_the_gpu_at_moonlight_shapes(prefill):
    """Both calls through the Triton lowering, from the CPU (what interpret mode does not
    check: the tile shapes Triton accepts), at Moonlight's MLA (16 heads, R 512, rope 64,
    bf16, pages of 16): a decode batch of 32 and a 2048-row prefill chunk, the query's
    rope part rotated in the kernel from the whole projection (Dn 128 + Dr 64), as the
    engine calls it."""

    num_rows, num_seqs = (2048, 1) if prefill else (32, 32)
    shapes = [((num_rows, 16, 512), jnp.bfloat16), ((num_rows, 16, 192), jnp.bfloat16),
              ((256, 16, 1, 512), jnp.bfloat16), ((256, 16, 1, 64), jnp.bfloat16), ((num_seqs,), jnp.int32),
              ((num_seqs, 128), jnp.int32), ((num_seqs + 1,), jnp.int32), ((num_rows, 32), jnp.bfloat16),
              ((num_rows, 32), jnp.bfloat16)]
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]

    def fn(*a):
        return mla_absorbed_attention(*a[:7], sm_scale=0.1, decode_rows=1, prefill=prefill, rope_tables=a[7:],
                                      rope_interleave=True)

    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mla_prefill_attention" in text if prefill else "mla_decode_attention" in text
    assert ("merge_splits" in text) == (not prefill)  # the decode call's 8 splits merged by the kernel


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_merged_rows_match_float64_and_place_the_rows(dtype):
    """triton_common.merged_rows (interpret mode): 5 splits' partial results of 6 q-block
    rows x 3 heads, some splits empty (maximum -inf, sum 0), merged in float64 with the
    overall maximum; output rows placed from their partial rows (one read twice, one
    row -1: zeros). float32: each split's exp2 weight, the weighted sums over the splits
    and the division, a few roundings per split (8 u a split bounds them); bfloat16: and
    the output's rounding, bf16's unit roundoff 2^-8 (an 8-bit significand)."""
    rng, seed = seeded()
    splits, parts, heads = 5, 6, 3
    row_max = rng.uniform(-4, 4, (splits, parts * heads))
    row_max[rng.random(row_max.shape) < 0.3] = -np.inf
    # no row empty in every split: each has one split of its own drawn finite again
    kept = rng.integers(0, splits, parts * heads)
    row_max[kept, np.arange(parts * heads)] = rng.uniform(-4, 4, parts * heads)
    empty = np.isinf(row_max)
    row_sum = np.where(empty, 0.0, rng.uniform(0.5, 4, row_max.shape))
    acc = np.where(empty[..., None], 0.0, rng.standard_normal((splits, parts * heads, R)))
    part_rows = np.array([2, -1, 0, 5, 5, 3])
    overall = row_max.max(axis=0)
    weight = np.exp2(row_max - overall)
    merged = (weight[..., None] * acc).sum(axis=0) / (weight * row_sum).sum(axis=0)[:, None]
    want = np.zeros((len(part_rows) * heads, R))
    for t, part in enumerate(part_rows):
        if part >= 0:
            want[t * heads:(t + 1) * heads] = merged[part * heads:(part + 1) * heads]
    got = merged_rows(jnp.asarray(acc, jnp.float32), jnp.asarray(row_max, jnp.float32), jnp.asarray(row_sum, jnp.float32),
                      jnp.asarray(part_rows, jnp.int32), num_heads=heads, dtype=dtype, interpret=True)
    assert got.dtype == dtype and got.shape == want.shape
    bound = 8 * splits * 2.0**-24 + (2.0**-8 if dtype == jnp.bfloat16 else 0)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=bound, atol=bound * np.abs(want).max(),
                               err_msg=f"seed={seed}")
    assert not np.asarray(got, np.float64)[heads:2 * heads].any()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_paired_kernels_lower_for_the_gpu_at_moonlight_shapes(fp8):
    """Both paired kernels through the Triton lowering, from the CPU, at Moonlight's
    experts (64 of 2048 x 1408; fp8 in 128 x 128 blocks) for one token's 6 pairs."""

    x, groups = jax.ShapeDtypeStruct((1, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((6,), jnp.int32)
    rows, act = jax.ShapeDtypeStruct((6,), jnp.int32), jax.ShapeDtypeStruct((6, 1408), jnp.bfloat16)
    dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    calls = [(gm.paired_swiglu_kernel, x, (64, 2048, 2, 1408), (64, 16, 2, 11), (rows,)),
             (gm.paired_matmul_kernel, act, (64, 1408, 2048), (64, 11, 16), ())]
    for fn, lhs, shape, scales, extra in calls:
        w = jax.ShapeDtypeStruct(shape, dtype)
        if fp8:
            s = jax.ShapeDtypeStruct(scales, jnp.float32)
            traced = jax.jit(lambda a, w, g, s, *r: fn(a, w, g, *r, scale_inv=s, scale_block=(128, 128))).trace(
                lhs, w, groups, s, *extra)
        else:
            traced = jax.jit(lambda a, w, g, *r: fn(a, w, g, *r)).trace(lhs, w, groups, *extra)
        assert "paired_" in traced.lower(lowering_platforms=("cuda",)).as_text()
