"""Qwen3-Next (Qwen3NextForCausalLM) and Qwen3.5 (the text model of
Qwen3_5ForConditionalGeneration and Qwen3_5MoeForConditionalGeneration, or their
*ForCausalLM): hybrid layers of gated DeltaNet linear attention and gated full attention
(jaxmtp.models.config.HybridConfig), zero-centred RMSNorms, Qwen's softmax-routed
experts with one gated shared expert (Qwen3-Next, Qwen3.5-MoE) or a dense MLP (Qwen3.5),
and one MTP layer stored as mtp.* (its layout "qwen3_next"). Every config.json field of
theirs that changes the math is read here or refused by name."""

from __future__ import annotations

import dataclasses

from jaxmtp.models.config import HybridConfig, ModelConfig, MoEConfig

LAYER_KINDS = ("linear_attention", "full_attention")
# Qwen3.5's multimodal rope: a text token's three position ids (time, height, width) are
# equal, so every section rotates by the same angle: plain rope over rotary_dim
TEXT_ONLY_ROPE_KEYS = ("mrope_section", "mrope_interleaved")


def configure_qwen3_next(cfg: ModelConfig, hf: dict) -> ModelConfig:
    """Experts in every layer (num_experts > 0; none: dense MLPs throughout), as
    transformers places them with decoder_sparse_step 1 and no mlp_only_layers."""
    _refuse(cfg.model_type, {"decoder_sparse_step": (hf.get("decoder_sparse_step", 1), (1,)),
                                 "mlp_only_layers": (hf.get("mlp_only_layers") or [], ([],))})
    moe = _softmax_moe(hf, cfg.model_type, bool(hf.get("norm_topk_prob", True))) if hf.get("num_experts") else None
    return _hybrid(cfg, hf, moe)


def configure_qwen3_5_moe(cfg: ModelConfig, hf: dict) -> ModelConfig:
    """Experts in every layer; transformers normalises the top k weights always."""
    return _hybrid(cfg, hf, _softmax_moe(hf, cfg.model_type, norm_topk_prob=True))


def configure_qwen3_5(cfg: ModelConfig, hf: dict) -> ModelConfig:
    """Dense MLPs in every layer: Qwen3.5-MoE's body without experts."""
    return _hybrid(cfg, hf, None)


def _refuse(model_type: str, checks: dict) -> None:
    """A ValueError naming the first field whose value is not among its supported ones."""
    for field, (value, supported) in checks.items():
        if value not in supported:
            raise ValueError(f"{model_type} with {field}={value!r} is not supported (supported: {list(supported)})")


def _hybrid(cfg: ModelConfig, hf: dict, moe: MoEConfig | None) -> ModelConfig:
    """What the three families share: the layer pattern, the linear attention's heads, the
    MTP layer; moe is the family's experts (None: dense MLPs)."""
    _refuse(cfg.model_type, {
        "attention_bias": (bool(hf.get("attention_bias", False)), (False,)),
        "attn_output_gate": (hf.get("attn_output_gate", True), (True,)),
        # the gated RMSNorm's gate activation (silu), in the linear attention
        "output_gate_type": (hf.get("output_gate_type", "swish"), ("swish",)),
        # hidden_act is also the conv's activation in the linear attention
        "hidden_act": (hf.get("hidden_act", "silu"), ("silu",)),
        # the recurrent state: transformers keeps it in float32
        "mamba_ssm_dtype": (hf.get("mamba_ssm_dtype", "float32"), ("float32",)),
        "mtp_use_dedicated_embeddings": (hf.get("mtp_use_dedicated_embeddings", False), (False,)),
    })
    hybrid = HybridConfig(
        layer_types=_layer_types(hf, cfg.num_layers),
        linear_num_key_heads=hf["linear_num_key_heads"],
        linear_num_value_heads=hf["linear_num_value_heads"],
        linear_key_head_dim=hf["linear_key_head_dim"],
        linear_value_head_dim=hf["linear_value_head_dim"],
        linear_conv_kernel_dim=hf["linear_conv_kernel_dim"],
    )
    if hybrid.linear_num_value_heads % hybrid.linear_num_key_heads:
        raise ValueError(f"linear_num_value_heads={hybrid.linear_num_value_heads} must be a multiple of "
                         f"linear_num_key_heads={hybrid.linear_num_key_heads}")
    num_mtp = _num_mtp_modules(hf)
    return dataclasses.replace(
        cfg, hybrid=hybrid, moe=moe, zero_centred_norm=True,
        rope_scaling=tuple(item for item in cfg.rope_scaling if item[0] not in TEXT_ONLY_ROPE_KEYS),
        num_mtp_modules=num_mtp, mtp_layout=(cfg.mtp_layout or "qwen3_next") if num_mtp else None,
    )


def _layer_types(hf: dict, num_layers: int) -> tuple[str, ...]:
    """config.json's layer_types, or (Qwen3-Next's release leaves it out) every
    full_attention_interval-th layer full attention, as transformers derives them."""
    if hf.get("layer_types") is None:
        interval = hf.get("full_attention_interval", 4)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ValueError(f"full_attention_interval={interval!r} cannot place the layers (supported: an integer >= 1)")
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers))
    types = tuple(hf["layer_types"])
    unknown = sorted(set(types) - set(LAYER_KINDS))
    if unknown or len(types) != num_layers:
        raise ValueError(f"layer_types={list(types)} cannot place the layers: {num_layers} (num_hidden_layers) "
                         f"entries of {list(LAYER_KINDS)} are supported"
                         + (f", not {unknown}" if unknown else ""))
    return types


def _num_mtp_modules(hf: dict) -> int:
    """The MTP layers the checkpoint ships: num_nextn_predict_layers (what vLLM reads,
    and the engine's own checkpoints write) or Qwen's mtp_num_hidden_layers; neither
    (Qwen3-Next's release declares none and ships mtp.*): 1, as vLLM defaults. Several
    are refused: they would share one mtp.fc, and whether they stack within one draft
    step or take turns (as vLLM runs them) no released checkpoint shows."""
    declared = {name: hf[name] for name in ("num_nextn_predict_layers", "mtp_num_hidden_layers")
                if hf.get(name) is not None}
    if len(set(declared.values())) > 1:
        raise ValueError(f"num_nextn_predict_layers={declared['num_nextn_predict_layers']} and "
                         f"mtp_num_hidden_layers={declared['mtp_num_hidden_layers']} disagree")
    for name, n in declared.items():
        if n not in (0, 1):
            raise ValueError(f"{name}={n} is not supported (supported: [0, 1]): several MTP layers under one mtp.fc")
    return next(iter(declared.values()), 1)


def _softmax_moe(hf: dict, model_type: str, norm_topk_prob: bool) -> MoEConfig:
    moe = MoEConfig(
        num_experts=hf["num_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        num_shared_experts=1,
        moe_intermediate_size=hf["moe_intermediate_size"],
        first_k_dense_replace=0,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=norm_topk_prob,
        routing="softmax",
        shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
        shared_expert_gate=True,
    )
    if not 1 <= moe.num_experts_per_tok <= moe.num_experts:
        raise ValueError(f"{model_type} with num_experts_per_tok={moe.num_experts_per_tok} is not supported "
                         f"(supported: 1..num_experts={moe.num_experts})")
    if moe.shared_intermediate_size < 1:
        raise ValueError(f"{model_type} with shared_expert_intermediate_size={moe.shared_intermediate_size} "
                         "is not supported (supported: >= 1; transformers always builds the shared expert)")
    return moe
