"""GLM-4.5 / 4.6 (Glm4MoeForCausalLM): GQA attention with partial rotary (half the head
by default) and optional q/k norms, over DeepSeek-V3's MoE; its MTP layer is a full MoE
decoder layer."""

from __future__ import annotations

import dataclasses

from jaxmtp.models.config import ModelConfig, MoEConfig


def configure(cfg: ModelConfig, hf: dict) -> ModelConfig:
    return dataclasses.replace(cfg, moe=MoEConfig.from_hf(hf, cfg.model_type), qk_norm=bool(hf.get("use_qk_norm", False)))
