"""Gated DeltaNet's Pallas kernels (kernels/gated_delta.py; interpret mode on the CPU)
against the float64 NumPy evaluation of tests/test_gated_delta.py, with its derived
bounds (the kernels compute the same float32 arithmetic in another order): ragged
batches with padding requests and rows, fresh requests whose table rows hold NaN, tails
shorter than keep, and state columns split over programs. Then their Triton lowering at
Qwen3-Next's shapes (what interpret mode does not check), the backend's choice of the
kernels or the jnp forms, and the hybrid layer running its recurrence through the chosen
forms."""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fresh_rng
from test_gated_delta import (
    DV, NUM_SLOTS, RAGGED, RAGGED_ROWS, assert_close, commit, delta_float64, delta_inputs, layout, tables,
)

from jaxmtp.kernels import gated_delta as kg
from jaxmtp.models import gated_delta as gd
from jaxmtp.models.config import HybridConfig

SPLIT = kg.DeltaKernelConfig(block_dv=DV // 2, num_warps=4, num_stages=1)  # two programs per head
KERNEL_CHUNK = 4  # chunks of 4 rows: requests of 1 to 17 rows take 1 to 5 chunks


def kernel_forms(config: kg.DeltaKernelConfig | None) -> gd.DeltaRule:
    return gd.DeltaRule(functools.partial(kg.scan_rows_kernel, interpret=True, config=config),
                        functools.partial(kg.scan_chunks_kernel, interpret=True, config=config))


@pytest.mark.parametrize("config", [SPLIT, None], ids=["split-columns", "default"])
def test_recurrent_kernel_matches_float64(config):
    rng = fresh_rng()
    lay = layout(rng, RAGGED)
    _, state = tables(rng, lay)
    inputs = delta_inputs(rng, RAGGED_ROWS, lay.query_start[-1])
    want, out_bound, histories, state_bound = delta_float64(*inputs, state, lay)
    keep = 4  # requests of 1 and 3 rows: tails that start with their starting state
    o, tail = gd.gated_delta_recurrent(*inputs, state, *lay, keep, kernel_forms(config).over_rows)
    assert_close(o, want, out_bound, "outputs")  # zeros, exactly, on padding rows
    for b in range(len(lay.slots)):
        n = lay.lengths[b]
        want_tail = histories[b][[max(n - keep + i + 1, 0) for i in range(keep)]]
        assert_close(tail[b], want_tail, state_bound[b], f"tail of request {b}")
    rejected = np.array([rng.integers(0, keep) for _ in lay.slots], np.int32)
    new_state = commit(state, tail, lay.slots, rejected, lay.lengths > 0)
    for b in np.flatnonzero(lay.lengths):
        assert_close(new_state[lay.slots[b]], histories[b][max(lay.lengths[b] - rejected[b], 0)], state_bound[b],
                     f"committed state of request {b}")


@pytest.mark.parametrize("config", [SPLIT, None], ids=["split-columns", "default"])
def test_chunk_scan_kernel_matches_float64(config):
    """The chunked form with the kernel's scan over chunks: requests side by side, each
    from its own first chunk; a padding request's final state is its starting one."""
    rng = fresh_rng()
    lay = layout(rng, RAGGED)
    _, state = tables(rng, lay)
    inputs = delta_inputs(rng, RAGGED_ROWS, lay.query_start[-1])
    want, out_bound, histories, state_bound = delta_float64(*inputs, state, lay, KERNEL_CHUNK)
    o, final = gd.gated_delta_chunked(*inputs, state, *lay, KERNEL_CHUNK, kernel_forms(config).across_chunks)
    assert_close(o, want, out_bound, "outputs")
    assert_close(final, np.stack([h[-1] for h in histories]), state_bound[:, None, None, None], "final states")


def test_kernels_lower_to_triton_at_qwen3_next_shapes():
    """Both kernels through the Triton lowering, from the CPU: Qwen3-Next's linear heads
    (16 key heads of 128, 32 value heads of 128), bfloat16 rows, a verify batch of 8
    requests keeping 4 states and a prefill in 64-row chunks."""
    shape = jax.ShapeDtypeStruct
    rows, requests, hk, hv, d = 32, 8, 16, 32, 128
    args = (shape((rows, hk, d), jnp.bfloat16), shape((rows, hk, d), jnp.bfloat16), shape((rows, hv, d), jnp.bfloat16),
            shape((rows, hv), jnp.float32), shape((rows, hv), jnp.float32), shape((NUM_SLOTS, hv, d, d), jnp.float32),
            shape((requests + 1,), jnp.int32), shape((requests,), jnp.int32), shape((requests,), bool))
    for name, fn in [("gated_delta_recurrent", lambda *a: gd.gated_delta_recurrent(*a, 4, kg.scan_rows_kernel)),
                     ("gated_delta_scan_chunks", lambda *a: gd.gated_delta_chunked(*a, gd.CHUNK, kg.scan_chunks_kernel))]:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text and name in text, name


def hybrid_config(dk: int, dv: int) -> HybridConfig:
    return HybridConfig(("linear_attention", "full_attention"), 2, 4, dk, dv, 4)


def test_the_backend_picks_the_forms(monkeypatch):
    """reference, and auto off the GPU or under a mesh: the jnp forms; pallas_interpret:
    the kernels; auto on a GPU: the kernel only at the shapes and sizes the measured table
    gives it, with its tiling; pallas refuses sizes the kernels cannot tile, by name."""
    cfg = hybrid_config(16, 32)
    assert gd.delta_rule_fn("reference", cfg) == gd.DeltaRule()
    assert gd.delta_rule_fn("auto", cfg) == gd.DeltaRule()  # on the CPU
    assert gd.delta_rule_fn("pallas_interpret", cfg, mesh=object()) == gd.DeltaRule()
    assert gd.delta_rule_fn("pallas_interpret", cfg).over_rows.func is kg.scan_rows_kernel
    assert gd.delta_rule_fn("pallas_interpret", cfg).across_chunks.func is kg.scan_chunks_kernel
    with pytest.raises(ValueError, match="linear_key_head_dim and linear_value_head_dim powers of two >= 16, got 8 and 12"):
        gd.delta_rule_fn("pallas", hybrid_config(8, 12))
    with pytest.raises(ValueError, match="unknown attention backend 'triton'"):
        gd.delta_rule_fn("triton", cfg)

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the GPU's choice, computed on the CPU
    monkeypatch.setitem(kg.MEASURED_PATHS, (0, 4, 16, 32), {8: SPLIT, 16: "xla"})
    assert kg.measured_tiling("rows", 4, 16, 32, 5) == SPLIT  # 5 requests: bucket 8
    assert kg.measured_tiling("rows", 4, 16, 32, 9) is None  # XLA's was faster
    assert kg.measured_tiling("rows", 4, 16, 32, 64) is None  # not measured
    assert kg.measured_tiling("chunks", 4, 16, 32, 5) is None
    calls = []
    monkeypatch.setattr(kg, "scan_rows_kernel", lambda *a, config: calls.append(config) or "kernel")
    rule = gd.delta_rule_fn("auto", cfg)
    state = jnp.zeros((NUM_SLOTS, 4, 16, 32))

    def run(requests: int):
        rows = jnp.zeros((requests, 4, 16)), jnp.zeros((requests, 4, 16)), jnp.zeros((requests, 4, 32))
        gates = jnp.zeros((requests, 4)), jnp.zeros((requests, 4))
        starts = jnp.arange(requests + 1, dtype=jnp.int32)
        return rule.over_rows(*rows, *gates, state, starts, jnp.zeros(requests, jnp.int32), jnp.ones(requests, bool), 1)

    assert run(5) == "kernel" and calls == [SPLIT]
    o, tail = run(9)  # the jnp form
    assert o.shape == (9, 4, 32) and tail.shape == (9, 1, 4, 16, 32) and calls == [SPLIT]


def test_the_hybrid_layer_runs_its_recurrence_through_the_chosen_forms():
    """hybrid.linear_attention with the kernels' forms (interpret mode) over a prefill
    chunk of 9 rows and a verify of 3, keeping 3 states: the chunk's first 6 rows go
    through the scan over chunks (the tail rows zeroed), whose final states start the
    recurrent form over each request's last rows (6 packed rows), whose tails are what
    the layer writes into the state table, bitwise."""
    from jaxmtp.models import hybrid
    from jaxmtp.models.params import LinearAttentionParams

    rng = fresh_rng()
    la = hybrid_config(16, 16)
    cfg = types.SimpleNamespace(hybrid=la, rms_norm_eps=1e-6)
    hidden, keep, slots = 32, 3, np.array([1, 3])
    hk, r, hv = la.linear_num_key_heads, la.value_heads_per_key, la.linear_num_value_heads

    def weight(*shape, scale=1.0):
        return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)

    p = LinearAttentionParams(
        in_proj_qkvz=weight(hidden, hk, la.qkvz_group_width, scale=0.3), in_proj_ba=weight(hidden, hk, 2 * r, scale=0.3),
        conv1d=weight(hk, la.conv_group_width, 4, scale=0.5), a_log=jnp.log(jnp.asarray(rng.uniform(0.02, 0.1, hv))),
        dt_bias=jnp.zeros(hv), norm=weight(16), out_proj=weight(hv * 16, hidden, scale=0.2))
    query_start = jnp.array([0, 9, 12], jnp.int32)
    batch = types.SimpleNamespace(query_start=query_start, input_ids=jnp.zeros(16, jnp.int32),
                                  positions=jnp.array([*range(9), 20, 21, 22, 0, 0, 0, 0]),
                                  recurrent_slot=jnp.asarray(slots, jnp.int32))
    conv = weight(4, keep, 3, hk * la.conv_group_width)
    ssm = weight(4, keep, hv, 16, 16)
    kernels, seen = kernel_forms(None), {}

    def recorded(name, fn):
        def call(*args):
            seen[name] = (args, fn(*args))
            return seen[name][1]
        return call

    rule = gd.DeltaRule(recorded("rows", kernels.over_rows), recorded("chunks", kernels.across_chunks))
    out, _, new_ssm = hybrid.linear_attention(p, cfg, weight(16, hidden), hybrid.recurrent_rows(batch, keep), conv,
                                              ssm, query_start, rule)
    assert np.isfinite(np.asarray(out)).all()
    terms, chunk_start, _, _, _ = seen["chunks"][0]
    assert np.asarray(chunk_start).tolist() == [0, 1, 2]  # 9 rows in one 64-row chunk, then the verify's
    assert not np.asarray(terms.u)[0, :, 6:].any()  # the chunk's last 3 rows (the tail) write nothing
    (*rows, start, tail_start, _, _, tail_keep), (_, tail) = seen["rows"]
    assert tail_keep == keep and np.asarray(tail_start).tolist() == [0, 3, 6] and rows[0].shape[0] == 2 * keep
    np.testing.assert_array_equal(start, seen["chunks"][1][1])
    np.testing.assert_array_equal(np.asarray(new_ssm)[slots], np.asarray(tail))
