"""Qwen3-Next's and Qwen3.5's hybrid layers as the engine keeps them
(jaxmtp.models.params.LinearAttentionParams, HybridLayerParams): the linear attention's
projections and conv grouped by key head, and the gated full attention's query and gate
apart. Qwen3-Next stores in_proj_qkvz and in_proj_ba grouped already; Qwen3.5 stores
in_proj_qkv (q, k, v of all heads), in_proj_z, in_proj_b and in_proj_a, regrouped here.
Every regrouping is a reference to blocks of the stored tensors: each device still reads
only its own block from disk."""

from __future__ import annotations

from jaxmtp.loading.tensor_source import TensorSource, concat_refs, slice_ref, stack_refs
from jaxmtp.models.config import ModelConfig
from jaxmtp.models.params import LinearAttentionParams


# a tensor that only a layer of each kind holds
KIND_MARKERS = {"linear_attention": "linear_attn.out_proj.weight", "full_attention": "self_attn.o_proj.weight"}


def check_layer_kind(src: TensorSource, prefix: str, cfg: ModelConfig, layer: int) -> None:
    """A ValueError naming layer_types where main-model layer `layer` (stored under
    prefix) holds the other kind's tensors than config.json places there."""
    kind = cfg.hybrid.layer_types[layer]
    (other,) = set(KIND_MARKERS) - {kind}
    if f"{prefix}.{KIND_MARKERS[kind]}" not in src and f"{prefix}.{KIND_MARKERS[other]}" in src:
        raise ValueError(f"config.json's layer_types (or full_attention_interval) places {kind} at layer {layer}, "
                         f"but the checkpoint holds {other} there ({prefix}.{KIND_MARKERS[other]}): "
                         "the layer pattern does not match the weights")


def linear_attention_refs(src: TensorSource, attn: str, cfg: ModelConfig) -> LinearAttentionParams:
    """The gated DeltaNet of one layer, stored under attn (`...linear_attn`)."""
    la, q = cfg.hybrid, cfg.quantization
    groups, r = range(la.linear_num_key_heads), la.value_heads_per_key
    if f"{attn}.in_proj_qkvz.weight" in src:  # Qwen3-Next: grouped as stored, out axis [Hk * width]
        qkvz, ba = src.weight_ref(f"{attn}.in_proj_qkvz", q), src.ref(f"{attn}.in_proj_ba.weight", transpose=True)
        width = la.qkvz_group_width
        in_proj_qkvz = stack_refs(tuple(slice_ref(qkvz, 1, g * width, (g + 1) * width) for g in groups), 1)
        in_proj_ba = stack_refs(tuple(slice_ref(ba, 1, g * 2 * r, (g + 1) * 2 * r) for g in groups), 1)
    else:  # Qwen3.5
        qkv, z = src.weight_ref(f"{attn}.in_proj_qkv", q), src.weight_ref(f"{attn}.in_proj_z", q)
        b, a = (src.ref(f"{attn}.in_proj_{name}.weight", transpose=True) for name in ("b", "a"))
        v_width = r * la.linear_value_head_dim
        in_proj_qkvz = stack_refs(tuple(concat_refs(
            tuple(slice_ref(qkv, 1, lo, hi) for lo, hi in _qkv_blocks(cfg, g))
            + (slice_ref(z, 1, g * v_width, (g + 1) * v_width),), 1) for g in groups), 1)
        in_proj_ba = stack_refs(tuple(concat_refs(
            tuple(slice_ref(x, 1, g * r, (g + 1) * r) for x in (b, a)), 1) for g in groups), 1)
    conv = src.ref(f"{attn}.conv1d.weight", fixed=((1, 0),))  # [C, 1, K] stored: channels q, k, v of all heads
    return LinearAttentionParams(
        in_proj_qkvz=in_proj_qkvz,
        in_proj_ba=in_proj_ba,
        conv1d=stack_refs(tuple(concat_refs(tuple(slice_ref(conv, 0, lo, hi) for lo, hi in _qkv_blocks(cfg, g)), 0)
                                for g in groups), 0),
        dt_bias=src.ref(f"{attn}.dt_bias", dtype="float32"),
        a_log=src.ref(f"{attn}.A_log", dtype="float32"),
        norm=src.ref(f"{attn}.norm.weight"),
        out_proj=src.weight_ref(f"{attn}.out_proj", q),
    )


def _qkv_blocks(cfg: ModelConfig, g: int) -> tuple[tuple[int, int], ...]:
    """Key head g's q, k and v among channels that hold q, k and v of all heads, in turn
    (the conv's, Qwen3.5's in_proj_qkv's out axis)."""
    la = cfg.hybrid
    dk, v_width = la.linear_key_head_dim, la.value_heads_per_key * la.linear_value_head_dim
    key_dim = la.linear_num_key_heads * dk
    return ((g * dk, (g + 1) * dk), (key_dim + g * dk, key_dim + (g + 1) * dk),
            (2 * key_dim + g * v_width, 2 * key_dim + (g + 1) * v_width))


def gated_query_refs(src: TensorSource, attn: str, cfg: ModelConfig) -> tuple:
    """(q_proj, attn_gate) [H, Hq*D] each, from q_proj.weight, which holds per head its
    query, then its output gate."""
    packed, d = src.weight_ref(f"{attn}.q_proj", cfg.quantization), cfg.head_dim
    return tuple(concat_refs(tuple(slice_ref(packed, 1, (2 * h + which) * d, (2 * h + which + 1) * d)
                                   for h in range(cfg.num_heads)), 1) for which in (0, 1))
