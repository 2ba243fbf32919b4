"""The decoder-only transformer (Llama family) as pure functions over a flattened ragged batch."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxmtp.attention import AttentionFn
from jaxmtp.batch import Batch
from jaxmtp.cache import KVCache
from jaxmtp.config import ModelConfig
from jaxmtp.params import LayerParams, Params


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    # As Hugging Face does it: normalise in float32, cast back, then scale.
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding in the half-split layout: x [T, heads, D], positions [T]."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def decoder_layer(
    p: LayerParams,
    cfg: ModelConfig,
    x: jax.Array,
    batch: Batch,
    k_pages: jax.Array,
    v_pages: jax.Array,
    attention: AttentionFn,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One pre-norm block over T rows; writes this step's K/V through batch.slot_mapping."""
    t = x.shape[0]
    h = rms_norm(x, p.input_norm, cfg.rms_norm_eps)
    q, k, v = h @ p.q_proj, h @ p.k_proj, h @ p.v_proj
    if p.q_bias is not None:
        q, k, v = q + p.q_bias, k + p.k_bias, v + p.v_bias
    q = q.reshape(t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
    if p.q_norm is not None:
        q = rms_norm(q, p.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, p.k_norm, cfg.rms_norm_eps)
    inv_freq = jnp.asarray(cfg.rope_inv_freq(), jnp.float32)
    q, k = rope(q, batch.positions, inv_freq), rope(k, batch.positions, inv_freq)
    out, k_pages, v_pages = attention(
        q, k, v, k_pages, v_pages, batch.slot_mapping, batch.kv_len, batch.page_table, batch.query_start,
        sliding_window=cfg.sliding_window,
    )
    x = x + out.reshape(t, cfg.q_size) @ p.o_proj
    h = rms_norm(x, p.post_norm, cfg.rms_norm_eps)
    gate_up = jnp.einsum("th,hci->tci", h, p.gate_up_proj)
    x = x + (jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]) @ p.down_proj
    return x, k_pages, v_pages


def forward(
    params: Params, cfg: ModelConfig, batch: Batch, cache: KVCache, attention: AttentionFn
) -> tuple[jax.Array, KVCache]:
    """Main model over the batch's rows. Returns the last hidden state BEFORE the final
    norm ([T, H]) and the cache with this step's K/V written."""
    x = params.embed[batch.input_ids]
    k_layers, v_layers = list(cache.k), list(cache.v)
    for i, layer in enumerate(params.layers):
        x, k_layers[i], v_layers[i] = decoder_layer(layer, cfg, x, batch, k_layers[i], v_layers[i], attention)
    return x, dataclasses.replace(cache, k=k_layers, v=v_layers)


def logits(head: jax.Array, norm: jax.Array, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Final norm and LM head, in float32."""
    return (rms_norm(hidden, norm, cfg.rms_norm_eps) @ head).astype(jnp.float32)
