"""Parity with transformers on CPU: tiny random models of every supported family."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import (FAMILIES, HF_MODEL_LAYERS, HF_MODEL_WIDEST_SUM, fresh_rng, hf_logits_bound, make_hf_model,
                      prompt_logits)
from jaxmtp import LLM, SamplingParams
from tolerances import assert_within, rounded_activations_bound


def hf_logits(folder, ids, dtype=torch.float32):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy(), model


def assert_rounded_like_transformers(ours, truth, theirs, unit_roundoff: float) -> None:
    """Logits of activations rounded to a narrower float after float32 sums, against the
    float32 truth: within tolerances.rounded_activations_bound, or, where this random
    model amplifies rounding past first order (weights of std 0.3 make sharp attention),
    within twice the error transformers' own run at that precision shows (the same
    rounding of the same values, amplified alike); and rounded (at least a tenth of
    transformers' error on average: a float32 run is a hundred times closer)."""
    ours, theirs = np.abs(ours - truth), np.abs(theirs - truth)
    first_order = rounded_activations_bound(float(np.abs(truth).max()), HF_MODEL_LAYERS, HF_MODEL_WIDEST_SUM,
                                            unit_roundoff)
    assert ours.max() <= max(first_order, 2 * theirs.max()), (ours.max(), first_order, theirs.max())
    assert ours.mean() > theirs.mean() / 10, (ours.mean(), theirs.mean())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_greedy_match_transformers(tmp_path, rng, family):
    folder = make_hf_model(tmp_path / family, family, seed=int(rng.integers(1 << 30)))
    ids = [1] + rng.integers(3, 97, size=int(rng.integers(12, 30))).tolist()
    expected, hf = hf_logits(folder, ids)
    llm = LLM(folder, max_num_seqs=2, max_num_batched_tokens=64, page_size=4)
    assert_within(prompt_logits(llm.engine, ids), expected, hf_logits_bound(expected), family)

    with torch.no_grad():
        hf_out = hf.generate(
            torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
            pad_token_id=0, eos_token_id=None,
        )[0, len(ids):].tolist()
    out = llm.generate([ids], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_out


def test_bfloat16_logits_within_bf16_tolerance(tmp_path, rng):
    folder = make_hf_model(tmp_path / "llama", "llama", seed=int(rng.integers(1 << 30)))
    ids = [1] + rng.integers(3, 97, size=20).tolist()
    expected, _ = hf_logits(folder, ids)
    hf_bf16, _ = hf_logits(folder, ids, torch.bfloat16)
    llm = LLM(folder, dtype="bfloat16", max_num_seqs=2, max_num_batched_tokens=64)
    assert str(llm.engine.params.embed.dtype) == "bfloat16"
    got = prompt_logits(llm.engine, ids)
    assert_rounded_like_transformers(got, expected, hf_bf16, 2.0**-8)
    # and bf16 checkpoints load as bf16 by default
    bf16_folder = make_hf_model(tmp_path / "llama-bf16", "llama", seed=3, dtype="bfloat16")
    assert LLM(bf16_folder, max_num_seqs=1).engine.model_config.dtype == "bfloat16"


# Llama's optional biases (attention_bias: q, k, v and o_proj; mlp_bias: gate, up and
# down) and an activation other than silu, all read from config.json
BIASED_GELU = dict(attention_bias=True, mlp_bias=True, hidden_act="gelu")


@pytest.fixture(scope="module")
def biased_gelu_model(tmp_path_factory):
    seed = int(fresh_rng().integers(1 << 30))
    return make_hf_model(tmp_path_factory.mktemp("biased") / "llama", "llama", seed=seed, **BIASED_GELU), seed


def test_mlp_bias_attention_bias_and_gelu_match_transformers(biased_gelu_model, rng):
    folder, seed = biased_gelu_model
    ids = [1] + rng.integers(3, 97, size=24).tolist()
    expected, hf = hf_logits(folder, ids)
    llm = LLM(folder, max_num_seqs=2, max_num_batched_tokens=64, page_size=4)
    cfg, layer = llm.engine.model_config, llm.engine.params.layers[0]
    assert (cfg.hidden_act, cfg.mlp_bias, cfg.o_bias, cfg.qkv_bias) == ("gelu", True, True, True)
    assert layer.o_bias is not None and layer.gate_up_bias.shape == (2, cfg.intermediate_size)
    assert_within(prompt_logits(llm.engine, ids), expected, hf_logits_bound(expected), f"seed={seed}")
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, min_new_tokens=16,
                             pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist()
    out = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_out


def test_q_k_and_v_merged_into_one_weight_give_the_same_model(tmp_path, biased_gelu_model, rng, monkeypatch):
    """Where the step may take the dense kernel (one GPU), the runner holds each layer's
    q, k and v, and their biases, side by side (qkv_layout.with_merged_qkv): the logits of
    transformers all the same, written apart again by export, and the shipped MTP model's
    golden output with its drafts (the module's layer merged too)."""
    import safetensors.numpy

    from conftest import MTP_MODEL, golden_ids
    from jaxmtp.loading.loader import export_hf_checkpoint
    from jaxmtp.worker import param_layouts

    monkeypatch.setattr(param_layouts, "dense_kernels_for", lambda backend, mesh: True)
    folder, seed = biased_gelu_model
    ids = [1] + rng.integers(3, 97, size=24).tolist()
    expected, _ = hf_logits(folder, ids)
    llm = LLM(folder, max_num_seqs=2, max_num_batched_tokens=64, page_size=4)
    cfg, layer = llm.engine.model_config, llm.engine.params.layers[0]
    merged = cfg.q_size + 2 * cfg.kv_size
    assert layer.k_proj is None and layer.q_proj.shape == (cfg.hidden_size, merged) and layer.q_bias.shape == (merged,)
    assert_within(prompt_logits(llm.engine, ids), expected, hf_logits_bound(expected), f"seed={seed}")
    # checkpoints hold them apart, as loaded
    export_hf_checkpoint(tmp_path / "export", llm.engine.params, cfg, folder)
    written = safetensors.numpy.load_file(tmp_path / "export" / "model.safetensors")
    loaded = safetensors.numpy.load_file(folder / "model.safetensors")
    for name in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "v_proj.bias"):
        name = f"model.layers.1.self_attn.{name}"
        np.testing.assert_array_equal(written[name], loaded[name])
    spec = LLM(MTP_MODEL, num_speculative_tokens=2, max_num_seqs=2, max_num_batched_tokens=32)
    assert spec.engine.params.mtp[0].block.k_proj is None
    out = spec.generate([[1]], SamplingParams(max_tokens=200, temperature=0.0), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == golden_ids() and out.spec_stats["accepted"] > 0


def test_a_float16_checkpoint_runs_in_float16_within_float16_rounding(tmp_path, biased_gelu_model, rng):
    """torch_dtype float16 loads as float16 (dtype "auto") and runs so. The truth is the
    same float16 weights computed in float32 (transformers); ours rounds its activations
    to float16 (assert_rounded_like_transformers)."""
    folder = make_hf_model(tmp_path / "fp16", "llama", seed=biased_gelu_model[1], dtype="float16", **BIASED_GELU)
    ids = [1] + rng.integers(3, 97, size=24).tolist()
    expected, _ = hf_logits(folder, ids)  # the float16 weights, exactly, computed in float32
    hf_fp16, _ = hf_logits(folder, ids, torch.float16)
    llm = LLM(folder, max_num_seqs=2, max_num_batched_tokens=64, page_size=4)
    assert llm.engine.model_config.dtype == "float16" and llm.engine.params.embed.dtype == np.float16
    assert llm.engine.cache.k[0].dtype == np.float16
    assert_rounded_like_transformers(prompt_logits(llm.engine, ids), expected, hf_fp16, 2.0**-11)


def test_every_hidden_act_is_transformers_activation():
    """Each activation is x g(x) with |g| <= 1 (relu: exact): a float32 evaluation errs by
    at most NONLINEAR_ROUNDING |x|, so two lie within twice that."""
    from transformers.activations import ACT2FN

    from tolerances import NONLINEAR_ROUNDING

    from jaxmtp.models.config import HIDDEN_ACTIVATIONS
    from jaxmtp.models.layers import ACTIVATIONS

    assert set(ACTIVATIONS) == set(HIDDEN_ACTIVATIONS)
    x = np.linspace(-6, 6, 1001, dtype=np.float32)
    for name, fn in ACTIVATIONS.items():
        expected = ACT2FN[name](torch.tensor(x)).numpy()
        assert_within(np.asarray(fn(x)), expected, 2 * NONLINEAR_ROUNDING * np.abs(x), name)
