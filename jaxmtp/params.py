"""Parameter pytrees. Matrices are stored [in, out] so the forward pass is `x @ w`."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxmtp.config import ModelConfig


def pytree_dataclass(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(cls))


@pytree_dataclass
class LayerParams:
    input_norm: jax.Array  # [H]
    q_proj: jax.Array  # [H, Hq*D]
    k_proj: jax.Array  # [H, Hkv*D]
    v_proj: jax.Array  # [H, Hkv*D]
    o_proj: jax.Array  # [Hq*D, H]
    post_norm: jax.Array  # [H]
    # gate and up stacked: one matmul reads both (two cost a second launch and stream at
    # a lower share of bandwidth; docs/benchmarks/README.md); [H, 2, I] rather than [H, 2I] so that
    # splitting I over devices keeps each device's gate and up columns together
    gate_up_proj: jax.Array  # [H, 2, I]
    down_proj: jax.Array  # [I, H]
    q_bias: jax.Array | None = None  # Qwen2 / MiMo
    k_bias: jax.Array | None = None
    v_bias: jax.Array | None = None
    q_norm: jax.Array | None = None  # Qwen3: RMSNorm over each head's D
    k_norm: jax.Array | None = None


@pytree_dataclass
class MTPParams:
    """One DeepSeek-V3-style MTP module.

    The input projection is kept as two halves so the checkpoint's concat order
    (embedding first for DeepSeek, hidden first for MiMo) is settled once, at load time.
    """

    token_norm: jax.Array  # [H] RMSNorm of the next token's embedding
    hidden_norm: jax.Array  # [H] RMSNorm of the previous hidden state
    proj_token: jax.Array  # [H, H]
    proj_hidden: jax.Array  # [H, H]
    block: LayerParams
    final_norm: jax.Array  # [H]
    lm_head: jax.Array | None = None  # [H, V]; None shares the main model's head


@pytree_dataclass
class Params:
    embed: jax.Array  # [V, H]
    layers: list[LayerParams]
    final_norm: jax.Array  # [H]
    lm_head: jax.Array | None  # [H, V]; None when tied to the embedding
    mtp: list[MTPParams] = dataclasses.field(default_factory=list)

    def head(self) -> jax.Array:
        return self.embed.T if self.lm_head is None else self.lm_head


def param_shapes(cfg: ModelConfig, num_mtp_modules: int | None = None) -> Params:
    """The parameter tree with jax.ShapeDtypeStruct leaves: every shape, no memory."""
    h, i = cfg.hidden_size, cfg.intermediate_size

    def leaf(*shape):
        return jax.ShapeDtypeStruct(shape, cfg.jnp_dtype)

    def layer():
        return LayerParams(
            input_norm=leaf(h),
            q_proj=leaf(h, cfg.q_size),
            k_proj=leaf(h, cfg.kv_size),
            v_proj=leaf(h, cfg.kv_size),
            o_proj=leaf(cfg.q_size, h),
            post_norm=leaf(h),
            gate_up_proj=leaf(h, 2, i),
            down_proj=leaf(i, h),
            q_bias=leaf(cfg.q_size) if cfg.qkv_bias else None,
            k_bias=leaf(cfg.kv_size) if cfg.qkv_bias else None,
            v_bias=leaf(cfg.kv_size) if cfg.qkv_bias else None,
            q_norm=leaf(cfg.head_dim) if cfg.qk_norm else None,
            k_norm=leaf(cfg.head_dim) if cfg.qk_norm else None,
        )

    n_mtp = cfg.num_mtp_modules if num_mtp_modules is None else num_mtp_modules
    return Params(
        embed=leaf(cfg.vocab_size, h),
        layers=[layer() for _ in range(cfg.num_layers)],
        final_norm=leaf(h),
        lm_head=None if cfg.tie_word_embeddings else leaf(h, cfg.vocab_size),
        mtp=[MTPParams(leaf(h), leaf(h), leaf(h, h), leaf(h, h), layer(), leaf(h)) for _ in range(n_mtp)],
    )


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "ones", "sharding"))
def _random_array(key, shape, dtype, ones, sharding):
    # one small compiled generator per (shape, sharding): a model has few, and one jit
    # over the whole model compiles for minutes at 8B. The random bits do not depend
    # on the sharding (jax_threefry_partitionable), so every tensor-parallel size gets
    # the same weights, each device making only its own shard.
    x = jnp.ones(shape, dtype) if ones else (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def random_params(cfg: ModelConfig, key: jax.Array, num_mtp_modules: int | None = None, shardings=None) -> Params:
    """Random weights of the right shapes and a sensible scale (std 0.02, unit norms).
    shardings, a tree like the params' of NamedShardings (jaxmtp.sharding.param_shardings),
    creates each array directly split over its devices."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg, num_mtp_modules))
    placements = [None] * len(leaves) if shardings is None else treedef.flatten_up_to(shardings)
    arrays = [
        _random_array(jax.random.fold_in(key, n), leaf.shape, leaf.dtype, "norm" in path[-1].name, sharding)
        for n, ((path, leaf), sharding) in enumerate(zip(leaves, placements))
    ]
    return treedef.unflatten(arrays)
