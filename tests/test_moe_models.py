"""DeepSeek-V3 (MLA + MoE) and GLM-4.5 (GQA + MoE) against transformers on CPU: tiny
random models built here, with routing that uses the groups and the correction bias."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import ROOT, hf_logits_bound, prompt_logits
from jaxmtp import LLM, SamplingParams
from jaxmtp.models.registry import load_config
from jaxmtp.models.moe import route
from tolerances import assert_within, logits_bound

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 10000.0}

MOE_SHAPE = dict(n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
                 moe_intermediate_size=16, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True)

FAMILIES = {
    # q_lora, YaRN with mscale != mscale_all_dim (cos/sin and softmax scale both corrected), interleaved rope
    "deepseek-qlora-yarn": dict(model_type="deepseek_v3", q_lora_rank=24, rope_parameters=YARN, rope_interleave=True),
    # unnormalised top-k weights still scaled: a scale applied only with norm_topk_prob shows
    "deepseek-no-qlora": dict(model_type="deepseek_v3", q_lora_rank=None, rope_interleave=False, norm_topk_prob=False,
                              routed_scaling_factor=1.7),
    "glm4-moe": dict(model_type="glm4_moe", head_dim=16, num_key_value_heads=2, use_qk_norm=True, attention_bias=True,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
}


def make_moe_model(path, family: str, seed: int, num_layers: int = 3, max_shard_size="50GB", fixed_routing=False,
                   **overrides):
    """Save a tiny random model of one family with transformers; returns its folder
    and the torch model. Norms away from 1 and a random e_score_correction_bias, so
    that a missed norm or bias shows. fixed_routing: the bias 3 * 2^i over a random
    permutation i of the experts: any two sets of experts' biases then differ by 3 or
    more, more than any group's sigmoid scores, so every token picks the same groups
    and experts, with its own scores as their weights."""
    import transformers

    spec = {**MOE_SHAPE, **FAMILIES[family], **overrides}
    model_type = spec.pop("model_type")
    shape = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=num_layers,
                 num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2,
                 bos_token_id=1, eos_token_id=2)
    if model_type == "deepseek_v3":
        shape.update(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10)
    config = transformers.AutoConfig.for_model(model_type, **{**shape, **spec})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(3.0 * 2.0 ** torch.randperm(b.numel()).reshape(b.shape) if fixed_routing else 0.3 * torch.randn_like(b))
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return path, model


def random_prompt(rng, length):
    return [1] + rng.integers(3, 97, size=length - 1).tolist()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_greedy_match_transformers(tmp_path, rng, family):
    seed = int(rng.integers(1 << 30))
    # GLM's weights in shards with an index file, as the real checkpoints ship
    folder, hf = make_moe_model(tmp_path / family, family, seed, max_shard_size="40KB" if family == "glm4-moe" else "50GB")
    assert (folder / "model.safetensors.index.json").is_file() == (family == "glm4-moe")
    ids = random_prompt(rng, 42)  # 11 pages of 4, 6 chunks of 8
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].float().numpy()
        hf_out = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                             pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist()
    llm = LLM(folder, max_num_seqs=2, max_num_batched_tokens=16, page_size=4, prefill_chunk_size=8)
    # 3 layers summing at most 48 terms (the dense MLP; the prompt's 42 positions)
    assert_within(prompt_logits(llm.engine, ids), expected, logits_bound(expected, 3, 48), f"seed={seed}")
    out = llm.generate([ids], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_out, f"seed={seed}"

    # the test means something: the bias and the group limit change which experts rows
    # go to in the first MoE layer (every token's embedding and 512 random rows of the
    # same scale, so that for no seed do all rows route alike by chance)
    cfg, moe = llm.engine.model_config, llm.engine.params.layers[1].moe
    assert moe.shared_in_experts == 1, "the shared expert runs as the routed experts' first group"
    embed = np.asarray(llm.engine.params.embed)
    x = jnp.asarray(np.concatenate([embed, embed.std() * rng.standard_normal((512, embed.shape[1]))]), embed.dtype)
    chosen = np.sort(np.asarray(route(x, moe.router, moe.router_bias, cfg.moe).experts))
    unbiased = np.sort(np.asarray(route(x, moe.router, 0 * moe.router_bias, cfg.moe).experts))
    every_group = dataclass_replace(cfg.moe, topk_group=cfg.moe.n_group)
    ungrouped = np.sort(np.asarray(route(x, moe.router, moe.router_bias, every_group).experts))
    # a random bias can outweigh every score and route all rows alike (seen once in CI):
    # the group limit must then change the unbiased routing
    unbiased_ungrouped = np.sort(np.asarray(route(x, moe.router, 0 * moe.router_bias, every_group).experts))
    groups_matter = (chosen != ungrouped).any() or (unbiased != unbiased_ungrouped).any()
    assert (chosen != unbiased).any() and groups_matter, f"seed={seed}"


def dataclass_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def test_mla_cache_holds_the_latent_only(tmp_path, rng):
    """Bytes per token per layer: (kv_lora_rank + qk_rope_head_dim) values, not
    2 * heads * head_dim; the MTP layer adds one more cache layer of the same size."""
    folder, _ = make_moe_model(tmp_path / "ds", "deepseek-qlora-yarn", seed=int(rng.integers(1 << 30)), num_layers=2)
    for k, layers in ((0, 2), (2, 3)):
        cache = LLM(folder, max_num_seqs=1, max_num_batched_tokens=8, page_size=4, num_speculative_tokens=k,
                    load_format="dummy").engine.cache
        per_token = sum(x.nbytes for x in cache.k + cache.v) / cache.num_slots
        assert per_token == layers * (16 + 8) * 4, (k, per_token)


def test_transformers_4_config_reads_as_transformers_5(tmp_path, rng):
    """DeepSeek-V3's and GLM-4.5's config.json as transformers 4 wrote them (rope_theta
    and rope_scaling with "type"; partial_rotary_factor at the top level) give the
    same ModelConfig as transformers 5's rope_parameters."""
    for family in ("deepseek-qlora-yarn", "glm4-moe"):
        folder, _ = make_moe_model(tmp_path / family, family, seed=int(rng.integers(1 << 30)), num_layers=2)
        hf = json.loads((folder / "config.json").read_text())
        v5 = load_config(folder)
        rope = hf.pop("rope_parameters")
        hf["rope_theta"] = rope.pop("rope_theta")
        if "partial_rotary_factor" in rope:
            hf["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
        rope["type"] = rope.pop("rope_type")
        hf["rope_scaling"] = None if rope["type"] == "default" else rope
        if family.startswith("deepseek"):
            hf.update(topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1)
        (folder / "config.json").write_text(json.dumps(hf))
        v4 = load_config(folder)
        assert v4.rope_inv_freq().tolist() == v5.rope_inv_freq().tolist()
        assert v4.rope_attention_factor() == v5.rope_attention_factor()
        assert dataclass_replace(v4, rope_scaling=()) == dataclass_replace(v5, rope_scaling=())


@pytest.mark.parametrize("field, value, message", [
    ("topk_method", "group_limited_greedy", "topk_method='group_limited_greedy'"),
    ("scoring_func", "softmax", "scoring_func='softmax'"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("quantization_config", {"quant_method": "fp8"}, "quantization_config"),
    ("attention_bias", True, "attention_bias=True"),
    ("n_group", 3, "n_group=3"),
    ("topk_group", 5, "topk_group=5"),
    ("num_experts_per_tok", 7, "num_experts_per_tok=7"),
])
def test_unsupported_config_values_are_refused_by_name(tmp_path, rng, field, value, message):
    folder, _ = make_moe_model(tmp_path / "ds", "deepseek-no-qlora", seed=1, num_layers=2)
    hf = json.loads((folder / "config.json").read_text())
    hf[field] = value
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_config(folder)


# The config.json files of DeepSeek-V3 (its fp8 quantization_config left out: fp8
# weights are not implemented) and GLM-4.5-Air, as they ship
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
    "max_position_embeddings": 163840, "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True,
    "bos_token_id": 0, "eos_token_id": 1, "pretraining_tp": 1, "tie_word_embeddings": False, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": False, "attention_dropout": 0.0, "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16",
    "ep_size": 1,
}

# zai-org/GLM-4.5-Air-FP8's config.json (benchmarks/moe.py's GLM model), without its fp8 quantization_config
GLM_45_AIR_CONFIG = {key: value for key, value in json.loads(
    (ROOT / "benchmarks" / "configs" / "GLM-4.5-Air-FP8.json").read_text()).items() if key != "quantization_config"}


@pytest.mark.parametrize("hf_config, main, mtp", [
    (DEEPSEEK_V3_CONFIG, 671.03e9, 11.61e9),  # "671B main model, 14B MTP module" (with its embedding and head)
    (GLM_45_AIR_CONFIG, 106.85e9, 2.375e9),  # "106B total"; 110B in the safetensors with the MTP layer
])
def test_real_configs_give_the_published_parameter_counts(tmp_path, hf_config, main, mtp):
    """Every weight's shape, from the real config.json files (no weights): the parameter
    counts their model cards give. load_format="dummy" builds these shapes."""
    import dataclasses
    import math

    import jax

    from jaxmtp.models.params import param_shapes
    from jaxmtp.worker.sharding import check_divisible

    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    cfg = load_config(tmp_path)
    shapes = param_shapes(cfg)

    def count(tree):
        return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))

    assert count(dataclasses.replace(shapes, mtp=[])) == pytest.approx(main, rel=1e-4)
    assert count(shapes.mtp) == pytest.approx(mtp, rel=1e-3)
    check_divisible(cfg, 8)  # heads, experts and every intermediate split over the 8 GPUs they ship for
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's num_(kv_)?heads="):
        check_divisible(cfg, 3)


def test_llama_with_yarn_matches_transformers(tmp_path, rng):
    """YaRN on a dense body: frequencies and the attention factor on cos and sin."""
    from conftest import make_hf_model

    seed = int(rng.integers(1 << 30))
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}
    folder = make_hf_model(tmp_path / "llama-yarn", "llama", seed, rope_parameters=yarn)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert hf.model.rotary_emb.attention_scaling != 1.0
    ids = random_prompt(rng, 40)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
    llm = LLM(folder, max_num_seqs=1, max_num_batched_tokens=64, page_size=4)
    assert_within(prompt_logits(llm.engine, ids), expected, hf_logits_bound(expected), f"seed={seed}")


def test_bfloat16_deepseek_within_bf16_tolerance(tmp_path, rng):
    """bf16 weights and latent cache, the router kept float32: no further from the
    float32 logits than transformers' own bf16 run (a bf16 router would move more).
    With routing that rounding cannot change: where bf16 flips one token's expert choice
    (in either run, at random), that row and the rows attending to it move by far more
    than rounding does. Compared on the mean error: the worst logit's has a heavy tail
    over random models. The mean's ratio to transformers' stayed under 1.15 over 40
    seeds; a latent cache rounded to fp8 gives 2.4 to 3.4."""
    seed = int(rng.integers(1 << 30))
    folder, hf = make_moe_model(tmp_path / "ds", "deepseek-qlora-yarn", seed, fixed_routing=True)
    ids = random_prompt(rng, 30)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
        theirs = np.abs(hf.to(torch.bfloat16)(torch.tensor([ids])).logits[0].float().numpy() - expected).mean()
    llm = LLM(folder, dtype="bfloat16", max_num_seqs=2, max_num_batched_tokens=16, page_size=4, prefill_chunk_size=8)
    moe = llm.engine.params.layers[1].moe
    assert (str(llm.engine.cache.k[0].dtype), str(moe.router.dtype), str(moe.router_bias.dtype)) == ("bfloat16", "float32", "float32")
    ours = np.abs(prompt_logits(llm.engine, ids) - expected).mean()
    assert ours <= 1.3 * theirs, (ours, theirs, seed)


def test_an_mla_step_has_no_conditional_and_a_decode_batch_no_prefill_call(tmp_path, rng, monkeypatch):
    """An MLA layer chooses its calls statically: a decode-only shape (every request at
    most k + 1 rows) traces the decode call alone, a shape that takes prefill rows both,
    and neither program has a conditional (XLA:GPU runs one from the host: two a layer
    when the calls were branches)."""
    from jaxmtp.models import mla

    folder, _ = make_moe_model(tmp_path / "ds", "deepseek-qlora-yarn", seed=int(rng.integers(1 << 30)), num_layers=2)
    runner = LLM(folder, max_num_seqs=2, max_num_batched_tokens=8, page_size=4, load_format="dummy").engine.runner
    expanded, traced, compiled = mla.mla_expanded_attention_reference, [], {}
    monkeypatch.setattr(mla, "mla_expanded_attention_reference", lambda *a, **kw: traced.append(1) or expanded(*a, **kw))
    for longest_run in (1, 3):
        traced.clear()
        shape = runner.buckets.shape_for(4, 2, longest_run=longest_run)
        compiled[shape.decode_only] = (runner.lower_step(shape).compile().as_text(), len(traced))
    assert compiled[True][1] == 0 and compiled[False][1] > 0
    assert not any(" conditional(" in text for text, _ in compiled.values())
