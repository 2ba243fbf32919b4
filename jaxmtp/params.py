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
    gate_proj: jax.Array  # [H, I]
    up_proj: jax.Array  # [H, I]
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


@functools.partial(jax.jit, static_argnums=(1, 2))
def _scaled_normal(key, shape, dtype):
    # one small compiled generator per shape: a model has few distinct shapes, and
    # one jit over the whole model takes minutes to compile at 8B
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def random_params(cfg: ModelConfig, key: jax.Array, num_mtp_modules: int | None = None) -> Params:
    """Random weights of the right shapes and a sensible scale (std 0.02, unit norms)."""
    dtype = cfg.jnp_dtype
    keys = iter(jax.random.split(key, 4096))

    def dense(n_in, n_out):
        return _scaled_normal(next(keys), (n_in, n_out), dtype)

    def ones(n):
        return jnp.ones((n,), dtype)

    def layer():
        h, i = cfg.hidden_size, cfg.intermediate_size
        return LayerParams(
            input_norm=ones(h),
            q_proj=dense(h, cfg.q_size),
            k_proj=dense(h, cfg.kv_size),
            v_proj=dense(h, cfg.kv_size),
            o_proj=dense(cfg.q_size, h),
            post_norm=ones(h),
            gate_proj=dense(h, i),
            up_proj=dense(h, i),
            down_proj=dense(i, h),
            q_bias=dense(1, cfg.q_size)[0] if cfg.qkv_bias else None,
            k_bias=dense(1, cfg.kv_size)[0] if cfg.qkv_bias else None,
            v_bias=dense(1, cfg.kv_size)[0] if cfg.qkv_bias else None,
            q_norm=ones(cfg.head_dim) if cfg.qk_norm else None,
            k_norm=ones(cfg.head_dim) if cfg.qk_norm else None,
        )

    h = cfg.hidden_size
    n_mtp = cfg.num_mtp_modules if num_mtp_modules is None else num_mtp_modules
    return Params(
        embed=dense(cfg.vocab_size, h),
        layers=[layer() for _ in range(cfg.num_layers)],
        final_norm=ones(h),
        lm_head=None if cfg.tie_word_embeddings else dense(h, cfg.vocab_size),
        mtp=[
            MTPParams(ones(h), ones(h), dense(h, h), dense(h, h), layer(), ones(h))
            for _ in range(n_mtp)
        ],
    )
