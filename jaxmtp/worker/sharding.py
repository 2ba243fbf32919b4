"""Tensor parallelism: the sharding rules, written once.

Every array is described by logical axis names (what each dimension is); LOGICAL_RULES
maps a logical axis to the mesh axis that splits it, or None to keep it whole. This is
Megatron-style tensor parallelism: attention heads and the MLP intermediate are split,
so q/k/v and gate/up are column-parallel, o_proj and down_proj row-parallel (XLA adds
one all-reduce after each), and the KV cache is split by kv head so that each device
attends with its own heads. The vocabulary is split too: the LM head is the largest
single matrix a decode step reads, and a tied embedding must shard like its head.
Routed experts are split over the same axis (expert parallel), each device holding
whole experts. MLA's latent cache has no head dimension: it is whole on every device.
Everything else (norms, the residual stream, the router, the batch) is replicated.

The model code never names a mesh axis: XLA's SPMD partitioner propagates these
shardings through the matmuls, and the attention (KV write plus kernel), the routed
experts and the greedy argmax over the vocabulary run per shard under shard_map
(shard_per_device), with specs from the same rules.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmtp.models.config import ModelConfig
from jaxmtp.models.params import Fp8Weight

TP = "tp"  # the mesh's one axis: devices that split heads, ffn and vocabulary

LOGICAL_RULES: dict[str, str | None] = {
    "heads": TP,
    "kv_heads": TP,
    "ffn": TP,
    "gate_or_up": None,  # gate_up_proj's stacking axis: each device has both halves
    "vocab": TP,
    "embed": None,  # the residual stream stays whole on every device
    "head_dim": None,
    "tokens": None,
    "pages": None,
    "page_slots": None,
    "latent": None,  # MLA's compressed latents (kv_lora_rank, q_lora_rank)
    "latent_heads": None,  # MLA's cache: one latent "kv head" that every q head reads
    "experts": TP,  # routed experts: expert parallel over the same axis
    "router_experts": None,  # the router's scores: every device routes every token
    "moe_ffn": None,  # one expert's intermediate stays whole on its device
    "linear_group": None,  # one key head's group of linear-attention columns or conv channels
    "conv_taps": None,
    "slots": None,  # the recurrent state's tables (jaxmtp.worker.recurrent): a slot per sequence,
    "versions": None,  # its kept versions, and a head's
    "key_dim": None,  # [key, value] state matrix
    "value_dim": None,
}

# Parameter fields (of LayerParams, MTPParams and Params; a name means the same thing
# wherever it appears) -> logical axes of the stored [in, out] array. q/k/v are stored
# with heads flattened into their output dim (Hq*D), head-major, so splitting that dim
# in N contiguous blocks gives each device whole heads, and their biases split alike.
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("embed",),
    "input_norm": ("embed",),
    "post_norm": ("embed",),
    "q_proj": ("embed", "heads"),
    "k_proj": ("embed", "kv_heads"),
    "v_proj": ("embed", "kv_heads"),
    "o_proj": ("heads", "embed"),
    "q_bias": ("heads",),
    "k_bias": ("kv_heads",),
    "v_bias": ("kv_heads",),
    "q_norm": ("head_dim",),  # one [D] weight shared by every head
    "k_norm": ("head_dim",),
    "gate_up_proj": ("embed", "gate_or_up", "ffn"),
    "down_proj": ("ffn", "embed"),
    "o_bias": ("embed",),  # added once, after the all-reduce
    "gate_up_bias": ("gate_or_up", "ffn"),
    "down_bias": ("embed",),
    # MTP module: its block is a LayerParams and shards like a decoder layer. The two
    # [H, H] input projections stay whole: split, they would add an all-reduce of the
    # rows for about 15% of the block's weights.
    "token_norm": ("embed",),
    "hidden_norm": ("embed",),
    "proj_token": ("embed", "embed"),
    "proj_hidden": ("embed", "embed"),
    # MLA (MLAParams; q_proj as above): per-head outputs split by heads
    "kv_a_proj": ("embed", "latent"),
    "kv_a_norm": ("latent",),
    "kv_b_proj": ("head_dim", "heads", "latent"),
    "q_a_proj": ("embed", "latent"),
    "q_a_norm": ("latent",),
    "q_b_proj": ("latent", "heads"),
    # mixture of experts (MoEParams)
    "router": ("embed", "router_experts"),
    "router_bias": ("router_experts",),
    "experts_gate_up": ("experts", "embed", "gate_or_up", "moe_ffn"),
    "experts_down": ("experts", "moe_ffn", "embed"),
    "shared_gate_up": ("embed", "gate_or_up", "ffn"),
    "shared_down": ("ffn", "embed"),
    "shared_gate": ("embed",),  # every device scales its columns of the shared expert alike
    # Qwen3-Next / Qwen3.5 (HybridLayerParams, LinearAttentionParams): the gated full
    # attention's gate splits like q; linear attention by key-head group, each device
    # whole groups (a key head and its value heads: value heads are key-head major)
    "attn_gate": ("embed", "heads"),
    "in_proj_qkvz": ("embed", "heads", "linear_group"),
    "in_proj_ba": ("embed", "heads", "linear_group"),
    "conv1d": ("heads", "linear_group", "conv_taps"),
    "dt_bias": ("heads",),
    "a_log": ("heads",),
    "norm": ("head_dim",),
    "out_proj": ("heads", "embed"),
}

CACHE_AXES = ("pages", "page_slots", "kv_heads", "head_dim")  # one layer's K or V pages
# one MLA layer's latent (or rope key) pages: whole on every device, as every device's
# q heads read all of it; split by its latent dim instead, the softmax would need an
# all-reduce of partial scores in every layer (docs/tensor-parallel.md)
LATENT_CACHE_AXES = ("pages", "page_slots", "latent_heads", "latent")
HIDDEN_PAGE_AXES = ("pages", "page_slots", "embed")  # one MTP module's output hidden states, paged
QUERY_AXES = ("tokens", "heads", "head_dim")  # attention's q rows and its output
# Gated DeltaNet's forms (jaxmtp.models.gated_delta): per value head, as the recurrent
# tables split (jaxmtp.worker.recurrent.SSM_AXES)
DELTA_KEY_AXES = ("tokens", "heads", "key_dim")  # q and k, spread over the value heads
DELTA_VALUE_AXES = ("tokens", "heads", "value_dim")  # v, the outputs
DELTA_GATE_AXES = ("tokens", "heads")  # g, beta
DELTA_STATE_AXES = ("slots", "heads", "key_dim", "value_dim")
DELTA_TAIL_AXES = ("slots", "versions", "heads", "key_dim", "value_dim")
# the chunked form's terms ([chunks, Hv, C, ...]; gated_delta.ChunkTerms)
CHUNK_VALUE_AXES = ("tokens", "heads", "tokens", "value_dim")  # u, the outputs
CHUNK_KEY_AXES = ("tokens", "heads", "tokens", "key_dim")  # w, q_decayed, k_to_end
CHUNK_ATTN_AXES = ("tokens", "heads", "tokens", "tokens")
NEW_KV_AXES = ("tokens", "kv_heads", "head_dim")  # this step's K/V rows, before the write
NEW_LATENT_AXES = ("tokens", "latent")  # this step's MLA latent or rope key rows, before the write
MLA_UP_AXES = ("latent", "heads", "head_dim")  # W_UK and W_UV (views of kv_b_proj) per head
ROWS_AXES = ("tokens", "embed")  # the residual stream's rows


def make_mesh(tensor_parallel_size: int) -> Mesh:
    """A one-axis mesh over the first N devices. N = 1 is the same code path."""
    devices = jax.devices()
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} is larger than the {len(devices)} "
            f"{jax.default_backend()} device(s) present"
        )
    # Auto axes: shardings propagate through the model (jax.make_mesh's default turned Explicit)
    return Mesh(np.array(devices[:tensor_parallel_size]), (TP,), axis_types=(jax.sharding.AxisType.Auto,))


def check_divisible(cfg: ModelConfig, tensor_parallel_size: int) -> None:
    """Heads, the MLP intermediates and the experts must split evenly: each device owns
    whole heads, the q heads of one kv head (its GQA group) must live on the kv head's
    device, and each device whole experts."""
    n = tensor_parallel_size
    sizes = [("num_heads", cfg.num_heads)] if cfg.mla is not None else [
        ("num_kv_heads", cfg.num_kv_heads), ("num_heads", cfg.num_heads)]
    if cfg.moe is None or cfg.moe.first_k_dense_replace:  # a dense MLP somewhere
        sizes.append(("intermediate_size", cfg.intermediate_size))
    if cfg.hybrid is not None:
        sizes.append(("linear_num_key_heads", cfg.hybrid.linear_num_key_heads))
    if cfg.moe is not None:
        sizes.append(("n_routed_experts", cfg.moe.num_experts))
        if cfg.moe.shared_expert_intermediate_size is not None:
            sizes.append(("shared_expert_intermediate_size", cfg.moe.shared_intermediate_size))
        elif cfg.moe.num_shared_experts:
            sizes.append(("shared experts' intermediate (moe_intermediate_size * n_shared_experts)",
                          cfg.moe.shared_intermediate_size))
    for name, size in sizes:
        if size % n:
            raise ValueError(f"tensor_parallel_size={n} does not divide the model's {name}={size}")


def logical_to_spec(axes: tuple[str, ...], shape: tuple[int, ...] | None = None, mesh: Mesh | None = None) -> PartitionSpec:
    """PartitionSpec of an array with these logical axes. Given its shape and the mesh, a
    dimension the mesh axis does not divide stays whole; check_divisible has already
    rejected heads and ffn, so only a vocabulary of odd size is replicated this way."""
    mesh_axes = []
    for i, axis in enumerate(axes):
        mesh_axis = LOGICAL_RULES[axis]
        if mesh_axis is not None and shape is not None and shape[i] % mesh.shape[mesh_axis]:
            mesh_axis = None
        mesh_axes.append(mesh_axis)
    return PartitionSpec(*mesh_axes)


def param_specs(params, mesh: Mesh) -> object:
    """PartitionSpec of every parameter, as a tree shaped like params. params may hold
    arrays (also traced ones), ShapeDtypeStructs or the loader's tensor references:
    anything with .shape. The rule is found by field name (list indices come before it
    in the path)."""
    def spec(path, leaf):
        axes = PARAM_AXES[path[-1].name]
        if len(axes) != len(leaf.shape):
            raise ValueError(f"{jax.tree_util.keystr(path)} has shape {leaf.shape}; the rules say {axes}")
        weight_spec = logical_to_spec(axes, leaf.shape, mesh)
        if isinstance(leaf, Fp8Weight):
            scale_spec = block_scale_spec(weight_spec, leaf.shape, leaf.block, mesh)
            return dataclasses.replace(leaf, weight=weight_spec, scale_inv=scale_spec)
        return weight_spec

    return jax.tree_util.tree_map_with_path(spec, params, is_leaf=lambda x: isinstance(x, Fp8Weight))


def full_spec(spec: PartitionSpec, ndim: int) -> tuple:
    """spec as a tuple with one entry per axis of an ndim array (None past its end)."""
    return tuple(spec) + (None,) * (ndim - len(spec))


def block_scale_spec(weight_spec: PartitionSpec, shape: tuple[int, ...], block: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """An fp8 weight's block scales split with it where each device's part of the weight
    is whole blocks (its scales then are whole rows or columns of the scales); where
    not, that axis of the scales stays whole on every device (they are small)."""
    axes = full_spec(weight_spec, len(shape))
    return PartitionSpec(*(
        axis if axis is None or (size // mesh.shape[axis]) % size_of_block == 0 else None
        for axis, size, size_of_block in zip(axes, shape, block)
    ))


def param_shardings(params, mesh: Mesh) -> object:
    """NamedSharding of every parameter, as a tree shaped like params (param_specs)."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(params, mesh),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def cache_axes(cfg: ModelConfig) -> tuple[str, ...]:
    """One cache layer's logical axes: K or V pages by kv head, or MLA's latent."""
    return CACHE_AXES if cfg.mla is None else LATENT_CACHE_AXES


def shards_of(axes: tuple[str, ...], tensor_parallel_size: int) -> int:
    """How many shards an array of these axes is split into (1: whole on every device)."""
    return tensor_parallel_size if TP in logical_to_spec(axes) else 1


def cache_sharding(mesh: Mesh, cfg: ModelConfig) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(cache_axes(cfg)))


def hidden_pages_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(HIDDEN_PAGE_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def put_replicated(tree, mesh: Mesh):
    """Host arrays whole on every device of the mesh, in one transfer. On a mesh over
    several processes each process places its own copy on its own devices: device_put
    would first check, with a collective, that every process passed the same value."""
    if jax.process_count() == 1:
        return jax.device_put(tree, replicated(mesh))
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(replicated(mesh), np.asarray(x)), tree)


def host_inputs(tree, mesh: Mesh):
    """Host arrays a compiled step takes whole on every device: on one process as they
    are, which the call places in its own dispatch (a device_put first is a second,
    slower pass over them: benchmarks/host.py --batch 1 on the CPU measured the host's
    time a step 0.84-1.01 ms this way against 1.33-1.66); on several processes
    put_replicated."""
    return tree if jax.process_count() == 1 else put_replicated(tree, mesh)


def gather_vocab(logits: jax.Array, mesh: Mesh) -> jax.Array:
    """Vocab-sharded logits [..., V] (the head's output) whole on every device.
    Sampling reads whole rows (argmax, sort, softmax): one all-gather here instead of
    the many small collectives XLA would put inside each of those, at a collective's
    latency each. Pinning the sharded side first keeps XLA from gathering the head
    (the weight) to meet the replicated result instead."""
    spec = logical_to_spec(("tokens",) * (logits.ndim - 1) + ("vocab",), logits.shape, mesh)
    logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, spec))
    return jax.lax.with_sharding_constraint(logits, replicated(mesh))


def argmax_vocab(logits: jax.Array, mesh: Mesh | None) -> jax.Array:
    """jnp.argmax(logits, axis=-1) of vocab-sharded logits [..., V], whole on every
    device, without gathering the logits: each device takes the argmax of its shard,
    one all-gather brings every device's (max, index) of each row, [..., 2] a device,
    and every device picks the same winner. Greedy steps and the MTP drafts read
    nothing else of the rows, so the [..., V] gather is not needed there.

    Ties break as jnp.argmax breaks them over the whole row, lowest index first: a
    device's local argmax is its lowest index at its maximum, and the shards are
    contiguous in device order, so the winner is the lowest device whose maximum is the
    row's (jnp.argmax over the devices' maxima; a NaN counts as the maximum in both).
    Without a mesh, on one device, or with a vocabulary the devices do not divide (the
    logits are whole already), it is jnp.argmax itself. Returns int32 [...]."""
    if mesh is None or mesh.shape[TP] == 1:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    spec = logical_to_spec(("tokens",) * (logits.ndim - 1) + ("vocab",), logits.shape, mesh)
    if spec[-1] is None:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    shard_size = logits.shape[-1] // mesh.shape[TP]
    if shard_size > 2**24:  # the index travels as a float32: exact below 2**24
        raise ValueError(f"a vocabulary shard of {shard_size} tokens is larger than 2**24")

    def pick(shard):
        index = jnp.argmax(shard, axis=-1)
        value = jnp.take_along_axis(shard, index[..., None], axis=-1)[..., 0]
        # one collective: the index rides with the value as a float32 (a normal float,
        # not bits reinterpreted, which flush-to-zero could touch)
        every = jax.lax.all_gather(jnp.stack([value.astype(jnp.float32), index.astype(jnp.float32)], axis=-1), TP)
        device = jnp.argmax(every[..., 0], axis=0)  # [...]: the lowest device at the row's maximum
        local = jnp.take_along_axis(every[..., 1], device[None], axis=0)[0]
        return (device * shard_size + local.astype(jnp.int32)).astype(jnp.int32)

    return shard_per_device(pick, mesh, (spec,), PartitionSpec(*spec[:-1]))(logits)


def _specs(axes):
    """Logical axes (a tuple of names; () replicated) as a PartitionSpec; a tuple of
    them as a tuple of specs; a tree of PartitionSpecs (param_specs) as it is."""
    if isinstance(axes, tuple) and not isinstance(axes, PartitionSpec):
        return logical_to_spec(axes) if all(isinstance(a, str) for a in axes) else tuple(map(_specs, axes))
    return axes


def shard_per_device(fn, mesh: Mesh, in_axes: tuple, out_axes: tuple):
    """fn(*args, **static) run per device under shard_map: argument i arrives as the
    device's shard of what in_axes[i] says (logical axes, or param_specs of a parameter
    tree), and the output leaves split as out_axes says (one array's logical axes, or a
    tuple of them). check_vma=False: the Pallas calls carry no varying-axis annotations
    for the checker."""
    def sharded(*args, **static):
        return jax.shard_map(
            functools.partial(fn, **static), mesh=mesh, in_specs=_specs(in_axes), out_specs=_specs(out_axes),
            check_vma=False,
        )(*args)

    return sharded


def shard_over_heads(write_and_attend, mesh: Mesh):
    """write_and_attend(q, k, v, k_pages, v_pages, slot_mapping, kv_lens, page_table,
    query_start, **static) run per device on its own heads and cache pages: the Pallas
    kernel and the KV scatter see one shard's arrays, exactly as on one device, and need
    no collective (each q head's kv head lives on its device). Returns (out, k_pages,
    v_pages), sharded alike."""
    return shard_per_device(
        write_and_attend, mesh, (QUERY_AXES, NEW_KV_AXES, NEW_KV_AXES, CACHE_AXES, CACHE_AXES) + ((),) * 4,
        (QUERY_AXES, CACHE_AXES, CACHE_AXES),
    )


def shard_mla_over_heads(write_and_attend, mesh: Mesh):
    """MLA's write_and_attend (jaxmtp.models.mla.mla_attention_fn) run per device on its own q
    heads and its own columns of kv_b_proj (W_UK, W_UV), with the whole latent cache:
    every device writes the same latent rows into its copy, and attends with no collective."""
    return shard_per_device(
        write_and_attend, mesh,
        (QUERY_AXES, (), (), NEW_LATENT_AXES, NEW_LATENT_AXES, LATENT_CACHE_AXES, LATENT_CACHE_AXES)
        + ((),) * 4 + (MLA_UP_AXES, MLA_UP_AXES),
        (QUERY_AXES, LATENT_CACHE_AXES, LATENT_CACHE_AXES),
    )


def array_spec(x, sharding=None) -> jax.ShapeDtypeStruct:
    """An array's shape, dtype and sharding (or `sharding`), what compiling needs of it."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding or x.sharding)
