"""Parameter pytrees. Matrices are stored [in, out] so the forward pass is `x @ w`."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxmtp.models.config import ModelConfig


def pytree_dataclass(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(cls))


FP8 = jnp.float8_e4m3fn


@pytree_dataclass
class Fp8Weight:
    """A linear layer's weight in fp8, one float32 scale per block (jaxmtp/models/quantization.py):
    the weight is `weight * scale_inv` of its block. `weight` has the layout of the array
    it stands for ([in, out]; gate and up stacked [in, 2, out]; experts first), `block`
    the block's size along each axis (1 where every index has scales of its own: the
    gate/up and expert axes), so scale_inv has ceil(size / block) entries per axis."""

    weight: jax.Array  # float8_e4m3fn
    scale_inv: jax.Array  # float32
    block: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))
    # how jaxmtp.models.linear multiplies by it: "reference", "pallas" or "pallas_interpret"
    matmul: str = dataclasses.field(default="reference", metadata=dict(static=True))
    # weight held K-major, its in axis moved last ([out, in]; gate and up [2, out, in];
    # experts [E, (2,) out, in]), as the Pallas kernels read it
    # (jaxmtp.models.linear.with_fp8_matmul); scale_inv and block keep the [in, out]
    # layout either way
    k_major: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # under tensor parallelism on the kernel's path, how each device multiplies by its
    # part (jaxmtp.models.linear.Fp8Shards); None on one device and for the reference
    shards: object = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def in_axis(self) -> int:
        """The in axis of the array it stands for: 1 for experts [E, in, (2,) out], whose
        block along the experts' axis is 1, else 0. (A dense gate/up [in, 2, out] with an
        in block of 1 would read as experts; such a block never runs K-major, the only
        layout this decides.)"""
        return 1 if len(self.block) > 2 and self.block[0] == 1 else 0

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the array it stands for ([in, out], ...), in either layout."""
        shape, axis = self.weight.shape, self.in_axis
        return (*shape[:axis], shape[-1], *shape[axis:-1]) if self.k_major else shape

    @property
    def in_major_weight(self) -> jax.Array:
        """weight in the layout of the array it stands for."""
        return jnp.moveaxis(self.weight, -1, self.in_axis) if self.k_major else self.weight


@pytree_dataclass
class MLAParams:
    """Multi-head latent attention's projections (DeepSeek-V3); the output projection
    is LayerParams.o_proj. Heads are the major part of every per-head output dim."""

    kv_a_proj: jax.Array  # [H, R + Dr]: the latent, then the shared rope key
    kv_a_norm: jax.Array  # [R]
    # [Dn + Dv, Hq, R]: the absorbed form's W_UK (the first Dn rows) and W_UV, each a
    # contiguous half that the step's products read in place (split per head, as the
    # checkpoints store it, they would be copied apart every step); in the model's dtype
    # (an fp8 checkpoint's dequantized once, when loaded)
    kv_b_proj: jax.Array
    q_proj: jax.Array | None = None  # [H, Hq*(Dn + Dr)] without q_lora_rank
    q_a_proj: jax.Array | None = None  # [H, Rq]
    q_a_norm: jax.Array | None = None  # [Rq]
    q_b_proj: jax.Array | None = None  # [Rq, Hq*(Dn + Dr)]


@pytree_dataclass
class MoEParams:
    """Routed experts plus shared experts. The router stays float32, as the
    checkpoints keep it: its scores pick experts, and rounding would change picks."""

    router: jax.Array  # [H, E] float32
    router_bias: jax.Array | None  # [E] float32: e_score_correction_bias, for selection only (noaux_tc)
    experts_gate_up: jax.Array  # [E, H, 2, I]
    experts_down: jax.Array  # [E, I, H]
    shared_gate_up: jax.Array | None = None  # [H, 2, Is]
    shared_down: jax.Array | None = None  # [Is, H]
    shared_gate: jax.Array | None = None  # [H] float32: Qwen's shared_expert_gate, a Linear(H, 1)'s one row
    # where not 0, the shared experts are experts_gate_up/down's first groups, of
    # moe_intermediate_size columns each, which every row takes with weight 1, and
    # shared_gate_up/down are None (expert_layout.with_shared_in_experts)
    shared_in_experts: int = dataclasses.field(default=0, metadata=dict(static=True))


@pytree_dataclass
class LinearAttentionParams:
    """Gated DeltaNet (Qwen3-Next, Qwen3.5), its heads grouped by key head: Hk groups,
    group g being key head g's q and k (Dk wide each) and its r = Hv / Hk value heads
    g*r .. g*r + r - 1 (v and z, Dv wide each; b and a, one value each), in transformers'
    order after fix_query_key_value_ordering. Within a group in_proj_qkvz's columns are
    q, k, v, z, and conv1d's channels q, k, v: x @ in_proj_qkvz ([T, Hk, W]) feeds its
    first conv_group_width columns through the causal depthwise conv and splits every
    group at the same offsets, with no gather. This is Qwen3-Next's in_proj_qkvz and
    in_proj_ba as stored (transposed, the out axis split by group); Qwen3.5's separate
    in_proj_qkv/z/b/a and every conv1d (whose channels are q, k, v of all heads) are
    regrouped while loading. Under tensor parallelism each device holds whole groups."""

    in_proj_qkvz: jax.Array  # [H, Hk, 2*Dk + 2*r*Dv]
    in_proj_ba: jax.Array  # [H, Hk, 2*r]: per group b (beta = sigmoid(b)), then a (the decay's input)
    conv1d: jax.Array  # [Hk, 2*Dk + r*Dv, K]: each channel's taps, the oldest first (conv1d.weight[:, 0])
    dt_bias: jax.Array  # [Hv] float32
    a_log: jax.Array  # [Hv] float32: A_log; the decay is g = -exp(A_log) * softplus(a + dt_bias)
    norm: jax.Array  # [Dv]: the gated RMSNorm's weight, w * norm(o) * silu(z) (not zero-centred)
    out_proj: jax.Array  # [Hv*Dv, H], rows value head-major


@pytree_dataclass
class LayerParams:
    """One decoder layer: GQA attention (q/k/v_proj) or MLA (mla), then a dense MLP
    (gate_up_proj, down_proj) or experts (moe). Only the subclasses have the fields
    most layers lack (experts, MLA, the o_proj and MLP biases): the Llama family's
    trees, and the checkpoints orbax wrote of them, stay as they were."""

    input_norm: jax.Array  # [H]
    # [H, Hq*D]; with k_proj and v_proj None, q, k and v side by side [H, Hq*D + 2*Hkv*D]
    # (with_merged_qkv; q_bias likewise)
    q_proj: jax.Array | None = None
    k_proj: jax.Array | None = None  # [H, Hkv*D]
    v_proj: jax.Array | None = None  # [H, Hkv*D]
    o_proj: jax.Array = None  # [Hq*D, H] (MLA: [Hq*Dv, H])
    post_norm: jax.Array = None  # [H]
    # gate and up stacked: one matmul reads both (two cost a second launch and stream at
    # a lower share of bandwidth; docs/benchmarks/README.md); [H, 2, I] rather than [H, 2I] so that
    # splitting I over devices keeps each device's gate and up columns together
    gate_up_proj: jax.Array | None = None  # [H, 2, I]
    down_proj: jax.Array | None = None  # [I, H]
    q_bias: jax.Array | None = None  # Qwen2 / MiMo / GLM-4.5
    k_bias: jax.Array | None = None
    v_bias: jax.Array | None = None
    q_norm: jax.Array | None = None  # Qwen3 / GLM-4.5: RMSNorm over each head's D
    k_norm: jax.Array | None = None
    mla = None  # class attributes, not fields: see the subclasses
    moe = None
    linear_attention = None
    attn_gate = None
    o_bias = None
    gate_up_bias = None
    down_bias = None


@pytree_dataclass
class ExpertLayerParams(LayerParams):
    """A DeepSeek-V3- or GLM-4.5-class layer (ModelConfig.moe set)."""

    mla: MLAParams | None = None
    moe: MoEParams | None = None


@pytree_dataclass
class HybridLayerParams(LayerParams):
    """A Qwen3-Next or Qwen3.5 layer (ModelConfig.hybrid set): linear attention
    (linear_attention; q/k/v/o_proj and the q/k norms None) or full attention with a
    sigmoid output gate (attn_gate), then experts (moe) or a dense MLP. Its RMSNorm
    weights are 1 + w, folded in float32 (ModelConfig.zero_centred_norm)."""

    moe: MoEParams | None = None
    linear_attention: LinearAttentionParams | None = None
    # [H, Hq*D]: out * sigmoid(x @ attn_gate) before o_proj; transformers' q_proj packs it
    # per head after the head's query, and q_proj here holds the queries alone
    attn_gate: jax.Array | None = None


@pytree_dataclass
class BiasedLayerParams(LayerParams):
    """A Llama-family layer with biases beyond q/k/v's (ModelConfig.o_bias or mlp_bias)."""

    o_bias: jax.Array | None = None  # [H]: Llama's and Qwen3's attention_bias
    gate_up_bias: jax.Array | None = None  # [2, I]: Llama's mlp_bias
    down_bias: jax.Array | None = None  # [H]


def layer_params_class(cfg: ModelConfig) -> type[LayerParams]:
    """The decoder layers' pytree class: the fields the config's layers may have."""
    if cfg.hybrid is not None:
        return HybridLayerParams
    if cfg.moe is not None:
        return ExpertLayerParams
    return BiasedLayerParams if cfg.o_bias or cfg.mlp_bias else LayerParams


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

    def leaf(*shape, dtype=cfg.jnp_dtype):
        return jax.ShapeDtypeStruct(shape, dtype)

    def proj(*shape, in_axis=0):
        """A linear layer's weight [..., in, ..., out]: fp8 with block scales in a quantized model."""
        q = cfg.quantization
        if q is None:
            return leaf(*shape)
        block = tuple(q.block_in if a == in_axis else q.block_out if a == len(shape) - 1 else 1 for a in range(len(shape)))
        return Fp8Weight(leaf(*shape, dtype=FP8), leaf(*(-(-n // b) for n, b in zip(shape, block)), dtype=jnp.float32),
                         block)

    def mla():
        m, heads = cfg.mla, cfg.num_heads
        q_out = heads * m.qk_head_dim
        lora = m.q_lora_rank
        return MLAParams(
            kv_a_proj=proj(h, m.kv_lora_rank + m.qk_rope_head_dim),
            kv_a_norm=leaf(m.kv_lora_rank),
            kv_b_proj=leaf(m.qk_nope_head_dim + m.v_head_dim, heads, m.kv_lora_rank),
            q_proj=proj(h, q_out) if lora is None else None,
            q_a_proj=proj(h, lora) if lora is not None else None,
            q_a_norm=leaf(lora) if lora is not None else None,
            q_b_proj=proj(lora, q_out) if lora is not None else None,
        )

    def norm(*shape):
        """An RMSNorm weight, in float32 where zero-centred (ModelConfig.norm_dtype)."""
        return leaf(*shape, dtype=jnp.dtype(cfg.norm_dtype))

    def moe():
        e, mi, shared = cfg.moe.num_experts, cfg.moe.moe_intermediate_size, cfg.moe.shared_intermediate_size
        return MoEParams(
            router=leaf(h, e, dtype=jnp.float32),
            router_bias=leaf(e, dtype=jnp.float32) if cfg.moe.routing == "noaux_tc" else None,
            experts_gate_up=proj(e, h, 2, mi, in_axis=1),
            experts_down=proj(e, mi, h, in_axis=1),
            shared_gate_up=proj(h, 2, shared) if shared else None,
            shared_down=proj(shared, h) if shared else None,
            shared_gate=leaf(h, dtype=jnp.float32) if cfg.moe.shared_expert_gate else None,
        )

    def linear_attention():
        la = cfg.hybrid
        hk, hv = la.linear_num_key_heads, la.linear_num_value_heads
        return LinearAttentionParams(
            in_proj_qkvz=proj(h, hk, la.qkvz_group_width),
            in_proj_ba=leaf(h, hk, 2 * la.value_heads_per_key),
            conv1d=leaf(hk, la.conv_group_width, la.linear_conv_kernel_dim),
            dt_bias=leaf(hv, dtype=jnp.float32),
            a_log=leaf(hv, dtype=jnp.float32),
            norm=leaf(la.linear_value_head_dim),
            out_proj=proj(hv * la.linear_value_head_dim, h),
        )

    def layer(index):
        linear = cfg.layer_is_linear(index)
        gqa = cfg.mla is None and not linear
        dense = not cfg.layer_is_moe(index)
        kind, extra = layer_params_class(cfg), {}
        if kind is HybridLayerParams:
            extra = dict(moe=None if dense else moe(), linear_attention=linear_attention() if linear else None,
                         attn_gate=proj(h, cfg.q_size) if gqa else None)
        elif kind is ExpertLayerParams:
            extra = dict(mla=None if gqa else mla(), moe=None if dense else moe())
        elif kind is BiasedLayerParams:
            extra = dict(o_bias=leaf(h) if cfg.o_bias else None, gate_up_bias=leaf(2, i) if cfg.mlp_bias else None,
                         down_bias=leaf(h) if cfg.mlp_bias else None)
        attention_out = cfg.q_size if cfg.mla is None else cfg.num_heads * cfg.mla.v_head_dim
        return kind(
            **extra,
            input_norm=norm(h),
            q_proj=proj(h, cfg.q_size) if gqa else None,
            k_proj=proj(h, cfg.kv_size) if gqa else None,
            v_proj=proj(h, cfg.kv_size) if gqa else None,
            o_proj=None if linear else proj(attention_out, h),
            post_norm=norm(h),
            gate_up_proj=proj(h, 2, i) if dense else None,
            down_proj=proj(i, h) if dense else None,
            q_bias=leaf(cfg.q_size) if cfg.qkv_bias else None,
            k_bias=leaf(cfg.kv_size) if cfg.qkv_bias else None,
            v_bias=leaf(cfg.kv_size) if cfg.qkv_bias else None,
            q_norm=norm(cfg.head_dim) if cfg.qk_norm and not linear else None,
            k_norm=norm(cfg.head_dim) if cfg.qk_norm and not linear else None,
        )

    n_mtp = cfg.num_mtp_modules if num_mtp_modules is None else num_mtp_modules
    return Params(
        embed=leaf(cfg.vocab_size, h),
        layers=[layer(n) for n in range(cfg.num_layers)],
        final_norm=norm(h),
        lm_head=None if cfg.tie_word_embeddings else leaf(h, cfg.vocab_size),
        mtp=[MTPParams(norm(h), norm(h), leaf(h, h), leaf(h, h), layer(cfg.num_layers + n), norm(h)) for n in range(n_mtp)],
    )


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "ones", "scale", "sharding"))
def _random_array(key, shape, dtype, ones, scale, sharding):
    # one small compiled generator per (shape, sharding): a model has few, and one jit
    # over the whole model compiles for minutes at 8B. The random bits do not depend
    # on the sharding (jax_threefry_partitionable), so every tensor-parallel size gets
    # the same weights, each device making only its own shard.
    x = jnp.ones(shape, jnp.float32) if ones else jax.random.normal(key, shape, jnp.float32)
    x = (scale * x).astype(dtype)
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def _random_init(name: str, dtype) -> tuple[bool, float]:
    """(ones, scale) of a parameter: unit norms; weights of std 0.02, fp8 ones as
    N(0, 1) values times scales of 0.02."""
    if "norm" in name:
        return True, 1.0
    if name == "scale_inv":
        return True, 0.02
    return False, 1.0 if dtype == FP8 else 0.02


def random_params(cfg: ModelConfig, key: jax.Array, num_mtp_modules: int | None = None, shardings=None) -> Params:
    """Random weights of the right shapes and a sensible scale (std 0.02, unit norms;
    fp8 weights with block scales in a quantized model). shardings, a tree like the
    params' of NamedShardings (jaxmtp.worker.sharding.param_shardings), creates each array
    directly split over its devices."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg, num_mtp_modules))
    placements = [None] * len(leaves) if shardings is None else treedef.flatten_up_to(shardings)
    arrays = [
        _random_array(jax.random.fold_in(key, n), leaf.shape, leaf.dtype, *_random_init(path[-1].name, leaf.dtype),
                      sharding)
        for n, ((path, leaf), sharding) in enumerate(zip(leaves, placements))
    ]
    return treedef.unflatten(arrays)
