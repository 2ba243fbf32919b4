"""The building blocks every decoder layer shares: RMSNorm, rotary embeddings, the gated MLP."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmtp.models.config import ModelConfig
from jaxmtp.models.linear import linear

# config.json's hidden_act -> the function, as transformers' ACT2FN computes it
# (jaxmtp.models.config.HIDDEN_ACTIVATIONS lists the same names)
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),  # erf
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),  # tanh approximation
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_fast": functools.partial(jax.nn.gelu, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "relu": jax.nn.relu,
}


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """As Hugging Face does it: normalise in float32, cast back, then scale. A float32
    weight over narrower rows is a folded zero-centred norm (ModelConfig.zero_centred_norm),
    which transformers scales in float32 and rounds once."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight.dtype == jnp.float32:
        return (weight * normed).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def _cos_sin(angles: jax.Array, scale: float, dtype) -> tuple[jax.Array, jax.Array]:
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scale != 1.0:  # YaRN's attention factor
        cos, sin = cos * scale, sin * scale
    return cos.astype(dtype), sin.astype(dtype)


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: float = 1.0) -> jax.Array:
    """Rotary embedding in the half-split layout: x [T, heads, D], positions [T]."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]
    cos, sin = _cos_sin(angles, scale, x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def rope_interleaved(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: float) -> jax.Array:
    """DeepSeek's layout: dims (x0, x1), (x2, x3), ... rotate in pairs, and come out
    de-interleaved (evens' results, then odds'), as transformers writes them: q and k
    are permuted alike, so their dot products are the interleaved rotation's."""
    freqs = positions.astype(jnp.float32)[:, None, None] * inv_freq[None, None, :]
    cos, sin = _cos_sin(freqs, scale, x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([even * cos - odd * sin, odd * cos + even * sin], axis=-1)


def apply_rope(x: jax.Array, positions: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The config's rotary embedding over the first cfg.rotary_dim dims of each head of
    x [T, heads, D] (fewer than D under partial_rotary_factor; MLA passes only its rope
    part). YaRN scales cos and sin by its attention factor."""
    inv_freq = jnp.asarray(cfg.rope_inv_freq(), jnp.float32)
    scale = cfg.rope_attention_factor()
    if cfg.rope_interleave:
        return rope_interleaved(x, positions, inv_freq, scale)
    rot = cfg.rotary_dim
    if rot == x.shape[-1]:
        return rope(x, positions, inv_freq, scale)
    return jnp.concatenate([rope(x[..., :rot], positions, inv_freq, scale), x[..., rot:]], axis=-1)


def gated_mlp(
    h: jax.Array, gate_up: jax.Array, down: jax.Array, act: str = "silu",
    gate_up_bias: jax.Array | None = None, down_bias: jax.Array | None = None,
) -> jax.Array:
    """down(act(gate(h)) * up(h)) (SwiGLU with silu), gate_up [H, 2, I] stacked as
    LayerParams keeps it; the biases, where given, as nn.Linear adds them."""
    gate_up = linear(h, gate_up, gate_up_bias)
    return linear(ACTIVATIONS[act](gate_up[:, 0]) * gate_up[:, 1], down, down_bias)
