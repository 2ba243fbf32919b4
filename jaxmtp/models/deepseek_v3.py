"""DeepSeek-V3 (DeepseekV3ForCausalLM; also Kimi-K2 and Moonlight): MLA attention and a
group-limited sigmoid-routed MoE; its MTP layer is a full MoE decoder layer."""

from __future__ import annotations

import dataclasses

from jaxmtp.models.config import MLAConfig, ModelConfig, MoEConfig


def configure(cfg: ModelConfig, hf: dict) -> ModelConfig:
    # DeepSeek's attention_bias adds biases to q_a_proj, kv_a_proj and o_proj: no
    # released checkpoint has them
    if hf.get("attention_bias", False):
        raise ValueError("deepseek_v3 with attention_bias=True is not supported (supported: [False])")
    moe, mla = MoEConfig.from_hf(hf, cfg.model_type), MLAConfig.from_hf(hf)
    # every head reads the one latent: K and V per head are expanded from it
    return dataclasses.replace(
        cfg, moe=moe, mla=mla, head_dim=mla.qk_head_dim, num_kv_heads=cfg.num_heads,
        rope_interleave=bool(hf.get("rope_interleave", True)),
    )
