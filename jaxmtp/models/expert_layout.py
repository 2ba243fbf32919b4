"""The shared experts as routed experts' groups: DeepSeek's n shared experts (one MLP of
n * moe_intermediate_size columns) are n experts of the routed experts' shape that every
row takes with weight 1, since an MLP's intermediate columns split into MLPs whose
outputs add up. Held as experts_gate_up/down's first groups, they go through the same
two grouped calls as the routed experts, and the shared MLP's own kernels (two GEMMs,
the SiLU-and-multiply, a split-K sum: four a layer in a batch-1 step on the H200) are
gone. For one device: expert parallelism splits the routed experts over the devices and
the shared MLP's columns apart. Checkpoints hold them apart (with_shared_apart)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxmtp.models.config import ModelConfig, MoEConfig
from jaxmtp.models.params import Fp8Weight, MoEParams, Params


def with_shared_in_experts(params: Params, cfg: ModelConfig, *, in_place: bool = False) -> Params:
    """shared_in_experts over every MoE layer, the MTP modules' too, one layer at a time.
    in_place: each layer's old arrays freed once its new ones exist, which params loses
    (a model that fills the device has no room for a second copy of its experts)."""
    return _map_moe(params, lambda p: shared_in_experts(p, cfg.moe, in_place=in_place))


def shared_in_experts(p: MoEParams, moe: MoEConfig, *, in_place: bool = False) -> MoEParams:
    """p with its shared experts moved into its routed experts' arrays as their first
    groups (MoEParams.shared_in_experts), where they can be: DeepSeek's unscaled shared
    experts of moe_intermediate_size columns each (Qwen's gated one, of a width of its
    own, stays apart), fp8 ones where each expert's columns are whole scale blocks of
    the routed experts' block."""
    n, width = moe.num_shared_experts, moe.moe_intermediate_size
    if (p.shared_gate_up is None or p.shared_gate is not None or moe.shared_intermediate_size != n * width
            or not (_splits(p.shared_gate_up, -1, n, width) and _splits(p.shared_down, 0, n, width))):
        return p
    gate_up = _each(p.shared_gate_up, lambda w: jnp.moveaxis(w.reshape(*w.shape[:2], n, -1), 2, 0), add_axis=True)
    down = _each(p.shared_down, lambda w: w.reshape(n, -1, *w.shape[1:]), add_axis=True)
    if not (_fits(gate_up, p.experts_gate_up) and _fits(down, p.experts_down)):
        return p
    folded = dataclasses.replace(p, experts_gate_up=_first(gate_up, p.experts_gate_up),
                                 experts_down=_first(down, p.experts_down), shared_gate_up=None, shared_down=None,
                                 shared_in_experts=n)
    if in_place:
        for array in jax.tree.leaves((p.experts_gate_up, p.experts_down, p.shared_gate_up, p.shared_down)):
            array.delete()
    return folded


def with_shared_apart(params: Params) -> Params:
    """with_shared_in_experts undone, over every MoE layer: as checkpoints hold them."""
    return _map_moe(params, shared_apart)


def shared_apart(p: MoEParams) -> MoEParams:
    """shared_in_experts undone: the shared experts as one MLP."""
    n = p.shared_in_experts
    if not n:
        return p
    (gate_up, routed_gate_up), (down, routed_down) = _split(p.experts_gate_up, n), _split(p.experts_down, n)
    return dataclasses.replace(
        p, experts_gate_up=routed_gate_up, experts_down=routed_down, shared_in_experts=0,
        shared_gate_up=_each(gate_up, lambda w: jnp.moveaxis(w, 0, 2).reshape(*w.shape[1:3], -1), add_axis=False),
        shared_down=_each(down, lambda w: w.reshape(-1, *w.shape[2:]), add_axis=False))


def _splits(w, axis: int, n: int, width: int) -> bool:
    """Whether w's columns along axis split into n experts of `width` with their scales:
    always unquantized; fp8 where the width is whole blocks (or one expert takes all)."""
    return not isinstance(w, Fp8Weight) or (not w.k_major and (n == 1 or width % w.block[axis] == 0))


def _each(w, reshape, add_axis: bool):
    """reshape over a weight and, fp8, over its block scales (the experts' axis, of
    block 1, added in front or taken off)."""
    if not isinstance(w, Fp8Weight):
        return reshape(w)
    block = (1, *w.block) if add_axis else w.block[1:]
    return dataclasses.replace(w, weight=reshape(w.weight), scale_inv=reshape(w.scale_inv), block=block)


def _fits(shared, experts) -> bool:
    """Whether shared's groups can stand beside the experts': the same shapes and dtype,
    fp8 ones' blocks and scales too."""
    if isinstance(shared, Fp8Weight) != isinstance(experts, Fp8Weight):
        return False
    if not isinstance(experts, Fp8Weight):
        return shared.shape[1:] == experts.shape[1:] and shared.dtype == experts.dtype
    return (shared.block == experts.block and not experts.k_major and shared.weight.shape[1:] == experts.weight.shape[1:]
            and shared.scale_inv.shape[1:] == experts.scale_inv.shape[1:])


def _first(shared, experts):
    """shared's groups, then the experts', along the experts' axis (fp8: with their
    scales), placed as the experts are."""
    if isinstance(experts, Fp8Weight):
        return dataclasses.replace(experts, weight=_first(shared.weight, experts.weight),
                                   scale_inv=_first(shared.scale_inv, experts.scale_inv))
    return jax.jit(lambda a, b: jnp.concatenate([a, b]), out_shardings=experts.sharding)(shared, experts)


def _split(experts, n: int) -> tuple:
    """experts' first n groups, and the rest (fp8: with their scales)."""
    if not isinstance(experts, Fp8Weight):
        return experts[:n], experts[n:]
    return tuple(dataclasses.replace(experts, weight=experts.weight[part], scale_inv=experts.scale_inv[part])
                 for part in (slice(None, n), slice(n, None)))


def _map_moe(params: Params, fn) -> Params:
    """fn over every MoE layer's MoEParams: the main model's and each MTP module's."""

    def layer(block):
        return block if getattr(block, "moe", None) is None else dataclasses.replace(block, moe=fn(block.moe))

    return dataclasses.replace(params, layers=[layer(b) for b in params.layers],
                               mtp=[dataclasses.replace(m, block=layer(m.block)) for m in params.mtp])
