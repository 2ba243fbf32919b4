"""The hybrid decoder of Qwen3-Next and Qwen3.5 over the engine's flattened ragged batch:
gated DeltaNet linear attention (jaxmtp/models/gated_delta.py) in the layers
HybridConfig.layer_types names, gated full attention over the paged KV cache in the
others (model.decoder_layer: GQA with q/k norms, partial rotary and the output gate),
each followed by experts with a gated shared expert or a dense MLP. The zero-centred
norms were folded at load (1 + w, float32; layers.rms_norm).

A linear-attention layer's state lives in the RecurrentState table
(jaxmtp/worker/recurrent.py): a request reads its slot's committed state (zeros when its
rows start at position 0) and the layer writes the states after each of its last `keep`
rows (keep = k + 1: the rows a verification may keep). Its rows before those run the
chunked form (a prefill chunk's bulk), the last `keep` the recurrent form, which yields
the state after every row; a verify step's k + 1 rows are all in the recurrent part."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxmtp.models.config import ModelConfig
from jaxmtp.models.delta_rule import DeltaRule
from jaxmtp.models.gated_delta import (
    CHUNK, causal_conv1d, conv_tail, gated_delta_chunked, gated_delta_recurrent, gates,
)
from jaxmtp.models.linear import linear
from jaxmtp.models.model import LayerOps, decoder_layer, feed_forward
from jaxmtp.models.layers import rms_norm
from jaxmtp.models.params import LinearAttentionParams, Params
from jaxmtp.worker.batch import Batch, row_owner
from jaxmtp.worker.cache import KVCache
from jaxmtp.worker.recurrent import RecurrentState, committed, write_tails


@dataclasses.dataclass(frozen=True)
class RecurrentRows:
    """Where each request's recurrent state comes from, and its rows' split between the
    two forms, shared by every linear-attention layer of a step."""

    slots: jax.Array  # [B] its slot in the RecurrentState tables
    fresh: jax.Array  # [B] its rows start at position 0: it starts from zeros
    has_rows: jax.Array  # [B]
    in_tail: jax.Array  # [T] the row is among its request's last `keep` (the recurrent form's)
    tail_start: jax.Array  # [B + 1] query_start of the tail rows packed back to back ([B * keep] rows)
    tail_source: jax.Array  # [B * keep] each packed tail row's row in the batch (padding: clamped)
    tail_valid: jax.Array  # [B * keep]


def recurrent_rows(batch: Batch, keep: int) -> RecurrentRows:
    query_start, t = batch.query_start, batch.input_ids.shape[0]
    count = query_start[1:] - query_start[:-1]
    has_rows = count > 0
    fresh = has_rows & (batch.positions[jnp.minimum(query_start[:-1], t - 1)] == 0)
    in_tail_count = jnp.minimum(count, keep)
    rows = jnp.arange(t)
    owner = row_owner(query_start, t)
    in_tail = (rows < query_start[-1]) & (rows >= query_start[owner + 1] - in_tail_count[owner])
    tail_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(in_tail_count).astype(jnp.int32)])
    packed = jnp.arange(count.shape[0] * keep)
    packed_owner = row_owner(tail_start, packed.shape[0])
    source = query_start[packed_owner + 1] - in_tail_count[packed_owner] + packed - tail_start[packed_owner]
    return RecurrentRows(batch.recurrent_slot, fresh, has_rows, in_tail, tail_start, jnp.clip(source, 0, t - 1),
                         packed < tail_start[-1])


def gated_rms_norm(o: jax.Array, z: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3NextRMSNormGated: weight * norm(o) (rounded to o's dtype first) * silu(z), in
    float32, rounded once."""
    o32 = o.astype(jnp.float32)
    normed = (o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)).astype(o.dtype)
    return (weight * normed * jax.nn.silu(z.astype(jnp.float32))).astype(o.dtype)


def linear_attention(p: LinearAttentionParams, cfg: ModelConfig, h: jax.Array, where: RecurrentRows,
                     conv_table: jax.Array, ssm_table: jax.Array, query_start: jax.Array, rule: DeltaRule
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gated DeltaNet over normed rows h [T, H] (Qwen3NextGatedDeltaNet), its recurrence
    run by `rule`'s forms. Returns its output [T, H] and the tables with each request's
    tail states written."""
    la, t = cfg.hybrid, h.shape[0]
    hk, r, dk, dv = la.linear_num_key_heads, la.value_heads_per_key, la.linear_key_head_dim, la.linear_value_head_dim
    hv, width, keep = la.linear_num_value_heads, la.conv_group_width, conv_table.shape[1]
    proj = linear(h, p.in_proj_qkvz)  # [T, Hk, W]: per key head q, k, v, z
    ba = linear(h, p.in_proj_ba)  # [T, Hk, 2r]: per key head b, then a
    mixed = proj[..., :width].reshape(t, hk * width)
    z = proj[..., width:].reshape(t, hv, dv)
    b, a = ba[..., :r].reshape(t, hv), ba[..., r:].reshape(t, hv)
    conv_state = committed(conv_table)
    weight = p.conv1d.reshape(hk * width, -1)
    y = causal_conv1d(mixed, weight, conv_state, query_start, where.slots, where.fresh).astype(h.dtype)
    y = y.reshape(t, hk, width)
    q, k, v = y[..., :dk], y[..., dk:2 * dk], y[..., 2 * dk:].reshape(t, hv, dv)
    g, beta = gates(a, b, p.a_log, p.dt_bias)
    # the chunked form over each request's rows before its tail: the tail rows, zeroed,
    # leave its state as it is (gated_delta._to_chunks)
    bulk = ~where.in_tail
    o, before_tail = gated_delta_chunked(
        q, k * bulk[:, None, None], v * bulk[:, None, None], g * bulk[:, None], beta * bulk[:, None],
        committed(ssm_table), query_start, where.slots, where.fresh, CHUNK, rule.across_chunks)
    src = where.tail_source
    num_requests = where.slots.shape[0]
    o_tail, ssm_tail = gated_delta_recurrent(
        q[src], k[src], v[src], g[src], beta[src], before_tail, where.tail_start, jnp.arange(num_requests),
        jnp.zeros((num_requests,), bool), keep, rule.over_rows)
    o = o.at[jnp.where(where.tail_valid, src, t)].set(o_tail, mode="drop")
    conv_tails = conv_tail(mixed, conv_state, query_start, where.slots, where.fresh, keep)
    conv_table = write_tails(conv_table, conv_tails, where.slots, where.has_rows)
    ssm_table = write_tails(ssm_table, ssm_tail, where.slots, where.has_rows)
    out = gated_rms_norm(o.astype(h.dtype), z, p.norm, cfg.rms_norm_eps)
    return linear(out.reshape(t, hv * dv), p.out_proj), conv_table, ssm_table


def forward(params: Params, cfg: ModelConfig, batch: Batch, cache: KVCache, state: RecurrentState, ops: LayerOps
            ) -> tuple[jax.Array, KVCache, RecurrentState]:
    """The main model over the batch's rows, as model.forward: the last hidden state
    before the final norm [T, H], the cache with the full-attention layers' K/V written
    (cache layer n: the n-th full-attention layer) and the recurrent tables with each
    request's tail states written (recurrent.commit keeps the accepted one)."""
    where = recurrent_rows(batch, state.keep)
    x = params.embed[batch.input_ids]
    k_layers, v_layers = list(cache.k), list(cache.v)
    conv, ssm = list(state.conv), list(state.ssm)
    kv_layer = linear_layer = 0
    for layer in params.layers:
        if layer.linear_attention is None:
            n = kv_layer
            x, k_layers[n], v_layers[n] = decoder_layer(layer, cfg, x, batch, k_layers[n], v_layers[n], ops)
            kv_layer += 1
            continue
        n = linear_layer
        h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
        out, conv[n], ssm[n] = linear_attention(layer.linear_attention, cfg, h, where, conv[n], ssm[n],
                                                batch.query_start, ops.delta_rule)
        x = x + out
        x = x + feed_forward(layer, cfg, x, batch, ops)
        linear_layer += 1
    return x, dataclasses.replace(cache, k=k_layers, v=v_layers), RecurrentState(conv, ssm)
