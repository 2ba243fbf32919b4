"""The loaded params in the layouts the step takes on the runner's mesh; checkpoints are
written in the loaded layout (jaxmtp.loading.loader.save_checkpoint undoes each)."""

from __future__ import annotations

from jaxmtp.models.config import ModelConfig
from jaxmtp.models.expert_layout import with_shared_in_experts
from jaxmtp.models.linear import dense_kernels_for, fp8_matmul_for, with_fp8_matmul
from jaxmtp.models.params import Params
from jaxmtp.models.qkv_layout import with_merged_qkv


def step_layouts(params: Params, cfg: ModelConfig, attention_backend: str, mesh) -> Params:
    """On one device, the shared experts held as the routed experts' first groups (expert
    parallelism splits them apart); where the step may take the dense kernels, q, k and v
    as one matmul, whose merged shape their measured tables name (before the fp8
    weights' layout moves); fp8 weights in the layout of the matmul the backend takes."""
    if mesh.size == 1:
        params = with_shared_in_experts(params, cfg, in_place=True)
    if dense_kernels_for(attention_backend, mesh):
        params = with_merged_qkv(params)
    if cfg.quantization is not None:
        params = with_fp8_matmul(params, fp8_matmul_for(attention_backend, cfg.quantization), in_place=True)
    return params
