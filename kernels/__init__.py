"""Attention kernels: Pallas GPU kernels, each with a plain-jnp reference of the same signature."""

from jaxmtp.kernels.ragged_paged_attention import KernelConfig, default_config, ragged_paged_attention
from jaxmtp.kernels.reference import ragged_paged_attention_reference

__all__ = [
    "KernelConfig",
    "default_config",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
]
