"""Mixture-of-experts FFN (DeepSeek-V3, GLM-4.5): the router on the device, the routed
experts through one grouped matmul, plus shared experts."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxmtp.config import MoEConfig
from jaxmtp.layers import gated_mlp
from jaxmtp.linear import grouped_linear
from jaxmtp.params import MoEParams


@dataclasses.dataclass(frozen=True)
class Routing:
    experts: jax.Array  # int32 [T, k]: the experts each row goes to
    weights: jax.Array  # float32 [T, k]: their weights in the row's output


def route(x: jax.Array, router: jax.Array, bias: jax.Array, cfg: MoEConfig) -> Routing:
    """noaux_tc routing: sigmoid scores; the correction bias is added for the choice
    only. Groups are ranked by the sum of their two best biased scores, the best
    topk_group kept, and the k best experts of those chosen; their weights are the
    unbiased scores, normalised to sum 1 (norm_topk_prob), times routed_scaling_factor.
    Ties go to the lower index (lax.top_k)."""
    t = x.shape[0]
    scores = jax.nn.sigmoid(jnp.dot(x.astype(jnp.float32), router, precision=jax.lax.Precision.HIGHEST))
    choice = scores + bias
    per_group = cfg.num_experts // cfg.n_group
    group_scores = jax.lax.top_k(choice.reshape(t, cfg.n_group, per_group), 2)[0].sum(axis=-1)
    _, groups = jax.lax.top_k(group_scores, cfg.topk_group)
    kept = jnp.sum(jax.nn.one_hot(groups, cfg.n_group, dtype=jnp.int32), axis=1) > 0  # [T, G]
    choice = jnp.where(jnp.repeat(kept, per_group, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return Routing(experts.astype(jnp.int32), weights * cfg.routed_scaling_factor)


def routed_experts(x: jax.Array, routing: Routing, gate_up: jax.Array, down: jax.Array) -> jax.Array:
    """sum over a row's k experts of weight * expert(x). The T*k (row, expert) pairs are
    sorted by expert so that each expert's rows are contiguous, both FFN matmuls run as
    one grouped matmul each, and the outputs are summed back onto their rows."""
    t, h = x.shape
    num_experts, _, _, inter = gate_up.shape
    k = routing.experts.shape[1]
    flat = routing.experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    row = order // k
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    up = grouped_linear(x[row], gate_up, group_sizes).reshape(-1, 2, inter)
    out = grouped_linear(jax.nn.silu(up[:, 0]) * up[:, 1], down, group_sizes)
    weighted = out.astype(jnp.float32) * routing.weights.reshape(-1)[order][:, None]
    return jnp.zeros((t, h), jnp.float32).at[row].add(weighted).astype(x.dtype)


def moe_ffn(p: MoEParams, cfg: MoEConfig, h: jax.Array) -> jax.Array:
    out = routed_experts(h, route(h, p.router, p.router_bias, cfg), p.experts_gate_up, p.experts_down)
    if p.shared_gate_up is not None:
        out = out + gated_mlp(h, p.shared_gate_up, p.shared_down)
    return out
