"""Gated DeltaNet's Pallas kernels (kernels/gated_delta.py) beyond their numbers (which
tests/test_gated_delta.py checks against float64, in interpret mode, beside the jnp
forms): their Triton lowering at Qwen3-Next's shapes (what interpret mode does not
check), the backend's choice of the kernels or the jnp forms, and the hybrid layer
running its recurrence through the chosen forms."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fresh_rng
from test_gated_delta import KERNELS, NUM_SLOTS, SPLIT_COLUMNS

from jaxmtp.kernels import gated_delta as kg
from jaxmtp.models import delta_rule as dr
from jaxmtp.models import gated_delta as gd
from jaxmtp.models.config import HybridConfig
from jaxmtp.worker.sharding import make_mesh


def test_kernels_lower_to_triton_at_qwen3_next_shapes():
    """Both kernels through the Triton lowering, from the CPU: Qwen3-Next's linear heads
    (16 key heads of 128, 32 value heads of 128), bfloat16 rows, a verify batch of 8
    requests keeping 4 states and a prefill in 64-row chunks."""
    shape = jax.ShapeDtypeStruct
    rows, requests, hk, hv, d = 32, 8, 16, 32, 128
    args = (shape((rows, hk, d), jnp.bfloat16), shape((rows, hk, d), jnp.bfloat16), shape((rows, hv, d), jnp.bfloat16),
            shape((rows, hv), jnp.float32), shape((rows, hv), jnp.float32), shape((NUM_SLOTS, hv, d, d), jnp.float32),
            shape((requests + 1,), jnp.int32), shape((requests,), jnp.int32), shape((requests,), bool))
    forms = [("gated_delta_recurrent", lambda *a: gd.gated_delta_recurrent(*a, 4, kg.scan_rows_kernel)),
             ("gated_delta_scan_chunks", lambda *a: gd.gated_delta_chunked(*a, gd.CHUNK, kg.scan_chunks_kernel))]
    for name, fn in forms:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text and name in text, name


def test_a_tiling_whose_column_blocks_do_not_tile_the_state_is_refused():
    """block_dv must divide dv: the grid has dv // block_dv blocks, so the columns past
    them would be left unwritten."""
    q, v, gate = jnp.zeros((2, 4, 16)), jnp.zeros((2, 4, 24)), jnp.zeros((2, 4))
    state, query_start, slots = jnp.zeros((3, 4, 16, 24)), jnp.array([0, 2], jnp.int32), jnp.zeros(1, jnp.int32)
    with pytest.raises(ValueError, match="block_dv 16 does not divide linear_value_head_dim 24"):
        kg.scan_rows_kernel(q, q, v, gate, gate, state, query_start, slots, jnp.ones(1, bool), 1, interpret=True)


def hybrid_config(dk: int, dv: int) -> HybridConfig:
    return HybridConfig(("linear_attention", "full_attention"), 2, 4, dk, dv, 4)


def test_the_backend_picks_the_forms(monkeypatch):
    """reference, and auto off the GPU: the jnp forms (under a mesh too: XLA partitions
    them); pallas_interpret: the kernels; auto on a GPU: the kernel only at the shapes and
    sizes the measured table gives it, with its tiling; pallas and pallas_interpret refuse
    sizes the kernels cannot tile, by name."""
    cfg = hybrid_config(16, 32)
    assert dr.delta_rule_fn("reference", cfg) == dr.DeltaRule()
    assert dr.delta_rule_fn("auto", cfg) == dr.DeltaRule()  # on the CPU
    assert dr.delta_rule_fn("reference", cfg, mesh=make_mesh(1)) == dr.DeltaRule()
    assert dr.delta_rule_fn("pallas_interpret", cfg).over_rows.func is kg.scan_rows_kernel
    assert dr.delta_rule_fn("pallas_interpret", cfg).across_chunks.func is kg.scan_chunks_kernel
    refusal = "linear_key_head_dim and linear_value_head_dim powers of two >= 16, got 8 and 12"
    for backend in ("pallas", "pallas_interpret"):
        with pytest.raises(ValueError, match=refusal):
            dr.delta_rule_fn(backend, hybrid_config(8, 12))
    with pytest.raises(ValueError, match="unknown attention backend 'triton'"):
        dr.delta_rule_fn("triton", cfg)

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the GPU's choice, computed on the CPU
    monkeypatch.setitem(kg.MEASURED_PATHS, (0, 4, 16, 32), {8: SPLIT_COLUMNS, 16: "xla"})
    assert kg.measured_tiling("rows", 4, 16, 32, 5) == SPLIT_COLUMNS  # 5 requests: bucket 8
    assert kg.measured_tiling("rows", 4, 16, 32, 9) is None  # XLA's was faster
    assert kg.measured_tiling("rows", 4, 16, 32, 64) is None  # not measured
    assert kg.measured_tiling("chunks", 4, 16, 32, 5) is None
    calls = []
    monkeypatch.setattr(kg, "scan_rows_kernel", lambda *a, config: calls.append(config) or "kernel")
    rule = dr.delta_rule_fn("auto", cfg)
    state = jnp.zeros((NUM_SLOTS, 4, 16, 32))

    def run(requests: int):
        rows = jnp.zeros((requests, 4, 16)), jnp.zeros((requests, 4, 16)), jnp.zeros((requests, 4, 32))
        gates = jnp.zeros((requests, 4)), jnp.zeros((requests, 4))
        starts = jnp.arange(requests + 1, dtype=jnp.int32)
        return rule.over_rows(*rows, *gates, state, starts, jnp.zeros(requests, jnp.int32), jnp.ones(requests, bool), 1)

    assert run(5) == "kernel" and calls == [SPLIT_COLUMNS]
    o, tail = run(9)  # the jnp form
    assert o.shape == (9, 4, 32) and tail.shape == (9, 1, 4, 16, 32) and calls == [SPLIT_COLUMNS]


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
        in_proj_qkvz=weight(hidden, hk, la.qkvz_group_width, scale=0.3),
        in_proj_ba=weight(hidden, hk, 2 * r, scale=0.3),
        conv1d=weight(hk, la.conv_group_width, 4, scale=0.5), a_log=jnp.log(jnp.asarray(rng.uniform(0.02, 0.1, hv))),
        dt_bias=jnp.zeros(hv), norm=weight(16), out_proj=weight(hv * 16, hidden, scale=0.2))
    query_start = jnp.array([0, 9, 12], jnp.int32)
    batch = types.SimpleNamespace(query_start=query_start, input_ids=jnp.zeros(16, jnp.int32),
                                  positions=jnp.array([*range(9), 20, 21, 22, 0, 0, 0, 0]),
                                  recurrent_slot=jnp.asarray(slots, jnp.int32))
    conv = weight(4, keep, 3, hk * la.conv_group_width)
    ssm = weight(4, keep, hv, 16, 16)
    seen = {}

    def recorded(name, fn):
        def call(*args):
            seen[name] = (args, fn(*args))
            return seen[name][1]
        return call

    rule = dr.DeltaRule(recorded("rows", KERNELS.over_rows), recorded("chunks", KERNELS.across_chunks))
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


def test_a_hybrid_engine_on_the_kernels_emits_the_reference_engines_tokens(tmp_path, rng):
    """The whole engine with attention_backend pallas_interpret (the gated delta kernels
    for every linear-attention layer's prefill bulk and its decode, verify and draft
    rows, the GQA kernel for the full-attention ones, in interpret mode) against the jnp
    reference: a tiny dense Qwen3.5 with its MTP layer (heads of 16, as the kernels
    tile), k = 2, prompts in chunks of 5, a batch of a prefill and a decode. Greedy
    tokens and per-position acceptance equal up to the first step whose top two tokens
    the reference holds within NEAR_TIE of each other (two float32 evaluations may order
    those either way); from there on nothing is compared."""
    from jaxmtp import LLM, SamplingParams
    from test_hybrid_engine import NEAR_TIE, long_memory
    from test_hybrid_models import make_hybrid

    seed = int(rng.integers(1 << 30))
    folder, _ = make_hybrid(tmp_path / "qwen3_5", "qwen3_5", np.random.default_rng(seed), adjust=long_memory,
                            head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16)
    prompts = [rng.integers(3, 128, 13).tolist(), rng.integers(3, 128, 6).tolist()]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = {}
    for backend in ("reference", "pallas_interpret"):
        # a budget of 8 tokens (a chunk and a verify): fewer step shapes to compile in interpret mode
        llm = LLM(folder, attention_backend=backend, num_speculative_tokens=2, prefill_chunk_size=5, page_size=4,
                  max_num_seqs=2, max_num_batched_tokens=8, max_model_len=40, dtype="float32")
        assert llm.engine.runner.step_config.attention_backend == backend
        runs[backend] = llm.generate(prompts, params, use_tqdm=False)
    for ref, got in zip(runs["reference"], runs["pallas_interpret"]):
        want, have = ref.outputs[0].token_ids, got.outputs[0].token_ids
        same = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), len(want))
        if same < len(want):
            top_two = sorted((lp.logprob for lp in ref.outputs[0].logprobs[same].values()), reverse=True)[:2]
            assert top_two[0] - top_two[1] < NEAR_TIE, f"seed={seed}: tokens part at {same} without a near-tie"
    accepted = [o.spec_stats["accepted_per_position"] for o in runs["reference"]]
    if all(r.outputs[0].token_ids == g.outputs[0].token_ids for r, g in zip(*runs.values())):
        assert accepted == [o.spec_stats["accepted_per_position"] for o in runs["pallas_interpret"]], f"seed={seed}"


SPLIT_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jaxmtp.models import delta_rule as dr
from jaxmtp.models import gated_delta as gd
from jaxmtp.models.config import HybridConfig
from jaxmtp.worker.sharding import make_mesh
rng = np.random.default_rng(int(sys.argv[1]))
hk, hv, d, slots = 2, 4, 16, 5
cfg = HybridConfig(("linear_attention", "full_attention"), hk, hv, d, d, 4)
query_start = jnp.array([0, 5, 7, 70], jnp.int32)  # the last request's 63 rows: two 64-row chunks with the others'
rows = int(query_start[-1]) + 2  # two padding rows
q, k = (jnp.asarray(rng.standard_normal((rows, hk, d)), jnp.float32) for _ in range(2))
v = jnp.asarray(rng.standard_normal((rows, hv, d)), jnp.float32)
g = -jnp.asarray(rng.uniform(0.01, 0.5, (rows, hv)), jnp.float32)
beta = jnp.asarray(rng.uniform(0.1, 0.9, (rows, hv)), jnp.float32)
state = jnp.asarray(0.1 * rng.standard_normal((slots, hv, d, d)), jnp.float32)
args = (q, k, v, g, beta, state, query_start, jnp.array([4, 1, 2], jnp.int32), jnp.array([False, True, False]))
out = {}
for name, rule in (("one", dr.delta_rule_fn("pallas_interpret", cfg)),
                   ("split", dr.delta_rule_fn("pallas_interpret", cfg, make_mesh(2)))):
    recurrent = jax.jit(lambda *a: gd.gated_delta_recurrent(*a, 3, rule.over_rows))(*args)
    chunked = jax.jit(lambda *a: gd.gated_delta_chunked(*a, gd.CHUNK, rule.across_chunks))(*args)
    out[name] = [np.asarray(x).tolist() for x in (*recurrent, *chunked)]
print(json.dumps({"equal": out["one"] == out["split"], "finite": bool(np.isfinite(out["one"][0]).all())}))
"""


def test_the_kernels_split_over_two_devices_give_one_devices_numbers(rng):
    """Both kernels' forms through shard_over_value_heads on two forced CPU devices (each
    with one key head and its two value heads, their states and tails) against the same
    kernels on one device, bitwise: a head's rows never meet another's, so a device's
    kernel computes exactly what the whole one does for its heads (interpret mode; the
    engine's TP runs use the jnp forms on the CPU)."""
    from conftest import run_on_cpu_devices

    seed = int(rng.integers(1 << 30))
    result = run_on_cpu_devices(["-c", SPLIT_SCRIPT, str(seed)], 2)
    assert result == {"equal": True, "finite": True}, f"seed={seed}"
