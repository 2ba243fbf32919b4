"""Quantized checkpoints: what a config.json's quantization_config asks for, checked
before any weights load. Host side (no JAX)."""

from __future__ import annotations


def quantization_from_hf(hf: dict) -> None:
    """config.json's quantization_config; a ValueError names what is not implemented."""
    quantization = hf.get("quantization_config")
    if quantization is None:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
    raise ValueError(f"quantization_config with quant_method={method!r} is not supported (quantized weights "
                     "are not implemented; a bf16 or float16 copy of the checkpoint loads)")
