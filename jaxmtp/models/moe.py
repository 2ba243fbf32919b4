"""Mixture-of-experts FFN (DeepSeek-V3, GLM-4.5, Qwen3-Next, Qwen3.5): the router on the
device, the routed experts through grouped matmuls (sorted by expert, or for a few rows
pair by pair), plus shared experts; under tensor parallelism the experts split over the
devices (expert parallel)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxmtp.kernels.fp8_matmul import dequantize_blocks
from jaxmtp.kernels.grouped_matmul import (expert_path, grouped_matmul, grouped_swiglu, paired_matmul_kernel,
                                           paired_swiglu_kernel)
from jaxmtp.kernels.route import route_and_sort, routes_in_kernel
from jaxmtp.models.config import MoEConfig
from jaxmtp.models.layers import gated_mlp
from jaxmtp.models.params import Fp8Weight, MoEParams, pytree_dataclass
from jaxmtp.worker.sharding import ROWS_AXES, TP, param_specs, shard_per_device


@pytree_dataclass
class Routing:
    experts: jax.Array  # int32 [T, k]: the experts each row goes to
    weights: jax.Array  # float32 [T, k]: their weights in the row's output

    def without_rows_from(self, num_rows: jax.Array | int) -> Routing:
        """Rows from num_rows on (a step's padding) sent to expert -1, held by no device:
        their pairs add nothing and make the grouped calls read no expert."""
        padding = jnp.arange(self.experts.shape[0])[:, None] >= num_rows
        return dataclasses.replace(self, experts=jnp.where(padding, -1, self.experts))

    def with_shared_experts(self, shared: int) -> Routing:
        """Every row's pairs with the shared experts held as groups 0 .. shared - 1
        (MoEParams.shared_in_experts), weight 1 each, first; its routed experts after them."""
        if not shared:
            return self
        t = self.experts.shape[0]
        return Routing(
            jnp.concatenate([jnp.broadcast_to(jnp.arange(shared, dtype=jnp.int32), (t, shared)), self.experts + shared],
                            axis=1),
            jnp.concatenate([jnp.ones((t, shared), jnp.float32), self.weights], axis=1))


@pytree_dataclass
class SortedPairs:
    """The T*k (row, expert) pairs sorted by expert, as the grouped calls take them:
    each expert's pairs contiguous, in its group's order (those of experts held
    elsewhere, and a step's padding rows', last)."""

    group_sizes: jax.Array  # int32 [G]: the pairs of each expert held here
    rows: jax.Array  # int32 [T*k]: the row each sorted pair reads
    weights: jax.Array  # float32 [T*k]: its weight in that row's output


def sort_pairs(routing: Routing, first_expert: jax.Array | int, num_held: int) -> SortedPairs:
    """routing's pairs (row-major: pair p is row p // k's) sorted stably by expert, over
    the experts first_expert .. first_expert + num_held - 1."""
    k = routing.experts.shape[1]
    local = routing.experts.reshape(-1) - first_expert
    local = jnp.where((local >= 0) & (local < num_held), local, num_held)
    order = jnp.argsort(local, stable=True)
    return SortedPairs(jnp.bincount(local, length=num_held).astype(jnp.int32),  # counts no pair held elsewhere
                       (order // k).astype(jnp.int32), routing.weights.reshape(-1)[order])


def router_logits(x: jax.Array, router: jax.Array) -> jax.Array:
    """The router's float32 logits x @ router."""
    return jnp.dot(x.astype(jnp.float32), router, precision=jax.lax.Precision.HIGHEST)


def route(x: jax.Array, router: jax.Array, bias: jax.Array | None, cfg: MoEConfig) -> Routing:
    """choose() from the float32 router logits x @ router."""
    return choose(router_logits(x, router), bias, cfg)


def choose(logits: jax.Array, bias: jax.Array | None, cfg: MoEConfig) -> Routing:
    """The k experts of each row and their weights, from the router's logits [T, E].
    noaux_tc (DeepSeek-V3): sigmoid scores; the correction bias is added for the choice
    only. Groups are ranked by the sum of their two best biased scores, the best
    topk_group kept, and the k best experts of those chosen; their weights are the
    unbiased scores. softmax (Qwen3-Next, Qwen3.5): softmax over every expert, the k best
    and their probabilities (no bias, no groups). Either way the weights are normalised
    to sum 1 where norm_topk_prob, then times routed_scaling_factor. Ties go to the lower
    index (lax.top_k)."""
    if cfg.routing == "softmax":
        weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), cfg.num_experts_per_tok)
    else:
        scores = jax.nn.sigmoid(logits)
        experts = _group_limited_top_k(scores + bias, cfg)
        weights = jnp.take_along_axis(scores, experts, axis=1)
    if cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return Routing(experts.astype(jnp.int32), weights * cfg.routed_scaling_factor)


def _group_limited_top_k(choice: jax.Array, cfg: MoEConfig) -> jax.Array:
    """noaux_tc's choice [T, k] from the biased scores [T, E]: the k best experts of the
    topk_group groups whose two best scores sum highest."""
    t = choice.shape[0]
    per_group = cfg.num_experts // cfg.n_group
    group_scores = jax.lax.top_k(choice.reshape(t, cfg.n_group, per_group), 2)[0].sum(axis=-1)
    _, groups = jax.lax.top_k(group_scores, cfg.topk_group)
    kept = jnp.sum(jax.nn.one_hot(groups, cfg.n_group, dtype=jnp.int32), axis=1) > 0  # [T, G]
    choice = jnp.where(jnp.repeat(kept, per_group, axis=1), choice, -jnp.inf)
    return jax.lax.top_k(choice, cfg.num_experts_per_tok)[1]


def _expert_weight(w: jax.Array | Fp8Weight) -> tuple[jax.Array, dict]:
    """An expert weight [E, K, (2,) N] (fp8 on one device: K-major) for the grouped calls,
    and their fp8 arguments: the block scales, the (K, N) block and the layout (fp8
    experts stream as fp8), or none."""
    if not isinstance(w, Fp8Weight):
        return w, {}
    return w.weight, {"scale_inv": w.scale_inv, "scale_block": (w.block[1], w.block[-1]), "k_major": w.k_major}


def dequantized(w: Fp8Weight, dtype) -> jax.Array:
    """An fp8 expert weight in dtype, in the layout it was loaded in ([E, K, (2,) N]):
    weight * its block's scale, rounded once."""
    return dequantize_blocks(w.in_major_weight, w.scale_inv, w.block).astype(dtype)


def routed_experts(x: jax.Array, routing: Routing, gate_up: jax.Array, down: jax.Array,
                   first_expert: jax.Array | int = 0, **options) -> jax.Array:
    """sum over a row's k experts of weight * expert(x), in float32, over the experts
    gate_up and down hold: first_expert .. first_expert + len(gate_up) - 1 (all of them
    on one device, a device's own under expert parallelism; pairs routed to other
    experts add nothing): routing's pairs sorted (sort_pairs), then sorted_experts."""
    pairs = sort_pairs(routing, first_expert, _expert_weight(gate_up)[0].shape[0])
    return sorted_experts(x, pairs, gate_up, down, **options)


def sorted_experts(x: jax.Array, pairs: SortedPairs, gate_up: jax.Array, down: jax.Array, *,
                   expert_swiglu=grouped_swiglu, expert_matmul=grouped_matmul, real_pairs: int | None = None
                   ) -> jax.Array:
    """The sorted pairs through their experts: the gate/up projection and
    SiLU-and-multiply as one grouped call that gathers its rows from x itself, the down
    projection as another, and the outputs summed back onto their rows with their
    weights, in float32. expert_swiglu, expert_matmul: kernels/grouped_matmul.py's entry
    points (the Pallas kernel on GPUs), or its references or kernels of the same
    signature (tests, benchmarks); real_pairs: the most pairs that can be a request's
    (a decode step's bound; the rest are padding), whose measured tiling the calls take."""
    t, h = x.shape
    (gate_up, gate_up_scales), (down, down_scales) = _expert_weight(gate_up), _expert_weight(down)
    tiling = {} if real_pairs is None else {"real_rows": real_pairs}
    # the pairs held elsewhere lie past every group: the grouped calls' rows there are 0
    out = expert_matmul(expert_swiglu(x, gate_up, pairs.group_sizes, rows=pairs.rows, **gate_up_scales, **tiling),
                        down, pairs.group_sizes, **down_scales, **tiling)
    weighted = out.astype(jnp.float32) * pairs.weights[:, None]
    return jnp.zeros((t, h), jnp.float32).at[pairs.rows].add(weighted)


def routed_experts_by_pair(x: jax.Array, routing: Routing, gate_up: jax.Array, down: jax.Array,
                           first_expert: jax.Array | int = 0, *, pair_swiglu=paired_swiglu_kernel,
                           pair_matmul=paired_matmul_kernel) -> jax.Array:
    """routed_experts' contract without the sort: the T*k (row, expert) pairs in routing's
    order, each its own row of the paired calls (kernels/grouped_matmul.py's paired form,
    pairs held elsewhere given group len(gate_up): 0), and each row's k outputs summed
    with their weights in one fusion, with no scatter. For a few rows (decode), where the
    sort, the group count and the scatter-add cost more than the calls;
    grouped_matmul.expert_path says where."""
    t, h = x.shape
    (gate_up, gate_up_scales), (down, down_scales) = _expert_weight(gate_up), _expert_weight(down)
    num_held, k = gate_up.shape[0], routing.experts.shape[1]
    local = routing.experts.reshape(-1) - first_expert
    groups = jnp.where((local >= 0) & (local < num_held), local, num_held)
    rows = jnp.arange(t * k, dtype=jnp.int32) // k
    out = pair_matmul(pair_swiglu(x, gate_up, groups, rows, **gate_up_scales), down, groups, **down_scales)
    return jnp.sum(out.astype(jnp.float32).reshape(t, k, h) * routing.weights[:, :, None], axis=1)


def moe_ffn(p: MoEParams, cfg: MoEConfig, h: jax.Array, first_expert: jax.Array | int = 0,
            num_rows: jax.Array | int | None = None, max_rows: int | None = None) -> jax.Array:
    """The routed experts p holds (from first_expert) plus the shared experts (Qwen's
    scaled by sigmoid(h @ shared_gate); held as the first groups, on one device, where
    p.shared_in_experts: their pairs are taken with the routed ones'), in float32. Under
    expert parallelism each device's columns of the shared experts are scaled alike, so
    the sum over devices is the gated whole. Rows from num_rows on (a step's padding) go
    to no routed expert: routed like the rest, a decode step's padding rows would read
    experts of their own (at batch 1, 7 padding rows doubled the experts a layer reads).
    max_rows: a static bound on num_rows (a decode-only step's requests times their
    rows), from which the grouped calls' tiling and the layer's form are taken (sorted, by
    pairs, or for fp8 experts dequantized first: grouped_matmul.expert_path): at
    batch 1 the 8-row bucket's 48 pairs are 6 real ones, which the tables measured as 1
    token's."""
    gate_up, scales = _expert_weight(p.experts_gate_up)
    k, shared = cfg.num_experts_per_tok, p.shared_in_experts
    num_pairs = h.shape[0] * k
    real_pairs = min(h.shape[0], max_rows or h.shape[0]) * (k + shared)
    path = expert_path(real_pairs, p.experts_gate_up.shape, scales.get("scale_block"))
    by_pair = path == "paired"
    experts = (p.experts_gate_up, p.experts_down)
    if path == "dequantized":
        experts = tuple(dequantized(w, h.dtype) for w in experts)
    sigmoid = cfg.routing != "softmax"
    if routes_in_kernel(num_pairs, cfg.num_experts, k, sigmoid and cfg.topk_group < cfg.n_group) and not by_pair:
        pairs = SortedPairs(*route_and_sort(
            router_logits(h, p.router), p.router_bias, h.shape[0] if num_rows is None else num_rows, first_expert,
            k=k, num_held=gate_up.shape[0], shared=shared, sigmoid=sigmoid, norm_topk_prob=cfg.norm_topk_prob,
            scaling=cfg.routed_scaling_factor))
        out = sorted_experts(h, pairs, *experts, real_pairs=real_pairs)
    else:
        routing = route(h, p.router, p.router_bias, cfg).with_shared_experts(shared)
        if num_rows is not None:
            routing = routing.without_rows_from(num_rows)
        if by_pair:
            out = routed_experts_by_pair(h, routing, *experts, first_expert)
        else:
            out = routed_experts(h, routing, *experts, first_expert, real_pairs=real_pairs)
    if p.shared_gate_up is not None:
        shared = gated_mlp(h, p.shared_gate_up, p.shared_down).astype(jnp.float32)
        if p.shared_gate is not None:
            gate = jnp.dot(h.astype(jnp.float32), p.shared_gate, precision=jax.lax.Precision.HIGHEST)
            shared = jax.nn.sigmoid(gate)[:, None] * shared
        out = out + shared
    return out


ExpertsFn = Callable[[MoEParams, MoEConfig, jax.Array, jax.Array], jax.Array]


def experts_fn(mesh: Mesh | None = None, max_rows: int | None = None) -> ExpertsFn:
    """(p, cfg, h [T, H], num_rows) -> the MoE FFN's output [T, H], rows from num_rows
    on (padding) through the shared experts only, or (shared experts held as groups) no
    expert; max_rows: moe_ffn's bound on
    num_rows. With a mesh, expert parallel:
    every device holds every row (the residual stream is replicated) and routes them
    all alike, runs the rows routed to its own experts and its columns of the shared
    experts, and one all-reduce (in float32) sums the devices' parts, as after a dense
    down_proj. Rows are not sent to their experts' devices with an all-to-all: each
    device has them already (docs/tensor-parallel.md has the measurement)."""
    if mesh is None:
        return lambda p, cfg, h, num_rows: moe_ffn(p, cfg, h, num_rows=num_rows, max_rows=max_rows).astype(h.dtype)

    def per_device(p, h, num_rows, *, cfg):
        first = jax.lax.axis_index(TP) * p.experts_gate_up.shape[0]
        return jax.lax.psum(moe_ffn(p, cfg, h, first, num_rows, max_rows), TP).astype(h.dtype)

    def expert_parallel(p, cfg, h, num_rows):
        assert mesh.size == 1 or not p.shared_in_experts, "shared experts held as groups are for one device"
        return shard_per_device(per_device, mesh, (param_specs(p, mesh), ROWS_AXES, ()), ROWS_AXES)(
            p, h, jnp.asarray(num_rows, jnp.int32), cfg=cfg)

    return expert_parallel
