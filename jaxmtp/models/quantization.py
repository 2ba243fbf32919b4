"""Quantized checkpoints: what a config.json's quantization_config asks for, checked
before any weights load. Host side (no JAX).

The one format implemented is DeepSeek-V3's (also Qwen3-FP8's, Kimi-K2's): every linear
layer's weight stored float8_e4m3fn with a float32 `weight_scale_inv` of shape
[ceil(out / block_out), ceil(in / block_in)], one scale per block (the edge blocks
partial): w ~= q * scale_inv. Embeddings, norms, the MoE router and the LM head stay
in the model's dtype. Activations are not quantized here: each product is fp8 weight
times an activation in the model's dtype, accumulated in float32 (activation_scheme
"dynamic" leaves activation scales out of the checkpoint, so this is the same model).
"""

from __future__ import annotations

import dataclasses

FP8_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert"}


@dataclasses.dataclass(frozen=True)
class Fp8BlockConfig:
    block_out: int  # weight_block_size[0]: rows of the stored [out, in] matrix per block
    block_in: int  # weight_block_size[1]


def quantization_from_hf(hf: dict) -> Fp8BlockConfig | None:
    """config.json's quantization_config; a ValueError names what is not implemented."""
    quantization = hf.get("quantization_config")
    if quantization is None:
        return None
    if not isinstance(quantization, dict):
        raise ValueError(f"quantization_config must be an object, got {quantization!r}")
    method = quantization.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config with quant_method={method!r} is not supported (supported: 'fp8' "
                         "with 128x128 block scales, DeepSeek-V3's format)")
    unknown = sorted(set(quantization) - FP8_KEYS)
    if unknown:
        raise ValueError(f"quantization_config keys {unknown} are not supported (supported: {sorted(FP8_KEYS)})")
    checks = {
        "fmt": (quantization.get("fmt", "e4m3"), ("e4m3",)),
        "activation_scheme": (quantization.get("activation_scheme", "dynamic"), ("dynamic",)),
        "modules_to_not_convert": (quantization.get("modules_to_not_convert") or None, (None,)),
    }
    for field, (value, supported) in checks.items():
        if value not in supported:
            raise ValueError(f"fp8 quantization_config with {field}={value!r} is not supported "
                             f"(supported: {list(supported)})")
    block = quantization.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b >= 1 for b in block)):
        raise ValueError(f"fp8 quantization_config with weight_block_size={block!r} is not supported "
                         "(supported: two positive block sizes, [out, in], such as [128, 128])")
    return Fp8BlockConfig(block_out=block[0], block_in=block[1])
