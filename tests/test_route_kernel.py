"""The routing kernel (kernels/route.py: the router's choice and the pairs' counting sort
in one program; interpret mode on the CPU) against the jnp path it stands for
(jaxmtp.models.moe: choose, without_rows_from, sort_pairs), its Triton lowering at the
shipped MoE shapes, and moe_ffn's dispatch to it.

Random inputs are fresh per test (the seed is in every failure message)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp.kernels import route as route_kernel
from jaxmtp.models import moe
from test_moe_kernels import moe_config as grouped_moe_config
from test_moe_kernels import seeded

# Weights: the kernel's sigmoid (or softmax) and XLA's round differently, and the k
# weights' sum and the division after it add about k + 2 roundings: 16 float32 ulps
# of relative error bound both for k <= 8.
WEIGHT_RTOL = 16 * 2.0**-24

# (rows, experts, k, routing, norm_topk_prob, real rows, first expert held, experts held, logits on a grid,
#  shared experts held as the first groups)
CASES = [
    (8, 64, 6, "noaux_tc", True, 1, 0, 64, False, 0),  # Moonlight's batch-1 step: 1 real row of 8
    (8, 64, 6, "noaux_tc", True, 1, 0, 64, False, 2),  # the same with its 2 shared experts as groups
    (8, 128, 8, "noaux_tc", True, 8, 0, 128, True, 1),  # GLM-4.5-Air's 64 pairs (and its shared one), ties in every row
    (5, 16, 4, "softmax", False, 5, 0, 16, False, 0),  # Qwen's softmax, unnormalised, 20 pairs
    (7, 16, 4, "noaux_tc", True, 3, 0, 16, True, 3),  # 3 shared groups, 4 padding rows
    (6, 32, 4, "noaux_tc", False, 4, 8, 8, True, 0),  # a device's 8 of 32 experts (expert parallel), 2 padding rows
]


def moe_config(experts: int, k: int, routing: str, norm: bool):
    """test_moe_kernels' config without group limits (what the kernel routes), scaled by 2.5."""
    return dataclasses.replace(grouped_moe_config(experts, k, n_group=1, topk_group=1, norm=norm), routing=routing)


@pytest.mark.parametrize("rows, experts, k, routing, norm, real, first, held, grid, shared", CASES)
def test_kernel_routes_and_sorts_as_the_jnp_path(rows, experts, k, routing, norm, real, first, held, grid, shared):
    """Group sizes and each sorted pair's row equal the jnp path's (a stable argsort of
    the pairs by expert, shared groups first); the weights within WEIGHT_RTOL. Logits on
    a grid of 0.25 tie experts within a row: both take the lower expert first
    (lax.top_k's rule). The pairs past the groups (padding rows', experts held
    elsewhere) add nothing, in an order of their own; every place is written once: the
    same (row, weight) pairs as the jnp path's there."""
    rng, seed = seeded()
    logits = rng.standard_normal((rows, experts))
    if grid:
        logits = np.round(logits * 4) / 4
    logits = jnp.asarray(logits, jnp.float32)
    # noaux_tc's bias steers the choice; zero where the grid's ties are the point
    bias = None if routing == "softmax" else jnp.asarray(0.0 if grid else 0.3 * rng.standard_normal(experts),
                                                          jnp.float32) * jnp.ones(experts, jnp.float32)
    cfg = moe_config(experts, k, routing, norm)
    chosen = moe.choose(logits, bias, cfg).with_shared_experts(shared).without_rows_from(real)
    want = moe.sort_pairs(chosen, first, shared + held)
    sizes, got_rows, weights = route_kernel.route_and_sort(
        logits, bias, real, first, k=k, num_held=shared + held, shared=shared, sigmoid=routing != "softmax",
        norm_topk_prob=norm, scaling=cfg.routed_scaling_factor, interpret=True)
    np.testing.assert_array_equal(np.asarray(sizes), np.asarray(want.group_sizes), f"seed={seed}")
    grouped = int(np.sum(np.asarray(sizes)))
    assert grouped == real * shared + min(real * k, grouped - real * shared), f"seed={seed}"
    np.testing.assert_array_equal(np.asarray(got_rows)[:grouped], np.asarray(want.rows)[:grouped], f"seed={seed}")
    np.testing.assert_allclose(np.asarray(weights)[:grouped], np.asarray(want.weights)[:grouped], rtol=WEIGHT_RTOL,
                               atol=0, err_msg=f"seed={seed}")

    def past_groups(rows_, weights_):
        return sorted(zip(np.asarray(rows_)[grouped:].tolist(), np.asarray(weights_)[grouped:].tolist()))

    got_rest, want_rest = past_groups(got_rows, weights), past_groups(want.rows, want.weights)
    assert [r for r, _ in got_rest] == [r for r, _ in want_rest], f"seed={seed}"
    np.testing.assert_allclose([w for _, w in got_rest], [w for _, w in want_rest], rtol=WEIGHT_RTOL, atol=0,
                               err_msg=f"seed={seed}")


def test_more_pairs_than_one_program_sorts_are_refused():
    logits = jnp.zeros((9, 16), jnp.float32)
    with pytest.raises(ValueError, match="at most 64 pairs, got 9 rows x 8"):
        route_kernel.route_and_sort(logits, None, 9, 0, k=8, num_held=16, sigmoid=True, norm_topk_prob=True,
                                    scaling=1.0, interpret=True)


@pytest.mark.parametrize("rows, experts, k, shared", [(8, 64, 6, 2), (8, 128, 8, 0)], ids=["moonlight", "glm-4.5-air"])
def test_kernel_lowers_for_the_gpu_at_the_moe_shapes(rows, experts, k, shared):
    """Through the Triton lowering, from the CPU (what interpret mode does not check: the
    tile shapes and operations Triton accepts), at a batch-1 step's 8 rows."""
    fn = functools.partial(route_kernel.route_and_sort, k=k, num_held=shared + experts, shared=shared, sigmoid=True,
                           norm_topk_prob=True, scaling=2.5)
    args = (jax.ShapeDtypeStruct((rows, experts), jnp.float32), jax.ShapeDtypeStruct((experts,), jnp.float32),
            jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
    assert "route_and_sort" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_moe_ffn_takes_the_kernel_where_the_table_names_it(monkeypatch):
    """moe_ffn routes through the kernel where routes_in_kernel says so (here made to,
    in interpret mode) and gives the jnp path's output: padding rows through the shared
    experts alone, the real rows' experts as chosen. routes_in_kernel itself: never off
    a GPU, never with group-limited routing or past MAX_PAIRS pairs, else the table."""
    rng, seed = seeded()
    cfg = moe_config(16, 4, "noaux_tc", True)
    h, inter = 32, 16
    params = moe.MoEParams(
        router=jnp.asarray(rng.standard_normal((h, 16)), jnp.float32),
        router_bias=jnp.asarray(0.1 * rng.standard_normal(16), jnp.float32),
        experts_gate_up=jnp.asarray(0.3 * rng.standard_normal((16, h, 2, inter)), jnp.float32),
        experts_down=jnp.asarray(0.3 * rng.standard_normal((16, inter, h)), jnp.float32),
        shared_gate_up=jnp.asarray(0.3 * rng.standard_normal((h, 2, inter)), jnp.float32),
        shared_down=jnp.asarray(0.3 * rng.standard_normal((inter, h)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((8, h)), jnp.float32)
    want = moe.moe_ffn(params, cfg, x, num_rows=3)
    calls = []

    def interpreted(*args, **kwargs):
        calls.append(args[0].shape)
        return route_kernel.route_and_sort(*args, **kwargs, interpret=True)

    monkeypatch.setattr(moe, "routes_in_kernel", lambda *args: True)
    monkeypatch.setattr(moe, "route_and_sort", interpreted)
    got = moe.moe_ffn(params, cfg, x, num_rows=3)
    assert calls == [(8, 16)]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6, err_msg=f"seed={seed}")

    monkeypatch.setattr(route_kernel.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(route_kernel, "ROUTE_PATHS", {(16, 4): {32: "kernel", 64: "xla"}})
    assert route_kernel.routes_in_kernel(32, 16, 4, grouped=False)
    assert not route_kernel.routes_in_kernel(64, 16, 4, grouped=False)  # the table's "xla"
    assert not route_kernel.routes_in_kernel(32, 16, 4, grouped=True)
    assert not route_kernel.routes_in_kernel(32, 16, 8, grouped=False)  # a shape not measured
    monkeypatch.setattr(route_kernel, "ROUTE_PATHS", {(16, 4): {128: "kernel"}})
    assert not route_kernel.routes_in_kernel(72, 16, 4, grouped=False)  # past MAX_PAIRS
