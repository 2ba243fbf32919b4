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


def rope_tables(positions: jax.Array, cfg: ModelConfig, dtype) -> tuple[jax.Array, jax.Array]:
    """The config's rotary embedding at positions [T]: cos and sin [T, rotary_dim / 2], in
    dtype (as the rotation multiplies them), YaRN's attention factor in."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(cfg.rope_inv_freq(), jnp.float32)[None, :]
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    scale = cfg.rope_attention_factor()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.astype(dtype), sin.astype(dtype)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, interleave: bool) -> jax.Array:
    """x [T, heads, 2h] rotated by tables [T, h] (rope_tables): dim pairs (i, i + h), or
    interleaved (DeepSeek's) (2i, 2i + 1), whose results come out de-interleaved (evens',
    then odds'), as transformers writes them: q and k are permuted alike, so their dot
    products are the interleaved rotation's."""
    if interleave:
        first, second = x[..., 0::2], x[..., 1::2]
    else:
        first, second = jnp.split(x, 2, axis=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def apply_rope(x: jax.Array, positions: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The config's rotary embedding over the first cfg.rotary_dim dims of each head of
    x [T, heads, D] (fewer than D under partial_rotary_factor; MLA passes only its rope
    part)."""
    cos, sin = rope_tables(positions, cfg, x.dtype)
    rot = cfg.rotary_dim
    if cfg.rope_interleave or rot == x.shape[-1]:
        return rotate(x, cos, sin, cfg.rope_interleave)
    return jnp.concatenate([rotate(x[..., :rot], cos, sin, False), x[..., rot:]], axis=-1)


def gated_mlp(
    h: jax.Array, gate_up: jax.Array, down: jax.Array, act: str = "silu",
    gate_up_bias: jax.Array | None = None, down_bias: jax.Array | None = None,
) -> jax.Array:
    """down(act(gate(h)) * up(h)) (SwiGLU with silu), gate_up [H, 2, I] stacked as
    LayerParams keeps it; the biases, where given, as nn.Linear adds them."""
    gate_up = linear(h, gate_up, gate_up_bias)
    return linear(ACTIVATIONS[act](gate_up[:, 0]) * gate_up[:, 1], down, down_bias)
