"""Qwen3-Next and Qwen3.5 (issue 36: hybrid linear/full attention, their MTP layer), up to
the weights: config.json parsing of the published configs and every refusal by the field
it names; tiny checkpoints saved by transformers (plus mtp.* tensors written here, as the
releases ship them) loading into parameters equal to the stored tensors in the layouts
jaxmtp/models/params.py documents, whose linear-attention and gated-query splits are
transformers' own; fp8 and dummy weights; Qwen's MoE block against transformers'; and the
engine refusing to run them until the hybrid forward exists."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from conftest import fresh_rng
from jaxmtp import LLM
from jaxmtp.kernels.fp8_matmul import dequantize_blocks
from jaxmtp.loading.loader import load_params
from jaxmtp.models.moe import moe_ffn, route
from jaxmtp.models.params import Fp8Weight, MoEParams, param_shapes
from jaxmtp.models.registry import load_config
from jaxmtp.worker.sharding import make_mesh, param_shardings
from test_fp8 import dequantize, quantize
from tolerances import assert_within, reordered_model_bound


def every_fourth_full(n: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


# The published config.json files (vision_config, which the engine does not read, left
# out): Qwen/Qwen3-Next-80B-A3B-Instruct, which spells its layer pattern as
# full_attention_interval and declares no MTP layer though it ships mtp.*;
# Qwen/Qwen3.5-35B-A3B and Qwen/Qwen3.5-27B, the text model nested under text_config.
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151645, "full_attention_interval": 4, "head_dim": 256,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_next",
    "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512,
    "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2, "output_router_logits": False,
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.57.0.dev0", "use_cache": True, "vocab_size": 151936,
}
QWEN3_5_TEXT = {
    "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "bos_token_id": 248044,
    "dtype": "bfloat16", "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
    "initializer_range": 0.02, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_value_head_dim": 128, "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144,
    "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "output_gate_type": "swish",
    "pad_token_id": None, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                        "rope_theta": 10000000, "rope_type": "default"},
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 248320,
}
QWEN3_5_35B_A3B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "image_token_id": 248056, "model_type": "qwen3_5_moe",
    "tie_word_embeddings": False, "video_token_id": 248057, "vision_end_token_id": 248054,
    "vision_start_token_id": 248053,
    "text_config": {**QWEN3_5_TEXT, "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
                    "layer_types": every_fourth_full(40), "num_attention_heads": 16, "num_key_value_heads": 2,
                    "linear_num_value_heads": 32, "num_experts": 256, "num_experts_per_tok": 8,
                    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                    "router_aux_loss_coef": 0.001, "output_router_logits": False},
}
QWEN3_5_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": False,
    "text_config": {**QWEN3_5_TEXT, "model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408,
                    "num_hidden_layers": 64, "layer_types": every_fourth_full(64), "num_attention_heads": 24,
                    "num_key_value_heads": 4, "linear_num_value_heads": 48},
}


def write_config(folder, hf: dict):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf))
    return folder


@pytest.mark.parametrize("hf, heads, value_heads, experts, params", [
    (QWEN3_NEXT_80B, (16, 2), 32, (512, 10), 80e9),  # "80B in total"
    (QWEN3_5_35B_A3B, (16, 2), 32, (256, 8), 35e9),  # the text model of "35B" (a vision tower besides)
    (QWEN3_5_27B, (24, 4), 48, None, 27e9),
])
def test_published_configs_parse(tmp_path, hf, heads, value_heads, experts, params):
    cfg = load_config(write_config(tmp_path, hf))
    text = hf.get("text_config", hf)
    n = text["num_hidden_layers"]
    assert cfg.hybrid.layer_types == tuple(every_fourth_full(n)) and cfg.num_layers == n
    assert [cfg.layer_is_linear(i) for i in range(n + 1)] == [(i + 1) % 4 != 0 for i in range(n)] + [False]
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim) == (*heads, 256, 64)
    assert (cfg.hybrid.linear_num_key_heads, cfg.hybrid.linear_num_value_heads) == (16, value_heads)
    la = cfg.hybrid
    assert (la.linear_key_head_dim, la.linear_value_head_dim, la.linear_conv_kernel_dim) == (128, 128, 4)
    assert (cfg.num_mtp_modules, cfg.mtp_layout, cfg.zero_centred_norm, cfg.qk_norm) == (1, "qwen3_next", True, True)
    assert cfg.rope_theta == 1e7 and cfg.rope_scaling in ((), (("rope_type", "default"),)) and cfg.dtype == "bfloat16"
    if experts is None:
        assert cfg.moe is None
    else:
        moe = cfg.moe
        assert (moe.num_experts, moe.num_experts_per_tok) == experts and moe.routing == "softmax"
        assert (moe.shared_intermediate_size, moe.shared_expert_gate, moe.norm_topk_prob) == (512, True, True)
    hash(cfg)  # static under jit
    shapes = param_shapes(cfg)
    count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(dataclasses.replace(shapes, mtp=[])))
    assert count == pytest.approx(params, rel=0.02)


@pytest.mark.parametrize("field, value, message", [
    ("attention_bias", True, "attention_bias=True"),
    ("attn_output_gate", False, "attn_output_gate=False"),
    ("output_gate_type", "sigmoid", "output_gate_type='sigmoid'"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("mamba_ssm_dtype", "bfloat16", "mamba_ssm_dtype='bfloat16'"),
    ("mtp_use_dedicated_embeddings", True, "mtp_use_dedicated_embeddings=True"),
    ("mtp_num_hidden_layers", 2, "mtp_num_hidden_layers=2"),
    ("num_nextn_predict_layers", 3, "num_nextn_predict_layers=3 and mtp_num_hidden_layers=1 disagree"),
    ("decoder_sparse_step", 2, "decoder_sparse_step=2"),
    ("mlp_only_layers", [0], r"mlp_only_layers=\[0\]"),
    ("use_sliding_window", True, "use_sliding_window=true"),
    ("num_experts_per_tok", 0, "num_experts_per_tok=0"),
    ("linear_num_value_heads", 24, "linear_num_value_heads=24"),
    ("layer_types", ["sliding_attention"] * 4 + ["full_attention"] * 44, "layer_types="),
    ("layer_types", ["full_attention"] * 47, "layer_types="),
    ("full_attention_interval", 0, "full_attention_interval=0"),
])
def test_refusals_name_their_field(tmp_path, field, value, message):
    hf = {**QWEN3_NEXT_80B, "mtp_num_hidden_layers": 1, field: value}
    with pytest.raises(ValueError, match=message):
        load_config(write_config(tmp_path, hf))


# the tiny models: two key heads of 8 serving four value heads of 12 (Dk != Dv, so that
# a k/v mix-up shows), four attention heads of 8 over two kv heads
TEXT = dict(vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=12, linear_conv_kernel_dim=4, max_position_embeddings=64, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
              spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16)
FAMILIES = ("qwen3_next", "qwen3_5_moe", "qwen3_5")


def tiny_model(family: str, **fields):
    """Qwen3-Next as its release spells the pattern (full_attention_interval; 2 here);
    Qwen3.5-MoE as its release's class, the text model beside a vision tower; dense
    Qwen3.5 as the text model alone, an explicit layer_types. fields: TEXT's to change."""
    text = {**TEXT, **fields}
    if family == "qwen3_next":
        config = transformers.Qwen3NextConfig(**text, **EXPERTS, intermediate_size=48, full_attention_interval=2)
        return transformers.Qwen3NextForCausalLM(config)
    if family == "qwen3_5_moe":
        config = transformers.Qwen3_5MoeConfig(text_config={**text, **EXPERTS}, vision_config=VISION)
        return transformers.Qwen3_5MoeForConditionalGeneration(config)
    layer_types = ["linear_attention", "full_attention", "full_attention", "linear_attention"]
    return transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text, intermediate_size=48,
                                                                         layer_types=layer_types))


def make_hybrid(folder, family: str, rng, adjust=None, **fields):
    """A tiny random checkpoint of one family saved by transformers, every norm away from
    its initial value (so that a missed 1 + w shows), plus one MTP layer under mtp.*
    (vLLM's names): random fc and norms, and a full-attention layer. Qwen3.5-MoE's main
    layers get their experts fused into experts.gate_up_proj and experts.down_proj, as
    its release stores them (the MTP layer's stay one tensor per expert, as there).
    adjust(name, parameter), where given, may change each parameter in place before the
    save. fields: TEXT's to change. Returns the folder and the torch model."""
    torch.manual_seed(int(rng.integers(1 << 30)))
    model = tiny_model(family, **fields).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn_like(p))
            if adjust is not None:
                adjust(name, p)
    model.save_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    text = "model.language_model" if family == "qwen3_5_moe" else "model"
    full = next(i for i, kind in enumerate(model.config.get_text_config().layer_types) if kind == "full_attention")
    h = TEXT["hidden_size"]
    mtp = {f"mtp.layers.0{name[len(f'{text}.layers.{full}'):]}": 0.3 * rng.standard_normal(w.shape)
           for name, w in tensors.items() if name.startswith(f"{text}.layers.{full}.")}
    mtp.update({"mtp.fc.weight": 0.3 * rng.standard_normal((h, 2 * h)), "mtp.norm.weight": rng.standard_normal(h),
                "mtp.pre_fc_norm_embedding.weight": rng.standard_normal(h),
                "mtp.pre_fc_norm_hidden.weight": rng.standard_normal(h)})
    tensors.update({name: w.astype(np.float32) for name, w in mtp.items()})
    if family == "qwen3_5_moe":
        tensors = fuse_experts(tensors, text)
    save_file(tensors, str(folder / "model.safetensors"))
    hf = json.loads((folder / "config.json").read_text())
    if family == "qwen3_next":  # the release's spelling
        hf.pop("layer_types")
        hf["full_attention_interval"] = 2
    (folder / "config.json").write_text(json.dumps(hf))
    return folder, model


def fuse_experts(tensors: dict, text: str) -> dict:
    e = EXPERTS["num_experts"]
    for i in range(TEXT["num_hidden_layers"]):
        mlp = f"{text}.layers.{i}.mlp.experts"
        part = lambda n, name: tensors.pop(f"{mlp}.{n}.{name}.weight")  # noqa: E731
        pairs = [(part(n, "gate_proj"), part(n, "up_proj"), part(n, "down_proj")) for n in range(e)]
        tensors[f"{mlp}.gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u, _ in pairs])  # [E, 2I, H]
        tensors[f"{mlp}.down_proj"] = np.stack([d for _, _, d in pairs])  # [E, H, I]
    return tensors


def expected_params(tensors: dict, cfg) -> dict:
    """Every parameter the loader must make, by its path in Params, from the stored
    tensors and the layouts params.py documents (derived here by reshapes alone)."""
    text = "model.language_model" if "model.language_model.norm.weight" in tensors else "model"
    h = cfg.hidden_size
    fc = tensors["mtp.fc.weight"].T
    want = {".embed": tensors[f"{text}.embed_tokens.weight"], ".final_norm": 1 + tensors[f"{text}.norm.weight"],
            ".lm_head": tensors["lm_head.weight"].T, ".mtp[0].proj_token": fc[:h], ".mtp[0].proj_hidden": fc[h:],
            ".mtp[0].token_norm": 1 + tensors["mtp.pre_fc_norm_embedding.weight"],
            ".mtp[0].hidden_norm": 1 + tensors["mtp.pre_fc_norm_hidden.weight"],
            ".mtp[0].final_norm": 1 + tensors["mtp.norm.weight"]}
    layers = [(f"{text}.layers.{i}", f".layers[{i}]", cfg.layer_is_linear(i)) for i in range(cfg.num_layers)]
    for stored, path, linear in layers + [("mtp.layers.0", ".mtp[0].block", False)]:
        t = functools.partial(lambda prefix, name: tensors[f"{prefix}.{name}"], stored)
        layer = {"input_norm": 1 + t("input_layernorm.weight"), "post_norm": 1 + t("post_attention_layernorm.weight"),
                 **(expected_linear_attention(t, cfg) if linear else expected_gated_attention(t, cfg)),
                 **expected_mlp(t, stored, tensors, cfg)}
        want.update({f"{path}.{name}": w for name, w in layer.items()})
    return want


def expected_linear_attention(t, cfg) -> dict:
    la, h = cfg.hybrid, cfg.hidden_size
    hk, r, dk, dv = la.linear_num_key_heads, la.value_heads_per_key, la.linear_key_head_dim, la.linear_value_head_dim
    try:  # Qwen3-Next: grouped by key head as stored
        qkvz, ba = (t(f"linear_attn.in_proj_{name}.weight").T.reshape(h, hk, -1) for name in ("qkvz", "ba"))
    except KeyError:  # Qwen3.5: q, k, v of all heads, then z, b, a apart
        q, k, v = np.split(t("linear_attn.in_proj_qkv.weight").T, [hk * dk, 2 * hk * dk], axis=1)
        z, b, a = (t(f"linear_attn.in_proj_{name}.weight").T for name in ("z", "b", "a"))
        qkvz = np.concatenate([q.reshape(h, hk, dk), k.reshape(h, hk, dk), v.reshape(h, hk, r * dv),
                               z.reshape(h, hk, r * dv)], axis=2)
        ba = np.concatenate([b.reshape(h, hk, r), a.reshape(h, hk, r)], axis=2)
    conv = t("linear_attn.conv1d.weight")[:, 0]
    cq, ck, cv = np.split(conv, [hk * dk, 2 * hk * dk])
    conv = np.concatenate([cq.reshape(hk, dk, -1), ck.reshape(hk, dk, -1), cv.reshape(hk, r * dv, -1)], axis=1)
    return {f"linear_attention.{name}": w for name, w in dict(
        in_proj_qkvz=qkvz, in_proj_ba=ba, conv1d=conv, dt_bias=t("linear_attn.dt_bias"), a_log=t("linear_attn.A_log"),
        norm=t("linear_attn.norm.weight"), out_proj=t("linear_attn.out_proj.weight").T).items()}


def expected_gated_attention(t, cfg) -> dict:
    packed = t("self_attn.q_proj.weight").T.reshape(cfg.hidden_size, cfg.num_heads, 2, cfg.head_dim)
    h = cfg.hidden_size
    return {"q_proj": packed[:, :, 0].reshape(h, -1), "attn_gate": packed[:, :, 1].reshape(h, -1),
            "k_proj": t("self_attn.k_proj.weight").T, "v_proj": t("self_attn.v_proj.weight").T,
            "o_proj": t("self_attn.o_proj.weight").T, "q_norm": 1 + t("self_attn.q_norm.weight"),
            "k_norm": 1 + t("self_attn.k_norm.weight")}


def expected_mlp(t, stored: str, tensors: dict, cfg) -> dict:
    def gate_up(prefix):
        return np.stack([t(f"{prefix}.gate_proj.weight").T, t(f"{prefix}.up_proj.weight").T], axis=1)

    if cfg.moe is None:
        return {"gate_up_proj": gate_up("mlp"), "down_proj": t("mlp.down_proj.weight").T}
    e, h = cfg.moe.num_experts, cfg.hidden_size
    if f"{stored}.mlp.experts.gate_up_proj" in tensors:
        experts = (t("mlp.experts.gate_up_proj").transpose(0, 2, 1).reshape(e, h, 2, -1),
                   t("mlp.experts.down_proj").transpose(0, 2, 1))
    else:
        experts = (np.stack([gate_up(f"mlp.experts.{n}") for n in range(e)]),
                   np.stack([t(f"mlp.experts.{n}.down_proj.weight").T for n in range(e)]))
    return {f"moe.{name}": w for name, w in dict(
        router=t("mlp.gate.weight").T, experts_gate_up=experts[0], experts_down=experts[1],
        shared_gate_up=gate_up("mlp.shared_expert"), shared_down=t("mlp.shared_expert.down_proj.weight").T,
        shared_gate=t("mlp.shared_expert_gate.weight")[0]).items()}


def by_path(params) -> dict:
    return {jax.tree_util.keystr(path): leaf for path, leaf in
            jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, Fp8Weight))[0]}


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_loads_into_the_documented_layouts(tmp_path, rng, family):
    folder, model = make_hybrid(tmp_path / family, family, rng)
    cfg = load_config(folder)
    assert cfg.num_mtp_modules == 1 and (cfg.moe is None) == (family == "qwen3_5")
    params = load_params(folder, cfg)
    got, want = by_path(params), expected_params(load_file(str(folder / "model.safetensors")), cfg)
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for path, w in want.items():  # moved, and 1 + w as transformers adds it: equal, bit for bit
        assert got[path].dtype == jnp.float32 and np.array_equal(np.asarray(got[path]), w), path
    # the splits are transformers' own: its q/k/v/z/b/a and the conv over them, its query and gate
    text_model = model.model.language_model if family == "qwen3_5_moe" else model.model
    x = rng.standard_normal((9, cfg.hidden_size)).astype(np.float32)
    for i, hf_layer in enumerate(text_model.layers):
        ours = params.layers[i]
        if cfg.layer_is_linear(i):
            check_linear_inputs(hf_layer.linear_attn, ours.linear_attention, cfg, x)
        else:
            check_gated_query(hf_layer.self_attn, ours, cfg, x)


def check_linear_inputs(module, p, cfg, x):
    """q, k, v (after the conv and its SiLU), z, b and a: transformers' against ours."""
    la, t = cfg.hybrid, x.shape[0]
    hv, dv, dk, wc = la.linear_num_value_heads, la.linear_value_head_dim, la.linear_key_head_dim, la.conv_group_width
    with torch.no_grad():
        hidden = torch.from_numpy(x)[None]
        if hasattr(module, "in_proj_qkvz"):
            q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden), module.in_proj_ba(hidden))
            mixed = torch.cat([y.reshape(1, t, -1) for y in (q, k, v)], dim=-1)
        else:
            mixed, z = module.in_proj_qkv(hidden), module.in_proj_z(hidden).reshape(1, t, hv, dv)
            b, a = module.in_proj_b(hidden), module.in_proj_a(hidden)
        mixed = torch.nn.functional.silu(module.conv1d(mixed.transpose(1, 2))[..., :t]).transpose(1, 2)[0]
        q, k, v = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
        want = [y.reshape(t, -1).numpy() for y in (q, k, v, z[0], b[0], a[0])]
    x64 = x.astype(np.float64)
    proj = np.einsum("th,hgw->tgw", x64, np.asarray(p.in_proj_qkvz, np.float64))  # [T, Hk, W]
    taps = np.asarray(p.conv1d, np.float64)  # [Hk, Wc, K], the oldest tap first
    padded = np.concatenate([np.zeros((taps.shape[-1] - 1, *proj.shape[1:3])), proj], axis=0)[..., :wc]
    conv = sum(padded[j:j + t] * taps[..., j] for j in range(taps.shape[-1]))
    conv = conv / (1 + np.exp(-conv))
    ba = np.einsum("th,hgw->tgw", x64, np.asarray(p.in_proj_ba, np.float64))
    r = la.value_heads_per_key
    ours = [conv[..., :dk], conv[..., dk:2 * dk], conv[..., 2 * dk:], proj[..., wc:], ba[..., :r], ba[..., r:]]
    for name, got, w in zip("qkvzba", ours, want):
        assert_within(got.reshape(t, -1), w, reordered_model_bound(float(np.abs(w).max()), 1, x.shape[1]), name)


def check_gated_query(module, ours, cfg, x):
    with torch.no_grad():
        packed = module.q_proj(torch.from_numpy(x)).reshape(x.shape[0], cfg.num_heads, 2, cfg.head_dim).numpy()
    for got, w in ((x @ np.asarray(ours.q_proj), packed[:, :, 0]), (x @ np.asarray(ours.attn_gate), packed[:, :, 1])):
        w = w.reshape(x.shape[0], -1)
        assert_within(got, w, reordered_model_bound(float(np.abs(w).max()), 1, x.shape[1]), "query and gate")


def test_dummy_weights_have_the_loaded_tree(tmp_path, rng):
    """load_format="dummy" builds the tree a checkpoint loads into, split by the sharding
    rules; zero-centred norms (folded), A_log, dt_bias and the routers stay float32."""
    folder, _ = make_hybrid(tmp_path / "next", "qwen3_next", rng)
    cfg = load_config(folder, dtype="bfloat16")
    mesh = make_mesh(1)
    shardings = functools.partial(param_shardings, mesh=mesh)
    loaded = load_params(folder, cfg, shardings=shardings)
    dummy = load_params(folder, cfg, load_format="dummy", shardings=shardings)
    assert jax.tree.structure(loaded) == jax.tree.structure(dummy)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(dummy)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype) and a.sharding.is_equivalent_to(b.sharding, a.ndim)
    layer = dummy.layers[0]
    float32 = [layer.input_norm, dummy.final_norm, dummy.mtp[0].token_norm, layer.linear_attention.a_log,
               layer.linear_attention.dt_bias, layer.moe.router, layer.moe.shared_gate, dummy.layers[1].q_norm]
    assert {str(w.dtype) for w in float32} == {"float32"} and layer.linear_attention.in_proj_qkvz.dtype == jnp.bfloat16
    assert np.all(np.asarray(layer.input_norm) == 1)  # a zero-centred norm at its initial value


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_fp8_checkpoint_regroups_whole_scale_blocks(tmp_path, rng, family):
    """Every linear weight but in_proj_ba / in_proj_b, a (one value per head), the routers
    and mtp.fc as fp8 with 8 x 8 block scales: the regrouped heads keep their own
    blocks, so each fp8 weight dequantizes to the dequantized checkpoint's tensor in the
    documented layout."""
    folder, _ = make_hybrid(tmp_path / family, family, rng)
    tensors, block = load_file(str(folder / "model.safetensors")), (8, 8)
    stored, dequantized = {}, dict(tensors)
    linear = ("_proj.weight", "in_proj_qkvz.weight", "in_proj_qkv.weight", "in_proj_z.weight")
    for name, w in tensors.items():
        if name.endswith(linear) and name.startswith(("model.layers.", "mtp.layers.")):
            q, scale = quantize(torch.from_numpy(w), block)
            stored[name], stored[name.replace(".weight", ".weight_scale_inv")] = q, scale
            dequantized[name] = dequantize(q, scale, block).numpy()
        else:
            stored[name] = torch.from_numpy(w)
    from safetensors.torch import save_file as save_torch
    save_torch(stored, str(folder / "model.safetensors"))
    hf = json.loads((folder / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                 "weight_block_size": list(block)}
    (folder / "config.json").write_text(json.dumps(hf))
    cfg = load_config(folder)
    got, want = by_path(load_params(folder, cfg)), expected_params(dequantized, cfg)
    assert isinstance(got[".layers[0].linear_attention.in_proj_qkvz"], Fp8Weight)
    assert got[".layers[0].linear_attention.in_proj_qkvz"].block == (8, 1, 8)
    for path, w in want.items():
        leaf = got[path]
        value = dequantize_blocks(leaf.weight, leaf.scale_inv, leaf.block) if isinstance(leaf, Fp8Weight) else leaf
        np.testing.assert_allclose(np.asarray(value, np.float32), w, rtol=1e-6, atol=0, err_msg=path)


def test_a_layer_pattern_the_weights_do_not_have_is_refused(tmp_path, rng):
    folder, _ = make_hybrid(tmp_path / "next", "qwen3_next", rng)
    hf = json.loads((folder / "config.json").read_text())
    hf["full_attention_interval"] = 4  # the checkpoint's pattern is every second layer
    (folder / "config.json").write_text(json.dumps(hf))
    cfg = load_config(folder)
    with pytest.raises(ValueError, match=r"layer_types \(or full_attention_interval\) places linear_attention at "
                                         "layer 1, but the checkpoint holds full_attention there"):
        load_params(folder, cfg)


def test_prefix_caching_defaults_on_and_state_snapshots_need_a_hybrid_model(tmp_path, rng):
    """The command line turns prefix caching on for hybrid models too (their states are
    snapshotted at page boundaries: engine/state_snapshots.py); num_state_snapshots is
    refused by name for a model without linear attention, before anything loads."""
    import argparse

    from conftest import STORIES
    from jaxmtp.args import add_engine_args, engine_kwargs

    folder, _ = make_hybrid(tmp_path / "next", "qwen3_next", rng)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--model", str(folder)]))["enable_prefix_caching"] is True
    with pytest.raises(ValueError, match="num_state_snapshots is for hybrid models .* llama has none"):
        LLM(STORIES, num_state_snapshots=4, enable_prefix_caching=True)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen_moe_block_matches_transformers(tmp_path, norm_topk_prob):
    """Softmax routing over every expert, the top k (renormalised or not), the experts,
    and the shared expert scaled by sigmoid(x @ shared_expert_gate): transformers'
    Qwen3NextSparseMoeBlock in float32, random weights."""
    rng = fresh_rng()
    torch.manual_seed(int(rng.integers(1 << 30)))
    config = transformers.Qwen3NextConfig(**TEXT, intermediate_size=48, num_experts=8, num_experts_per_tok=3,
                                          moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                          norm_topk_prob=norm_topk_prob)
    block = transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    x = rng.standard_normal((40, config.hidden_size)).astype(np.float32)
    with torch.no_grad():
        want = block(torch.from_numpy(x)[None])[0].numpy()
        _, hf_weights, hf_experts = block.gate(torch.from_numpy(x))
    config.save_pretrained(tmp_path)
    moe = load_config(tmp_path).moe
    w = {name: p.detach().numpy() for name, p in block.named_parameters()}
    e, i = moe.num_experts, moe.moe_intermediate_size
    p = MoEParams(
        router=jnp.asarray(w["gate.weight"].T), router_bias=None,
        experts_gate_up=jnp.asarray(w["experts.gate_up_proj"].reshape(e, 2, i, -1).transpose(0, 3, 1, 2)),
        experts_down=jnp.asarray(w["experts.down_proj"].transpose(0, 2, 1)),
        shared_gate_up=jnp.asarray(np.stack([w[f"shared_expert.{n}_proj.weight"].T for n in ("gate", "up")], axis=1)),
        shared_down=jnp.asarray(w["shared_expert.down_proj.weight"].T),
        shared_gate=jnp.asarray(w["shared_expert_gate.weight"][0]),
    )
    routing = route(jnp.asarray(x), p.router, None, moe)
    order = np.argsort(hf_experts.numpy(), axis=1)
    assert np.array_equal(np.sort(np.asarray(routing.experts), axis=1), np.take_along_axis(hf_experts.numpy(), order, 1))
    ours = np.take_along_axis(np.asarray(routing.weights), np.argsort(np.asarray(routing.experts), axis=1), 1)
    np.testing.assert_allclose(ours, np.take_along_axis(hf_weights.numpy(), order, 1), rtol=1e-5)
    got = np.asarray(moe_ffn(p, moe, jnp.asarray(x)))
    assert_within(got, want, reordered_model_bound(float(np.abs(want).max()), 1, config.hidden_size), "moe block")


TP_SCRIPT = """
import json, sys
from jaxmtp import LLM, SamplingParams
result = {}
prompts = [[1, 5, 9, 33, 7, 3, 8, 9, 10, 11], [1] + list(range(10, 22))]
trim = lambda spec: list(spec)[:max([i + 1 for i, axis in enumerate(spec) if axis], default=0)]  # the same sharding
for tp in (1, 2):
    llm = LLM(sys.argv[1], tensor_parallel_size=tp, dtype="float32", max_num_seqs=2, max_num_batched_tokens=8,
              num_speculative_tokens=2, page_size=4, prefill_chunk_size=7, enable_prefix_caching=True,
              num_state_snapshots=8)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    # the same prompts with new tails: hits that start from snapshots
    outs += llm.generate([p[:9] + [2, 4] for p in prompts], greedy, use_tqdm=False)
    runner = llm.engine.runner
    result[tp] = {"tokens": [o.outputs[0].token_ids for o in outs], "hits": [o.num_cached_tokens for o in outs],
                  "specs": [[trim(t[0].sharding.spec) for t in (state.conv, state.ssm)]
                            for state in (runner.recurrent, runner.snapshots.table)]}
print(json.dumps(result))
"""


def test_tensor_parallel_gives_one_devices_tokens_with_the_state_split_by_heads(tmp_path, rng):
    """TP=2 on two forced CPU devices (Qwen3-Next: linear attention, gated attention,
    experts with a gated shared expert, MTP k=2, prompts in chunks of 7, prefix caching):
    each device holds its key heads' conv channels and value heads' states, in the slots
    and in the snapshots, placed so and kept so by every step, save and restore, and the
    tokens and prefix-cache hits are one device's."""
    from conftest import run_on_cpu_devices

    folder, _ = make_hybrid(tmp_path / "next", "qwen3_next", rng)
    result = run_on_cpu_devices(["-c", TP_SCRIPT, str(folder)], 2)
    assert result["2"]["tokens"] == result["1"]["tokens"]
    assert result["2"]["hits"] == result["1"]["hits"] and min(result["1"]["hits"][2:]) > 0
    assert result["2"]["specs"] == [[[None, None, None, "tp"], [None, None, "tp"]]] * 2
