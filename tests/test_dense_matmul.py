"""The dense weight-streaming matmul (jaxmtp/kernels/fp8_matmul.py, `dense_matmul`): the
Pallas kernel in interpret mode against a float64 NumPy product on shapes whose edge
tiles are partial, with and without split-K; its measured table; and linear()'s choice
between it and XLA's dot (XLA's on the CPU, bit for bit as before)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp.kernels import fp8_matmul as kernel_module
from jaxmtp.kernels.fp8_matmul import DENSE_TILINGS, MatmulConfig, dense_matmul, dense_tiling
from jaxmtp.models import linear as linear_module

F32_EPS = float(np.finfo(np.float32).eps)


def float64_product(x, w):
    return np.einsum("mk,kpn->mpn", np.asarray(x.astype(jnp.float32), np.float64),
                     np.asarray(w.astype(jnp.float32), np.float64))


def accumulation_bound(x, w):
    """Per output element: K * eps_f32 * sum_k |x_mk| |w_kn|. Products of bfloat16 or
    float16 inputs are exact in float32 and float32 ones round once at full precision;
    a float32 sum of K terms (in any order, split-K partials included) is off by at most
    (K - 1) * eps/2 of the summed magnitudes, and one product rounding adds eps/2."""
    return x.shape[1] * F32_EPS * float64_product(jnp.abs(x), jnp.abs(w))


# (M, K, P, N, config, dtype): one row and a partial row tile; columns past N; the last
# K step partial (K not a multiple of block_k); gate/up-style column groups; split-K with
# float32 partials; float32 inputs multiplied at full precision (HIGHEST); row tiles
# below the MMA's 16
CASES = [
    (1, 96, 1, 40, MatmulConfig(16, 32, 4, 3, block_k=32, split_k=1), jnp.bfloat16),
    (20, 100, 2, 48, MatmulConfig(16, 32, 4, 3, block_k=32, split_k=2), jnp.bfloat16),
    (33, 128, 1, 64, MatmulConfig(32, 32, 4, 3, block_k=16, split_k=4), jnp.float16),
    (5, 72, 1, 24, MatmulConfig(16, 16, 4, 3, block_k=16, split_k=5), jnp.float32),
    # fewer rows than an MMA tile: products on the vector units, one and two row tiles
    (1, 100, 1, 40, MatmulConfig(1, 32, 4, 3, block_k=32, split_k=2), jnp.bfloat16),
    (6, 64, 2, 24, MatmulConfig(4, 16, 4, 3, block_k=16, split_k=1), jnp.float32),
]


@pytest.mark.parametrize("m, k, parts, n, config, dtype", CASES)
def test_kernel_in_interpret_mode_is_a_float32_accumulation(rng, m, k, parts, n, config, dtype):
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, parts, n)) / np.sqrt(k), dtype)
    exact = float64_product(x, w)
    got = np.asarray(dense_matmul(x, w, out_dtype=jnp.float32, interpret=True, config=config), np.float64)
    assert (np.abs(got - exact) <= accumulation_bound(x, w)).all()
    # in x's dtype: the float32 result rounded once (half an ulp of the dtype, plus the bound)
    rounded = np.asarray(dense_matmul(x, w, interpret=True, config=config))
    assert rounded.dtype == np.dtype(dtype)
    half_ulp = np.abs(exact) * float(jnp.finfo(dtype).eps) / 2 + float(jnp.finfo(dtype).tiny)
    assert (np.abs(rounded.astype(np.float64) - exact) <= half_ulp * 1.01 + 2 * accumulation_bound(x, w)).all()


def test_bad_inputs_are_named():
    x = jnp.zeros((2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="do not fit"):
        dense_matmul(x, jnp.zeros((64, 1, 32), jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="split_k=3 does not divide the 4 K steps"):
        dense_matmul(x, jnp.zeros((64, 1, 32), jnp.bfloat16), interpret=True,
                     config=MatmulConfig(16, 32, 4, 3, block_k=16, split_k=3))


@pytest.mark.parametrize("m, config", [(64, MatmulConfig(64, 64, 4, 3, block_k=64, split_k=5)),
                                       (2, MatmulConfig(2, 64, 4, 3, block_k=64, split_k=5))])
def test_kernel_lowers_for_the_gpu(m, config):
    """The Triton lowering of a split-K tiling with a partial last K step, in MMA tiles
    and on the vector units, from the CPU."""
    x = jax.ShapeDtypeStruct((m, 300), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((300, 2, 200), jnp.bfloat16)
    lowered = jax.jit(lambda x, w: dense_matmul(x, w, config=config)).trace(x, w)
    assert "triton" in lowered.lower(lowering_platforms=("cuda",)).as_text()


def test_the_table_names_its_shapes_rows_and_dtype_only():
    down = (14336, 1, 4096)
    assert dense_tiling(64, down, jnp.bfloat16) == DENSE_TILINGS[down][64]
    assert dense_tiling(33, down, jnp.bfloat16) == DENSE_TILINGS[down][64]  # rows round up to the bucket
    assert dense_tiling(32, down, jnp.bfloat16) is None  # XLA's dot was as fast at 32 rows
    assert dense_tiling(64, down, jnp.float32) is None  # measured in bfloat16 only
    assert dense_tiling(64, (4096, 1, 4096), jnp.bfloat16) is None  # o_proj: XLA's was as fast inside the step
    qkv = (4096, 1, 6144)  # q, k and v merged (qkv_layout.with_merged_qkv)
    assert [dense_tiling(m, qkv, jnp.bfloat16) is not None for m in (8, 32, 64, 128, 256)] == [False] + [True] * 4
    for (k, _, _), by_rows in DENSE_TILINGS.items():
        for config in by_rows.values():
            assert -(-k // config.block_k) % config.split_k == 0


@pytest.fixture
def tiny_table(monkeypatch):
    """A table entry for a tiny shape (8 rows: the 16-row bucket), split three ways over K."""
    shape = (48, 1, 40)
    monkeypatch.setitem(kernel_module.DENSE_TILINGS, shape, {16: MatmulConfig(16, 16, 4, 3, block_k=16, split_k=3)})
    return shape


def test_linear_on_the_cpu_is_xla_dot_bit_for_bit(rng, tiny_table):
    k, _, n = tiny_table
    x = jnp.asarray(rng.standard_normal((8, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    expected = jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())))
    assert not linear_module.dense_kernels_for("auto", None)  # a CPU
    np.testing.assert_array_equal(np.asarray(linear_module.linear(x, w)), np.asarray(expected))


@pytest.mark.parametrize("backend, devices, routed", [("auto", None, True), ("pallas", 1, True),
                                                     ("reference", None, False), ("auto", 2, False)])
def test_linear_takes_the_table_on_one_gpu_with_pallas_kernels_only(rng, tiny_table, monkeypatch, backend, devices,
                                                                     routed):
    """On a GPU (faked), on one device (no mesh), with an attention backend that picks
    Pallas kernels, the table's shape goes through the kernel, with its bias added to
    the float32 accumulator; with the reference backend or a mesh of two devices (tensor
    parallelism), XLA's dot. devices: the step's mesh size (None: no mesh)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    calls = []

    def interpreted(*args, **kwargs):  # the kernel as the CPU can run it, counted
        calls.append(kwargs["config"])
        return dense_matmul(*args, **kwargs, interpret=True)

    monkeypatch.setattr(linear_module, "dense_matmul", interpreted)
    k, _, n = tiny_table
    x = jnp.asarray(rng.standard_normal((8, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(n), jnp.bfloat16)
    mesh = None if devices is None else types.SimpleNamespace(size=devices)
    with linear_module.dense_kernels(linear_module.dense_kernels_for(backend, mesh)):
        got = np.asarray(linear_module.linear(x, w, bias).astype(jnp.float32), np.float64)
    assert bool(calls) == routed
    exact = float64_product(x, w[:, None, :])[:, 0] + np.asarray(bias.astype(jnp.float32), np.float64)
    half_ulp = np.abs(exact) * float(jnp.finfo(jnp.bfloat16).eps) / 2
    assert (np.abs(got - exact) <= half_ulp * 1.01 + 2 * accumulation_bound(x, w[:, None, :])[:, 0]).all()
