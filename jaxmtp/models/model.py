"""The decoder-only transformer as pure functions over a flattened ragged batch: the
Llama family (GQA), GLM-4.5 (GQA with partial rotary, experts), DeepSeek-V3 (MLA,
experts), and the full-attention layers of Qwen3-Next / Qwen3.5 (GQA with an output
gate; their linear-attention layers and recurrent state: jaxmtp/models/hybrid.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxmtp.models.attention import AttentionFn, attention_fn, resolve_backend
from jaxmtp.models.config import ModelConfig
from jaxmtp.models.delta_rule import DeltaRule, delta_rule_fn
from jaxmtp.models.layers import apply_rope, gated_mlp, rms_norm
from jaxmtp.models.linear import linear
from jaxmtp.models.mla import mla_attention, mla_attention_fn, resolve_mla_backend
from jaxmtp.models.moe import ExpertsFn, experts_fn
from jaxmtp.models.params import LayerParams, Params
from jaxmtp.worker.batch import Batch
from jaxmtp.worker.cache import KVCache


@dataclasses.dataclass(frozen=True)
class LayerOps:
    """What a decoder layer runs that depends on the backend and the mesh: attention
    (GQA's, jaxmtp.models.attention, or MLA's, jaxmtp.models.mla), the routed experts (jaxmtp.models.moe)
    and the hybrid models' linear-attention recurrence (jaxmtp.models.gated_delta).
    Without a mesh, experts run on one device."""

    attention: AttentionFn
    experts: ExpertsFn = experts_fn()
    delta_rule: DeltaRule = DeltaRule()


def check_backend(cfg: ModelConfig, backend: str) -> None:
    """A ValueError, before anything is loaded, for an attention backend this model
    cannot run (naming it)."""
    if cfg.mla is None:
        resolve_backend(backend, cfg.head_dim)
    else:
        resolve_mla_backend(backend, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim)
    if cfg.hybrid is not None:
        delta_rule_fn(backend, cfg.hybrid)


def layer_ops(cfg: ModelConfig, backend: str, mesh=None, decode_rows: int = 1, prefill_rows: bool = True,
              max_rows: int | None = None) -> LayerOps:
    """The layers' attention (MLA: rows of sequences with at most decode_rows rows take
    the absorbed form; prefill_rows False: no longer runs are in the batch),
    experts (max_rows: a static bound on the batch's real rows, moe.moe_ffn's) and
    linear-attention recurrence, run per device over mesh when one is given."""
    if cfg.mla is None:
        attention = attention_fn(backend, cfg.head_dim, mesh)
    else:
        attention = mla_attention_fn(backend, decode_rows, mesh, prefill_rows)
    delta_rule = DeltaRule() if cfg.hybrid is None else delta_rule_fn(backend, cfg.hybrid, mesh)
    return LayerOps(attention, experts_fn(mesh, max_rows), delta_rule)


def gqa_attention(
    p: LayerParams, cfg: ModelConfig, h: jax.Array, batch: Batch, k_pages: jax.Array, v_pages: jax.Array,
    attention: AttentionFn,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Grouped-query attention over normed rows h [T, H]; writes this step's K/V."""
    t = h.shape[0]
    if p.k_proj is None:  # q, k and v side by side in q_proj (qkv_layout.with_merged_qkv)
        q, k, v = jnp.split(linear(h, p.q_proj, p.q_bias), (cfg.q_size, cfg.q_size + cfg.kv_size), axis=-1)
    else:
        q, k, v = linear(h, p.q_proj, p.q_bias), linear(h, p.k_proj, p.k_bias), linear(h, p.v_proj, p.v_bias)
    q = q.reshape(t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
    if p.q_norm is not None:
        q = rms_norm(q, p.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, p.k_norm, cfg.rms_norm_eps)
    q, k = apply_rope(q, batch.positions, cfg), apply_rope(k, batch.positions, cfg)
    out, k_pages, v_pages = attention(
        q, k, v, k_pages, v_pages, batch.slot_mapping, batch.kv_len, batch.page_table, batch.query_start,
        sliding_window=cfg.sliding_window,
    )
    out = out.reshape(t, cfg.q_size)
    if p.attn_gate is not None:  # Qwen3-Next's and Qwen3.5's output gate, per head and dim
        out = out * jax.nn.sigmoid(linear(h, p.attn_gate))
    return linear(out, p.o_proj, p.o_bias), k_pages, v_pages


def decoder_layer(
    p: LayerParams,
    cfg: ModelConfig,
    x: jax.Array,
    batch: Batch,
    k_pages: jax.Array,
    v_pages: jax.Array,
    ops: LayerOps,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One pre-norm block over T rows; writes this step's K/V (MLA: latent and rope
    key) through batch.slot_mapping. ops.attention is the one the layer kind takes
    (layer_ops)."""
    h = rms_norm(x, p.input_norm, cfg.rms_norm_eps)
    block = gqa_attention if p.mla is None else mla_attention
    out, k_pages, v_pages = block(p, cfg, h, batch, k_pages, v_pages, ops.attention)
    x = x + out
    return x + feed_forward(p, cfg, x, batch, ops), k_pages, v_pages


def feed_forward(p: LayerParams, cfg: ModelConfig, x: jax.Array, batch: Batch, ops: LayerOps) -> jax.Array:
    """The second half of a pre-norm block: its dense MLP or experts over norm(x) (the
    batch's padding rows, past its last request's, to no routed expert)."""
    h = rms_norm(x, p.post_norm, cfg.rms_norm_eps)
    if p.moe is None:
        return gated_mlp(h, p.gate_up_proj, p.down_proj, cfg.hidden_act, p.gate_up_bias, p.down_bias)
    return ops.experts(p.moe, cfg.moe, h, batch.query_start[-1])


def forward(
    params: Params, cfg: ModelConfig, batch: Batch, cache: KVCache, ops: LayerOps
) -> tuple[jax.Array, KVCache]:
    """Main model over the batch's rows. Returns the last hidden state BEFORE the final
    norm ([T, H]) and the cache with this step's K/V written. A hybrid model's layers
    also read and write a recurrent state: jaxmtp.models.hybrid.forward runs them."""
    if cfg.hybrid is not None:
        raise ValueError(f"{cfg.model_type} is a hybrid model: jaxmtp.models.hybrid.forward runs it, with its "
                         "recurrent state")
    x = params.embed[batch.input_ids]
    k_layers, v_layers = list(cache.k), list(cache.v)
    for i, layer in enumerate(params.layers):
        x, k_layers[i], v_layers[i] = decoder_layer(layer, cfg, x, batch, k_layers[i], v_layers[i], ops)
    return x, dataclasses.replace(cache, k=k_layers, v=v_layers)


def logits(head: jax.Array, norm: jax.Array, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Final norm and LM head, in float32."""
    return (rms_norm(hidden, norm, cfg.rms_norm_eps) @ head).astype(jnp.float32)
