"""q, k and v side by side: the runner's layout of each GQA layer's three projections
where the kernels run (one GPU), and back apart, as checkpoints hold them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxmtp.models.config import ModelConfig
from jaxmtp.models.params import Fp8Weight, LayerParams, Params


def with_merged_qkv(params: Params) -> Params:
    """params with each GQA layer's q, k and v projections (the MTP modules' too) side by
    side in q_proj, [H, Hq*D + 2*Hkv*D], their biases in q_bias, and k_proj, v_proj and
    their biases None: a single matmul whose shape the kernels' tables can name, where
    XLA would merge the three dots of one input itself. (New fields would change the
    tree that the engine's orbax checkpoints were saved with.) fp8 weights merge with
    their scales where each one's columns are whole scale blocks, in the [in, out]
    layout (before linear.with_fp8_matmul); MLA layers stay as they are. For one device:
    the sharding rules split q, k and v apart. Checkpoints are written apart
    (with_separate_qkv)."""

    def merge(layer: LayerParams) -> LayerParams:
        merged = None if layer.k_proj is None else _side_by_side((layer.q_proj, layer.k_proj, layer.v_proj))
        if merged is None:
            return layer
        biases = (layer.q_bias, layer.k_bias, layer.v_bias)
        return dataclasses.replace(
            layer, q_proj=merged, q_bias=None if layer.q_bias is None else jnp.concatenate(biases),
            k_proj=None, v_proj=None, k_bias=None, v_bias=None,
        )

    return _map_layers(params, merge)


def _side_by_side(weights: tuple) -> jax.Array | Fp8Weight | None:
    """[in, out] weights concatenated along out; fp8 ones with their scales, or None where
    their blocks differ or a part's columns are not whole blocks."""
    if not isinstance(weights[0], Fp8Weight):
        return jnp.concatenate(weights, axis=1)
    first = weights[0]
    if any(w.block != first.block or w.k_major or w.shape[1] % first.block[-1] for w in weights):
        return None
    return dataclasses.replace(first, weight=jnp.concatenate([w.weight for w in weights], axis=1),
                               scale_inv=jnp.concatenate([w.scale_inv for w in weights], axis=1))


def with_separate_qkv(params: Params, cfg: ModelConfig) -> Params:
    """with_merged_qkv undone: q, k and v (and their biases) apart, as checkpoints hold them
    (fp8 weights in the [in, out] layout)."""

    def split(layer: LayerParams) -> LayerParams:
        if layer.q_proj is None or layer.k_proj is not None:  # MLA or linear attention, or apart already
            return layer
        cuts = (cfg.q_size, cfg.q_size + cfg.kv_size)
        q, k, v = _apart(layer.q_proj, cuts)
        biases = (None,) * 3 if layer.q_bias is None else jnp.split(layer.q_bias, cuts)
        return dataclasses.replace(layer, q_proj=q, k_proj=k, v_proj=v, q_bias=biases[0], k_bias=biases[1],
                                   v_bias=biases[2])

    return _map_layers(params, split)


def _apart(w: jax.Array | Fp8Weight, cuts: tuple[int, ...]) -> list:
    """_side_by_side undone at the out columns `cuts` (whole scale blocks for fp8)."""
    if not isinstance(w, Fp8Weight):
        return jnp.split(w, cuts, axis=1)
    scale_cuts = tuple(c // w.block[-1] for c in cuts)
    return [dataclasses.replace(w, weight=part, scale_inv=scales)
            for part, scales in zip(jnp.split(w.weight, cuts, axis=1), jnp.split(w.scale_inv, scale_cuts, axis=1))]


def _map_layers(params: Params, fn) -> Params:
    """fn over every decoder layer: the main model's and each MTP module's."""
    return dataclasses.replace(params, layers=[fn(layer) for layer in params.layers],
                               mtp=[dataclasses.replace(module, block=fn(module.block)) for module in params.mtp])
