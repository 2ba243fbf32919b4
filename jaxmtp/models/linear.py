"""The one function every projection of the model goes through: x @ w, plus a bias
where the layer has one, for weights in the model's dtype and for fp8 weights with
block scales (jaxmtp/models/quantization.py; jaxmtp.models.params.Fp8Weight). An fp8 weight's
`matmul` says how: the Pallas kernel (jaxmtp/kernels/fp8_matmul.py) on GPUs at its
measured tiling (or the dequantized dot where that measured faster), its jnp reference
(dequantize, then one float32 matmul) elsewhere. A weight in the model's dtype goes
through XLA's dot, except inside a step traced with dense kernels on
(dense_kernels_for: a GPU, one device, Pallas attention) where the measured table of the
dense Pallas kernel (jaxmtp.kernels.fp8_matmul.DENSE_TILINGS) names its shape and row
count."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmtp.kernels.fp8_matmul import (
    dense_matmul, dense_tiling, fp8_matmul_measured, fp8_matmul_reference, is_k_step,
)
from jaxmtp.kernels.grouped_matmul import supports as grouped_kernel_supports
from jaxmtp.models.config import check_attention_backend
from jaxmtp.models.params import Fp8Weight
from jaxmtp.models.quantization import Fp8BlockConfig
from jaxmtp.worker.sharding import full_spec, shard_per_device

log = logging.getLogger("jaxmtp.models.linear")

FP8_MATMULS = {
    "reference": fp8_matmul_reference,
    "pallas": fp8_matmul_measured,
    "pallas_interpret": functools.partial(fp8_matmul_measured, interpret=True),
}


def linear(x: jax.Array, w: jax.Array | Fp8Weight, bias: jax.Array | None = None) -> jax.Array:
    """x [T, K] times w [K, ...] (an [in, out] matrix, or gate and up stacked [K, 2, I]).
    A bias is added as nn.Linear adds it (addmm): to the float32 accumulator, before
    the one rounding to x's dtype; rounding the product first and then the sum again
    moves float16 logits measurably further from float32's (tests/test_parity.py)."""
    if isinstance(w, Fp8Weight):
        out = _fp8_linear(x, w, jnp.float32 if bias is not None else x.dtype)
    elif (tiling := _dense_kernel_tiling(x, w)) is not None:
        out = _dense_linear(x, w, tiling, jnp.float32 if bias is not None else x.dtype)
    elif bias is None:
        return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))
    else:
        out = jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return out if bias is None else (out + bias).astype(x.dtype)


# Whether linear() may take the dense kernel, set around a step's trace (dense_kernels);
# off elsewhere, so that other traces keep XLA's dot
_DENSE_KERNELS = contextvars.ContextVar("jaxmtp_dense_kernels", default=False)


def dense_kernels_for(attention_backend: str, mesh) -> bool:
    """Where the dense kernel may run: on a GPU, where the attention backend picks Pallas
    kernels (auto or pallas, as the fp8 matmul's fp8_matmul_for), on one device (no
    mesh, or a mesh of one: XLA cannot split a Pallas call, and would gather a sharded
    weight onto every device)."""
    check_attention_backend(attention_backend)
    one_device = mesh is None or mesh.size == 1
    return jax.default_backend() == "gpu" and one_device and attention_backend in ("auto", "pallas")


@contextlib.contextmanager
def dense_kernels(enabled: bool):
    """While tracing: linear() takes the dense kernel where its table names the shape and
    row count (enabled), else XLA's dot."""
    token = _DENSE_KERNELS.set(enabled)
    try:
        yield
    finally:
        _DENSE_KERNELS.reset(token)


def _dense_kernel_tiling(x: jax.Array, w: jax.Array):
    """The dense kernel's tiling where dense kernels are on and its table has this shape
    and row count (jaxmtp.kernels.fp8_matmul.dense_tiling)."""
    if not _DENSE_KERNELS.get() or x.ndim != 2 or w.dtype != x.dtype:
        return None
    return dense_tiling(x.shape[0], (w.shape[0], math.prod(w.shape[1:-1]), w.shape[-1]), x.dtype)


def _dense_linear(x: jax.Array, w: jax.Array, tiling, out_dtype) -> jax.Array:
    out = dense_matmul(x, w.reshape(w.shape[0], -1, w.shape[-1]), out_dtype=out_dtype, config=tiling)
    return out.reshape(x.shape[0], *w.shape[1:])


def _fp8_linear(x: jax.Array, w: Fp8Weight, out_dtype) -> jax.Array:
    """The matmul kernels' layout is [K, P, N] (P column groups: gate and up, or 1), or
    K-major [P, N, K]; under tensor parallelism each device multiplies its part."""
    out_shape = w.shape[1:]

    def matmul(x, weight, scale, out_dtype):
        weight = weight.reshape(-1, *weight.shape[-2:]) if w.k_major else weight.reshape(weight.shape[0], -1,
                                                                                            weight.shape[-1])
        scale = scale.reshape(scale.shape[0], -1, scale.shape[-1])
        layout = {"k_major": True} if w.k_major else {}
        return FP8_MATMULS[w.matmul](x, weight, scale, block_k=w.block[0], block_n=w.block[-1], out_dtype=out_dtype,
                                     **layout)

    if w.shards is None:
        out = matmul(x, w.weight, w.scale_inv, out_dtype)
    else:
        out = w.shards.run(matmul, x, w.weight, w.scale_inv, out_dtype)
    return out.reshape(x.shape[0], *out_shape)


@dataclasses.dataclass(frozen=True)
class Fp8Shards:
    """One device's part of a K-major fp8 weight [P.., N, K] under tensor parallelism,
    its block scales split with it: by N (a column-parallel projection: each device its
    columns of the output), by K (row-parallel: each device a partial sum over its part
    of K, summed over the devices in float32), or neither (every device the whole)."""

    mesh: Mesh
    weight: PartitionSpec  # of the K-major weight
    scale: PartitionSpec  # of the [in, out]-layout scales
    split: str | None  # "n", "k" or None

    def run(self, matmul, x, weight, scale, out_dtype):
        """matmul(x, weight, scale, out_dtype) -> [T, P, N] on each device's part."""
        axis = self.weight[-1] if self.split == "k" else self.weight[-2] if self.split == "n" else None

        def per_device(x, weight, scale):
            if self.split != "k":
                return matmul(x, weight, scale, out_dtype)
            return jax.lax.psum(matmul(x, weight, scale, jnp.float32), axis).astype(out_dtype)

        x_spec = PartitionSpec(None, axis) if self.split == "k" else PartitionSpec()
        out_spec = PartitionSpec(None, None, axis) if self.split == "n" else PartitionSpec()
        return shard_per_device(per_device, self.mesh, (x_spec, self.weight, self.scale), out_spec)(x, weight, scale)


def fp8_shards(w: Fp8Weight) -> Fp8Shards | None:
    """How the kernel multiplies by w ([in, out] layout, about to be held K-major) where
    it is sharded over a mesh of several devices; None where it cannot: a device's part
    of a split axis is not whole scale blocks (its scales would not be the part's), or an
    axis other than K and N splits."""
    mesh = w.weight.sharding.mesh
    weight, scale = (full_spec(a.sharding.spec, a.ndim) for a in (w.weight, w.scale_inv))
    if weight != scale or any(axis is not None for axis in weight[1:-1]):
        return None
    k_major = PartitionSpec(*weight[1:], weight[0])
    split = "k" if weight[0] is not None else "n" if weight[-1] is not None else None
    return Fp8Shards(mesh, k_major, PartitionSpec(*scale), split)


# The fp8 weights that linear() does not multiply by: jaxmtp/models/moe.py's experts,
# which kernels/grouped_matmul.py multiplies by, K-major on one device
EXPERT_WEIGHTS = frozenset({"experts_gate_up", "experts_down"})


def fp8_matmul_for(attention_backend: str, quantization: Fp8BlockConfig) -> str:
    """The fp8 matmul the engine runs: the Pallas kernel where the attention backend
    picks Pallas kernels (auto on a GPU, pallas, pallas_interpret), under tensor
    parallelism each device on its part (with_fp8_matmul: the reference for a weight
    whose parts are not whole scale blocks); the reference everywhere else."""
    check_attention_backend(attention_backend)
    matmul = attention_backend
    if attention_backend == "auto":
        matmul = "pallas" if jax.default_backend() == "gpu" else "reference"
    block_k = quantization.block_in
    if matmul != "reference" and not is_k_step(block_k):
        log.warning("fp8 matmuls run the jnp reference: the Pallas kernel steps K by the scale block, and "
                    "weight_block_size's %d is not a power of 2 >= 16", block_k)
        return "reference"
    return matmul


def with_fp8_matmul(params, matmul: str, *, in_place: bool = False):
    """params with every fp8 weight multiplied by `matmul` (one of FP8_MATMULS), in the
    layout that path reads: K-major for the Pallas kernel (fp8 tiles along K feed its
    MMA without a transpose in shared memory: 1.3-1.6x faster at decode on the H200,
    docs/benchmarks/2026-12-03_H200_fp8_sweep_k_major.json; the grouped kernel's fp8
    tile along N is read from shared memory byte by byte), [in, out] for the reference;
    sharded over several devices, each with its Fp8Shards (the reference where
    fp8_shards finds none), the experts in their loaded layout (expert parallelism
    shards them as loaded: jaxmtp.worker.sharding), as are experts the grouped kernel
    cannot tile. in_place: a weight
    changing layout is moved and its old buffer freed at once, which params loses (a
    model that fills the device in fp8 has no room for a second copy); else copied. An
    array two leaves share is moved once."""
    moves = {}

    def move(a, axes):
        if (id(a), axes) not in moves:
            moves[id(a), axes] = _moved(a, axes, in_place)
        return moves[id(a), axes]

    def convert(path, w):
        if not isinstance(w, Fp8Weight):
            return w
        if w.k_major:  # back to the loaded layout first
            w = dataclasses.replace(w, weight=move(w.weight, (-1, w.in_axis)), k_major=False, shards=None)
        sharded = _sharded(w.weight)
        if matmul == "reference" or (path[-1].name in EXPERT_WEIGHTS and (sharded or not _grouped_kernel_takes(w))):
            return dataclasses.replace(w, matmul=matmul)
        if path[-1].name in EXPERT_WEIGHTS:
            return dataclasses.replace(w, weight=move(w.weight, (w.in_axis, -1)), k_major=True, matmul=matmul)
        shards = fp8_shards(w) if sharded else None
        if sharded and shards is None:
            log.info("fp8 %s: a device's part is not whole scale blocks; the jnp reference multiplies by it",
                     jax.tree_util.keystr(path))
            return dataclasses.replace(w, matmul="reference")
        return dataclasses.replace(w, weight=move(w.weight, (0, -1)), k_major=True, matmul=matmul, shards=shards)

    return jax.tree_util.tree_map_with_path(convert, params, is_leaf=lambda x: isinstance(x, Fp8Weight))


def _grouped_kernel_takes(w: Fp8Weight) -> bool:
    """Whether the grouped kernel multiplies by these experts [E, K, (2,) N]; where it
    does not, the reference does, which would move a K-major weight back every call."""
    groups, k = w.shape[:2]
    return grouped_kernel_supports(groups, k, math.prod(w.shape[2:]))


def _sharded(a: jax.Array) -> bool:
    return isinstance(a.sharding, NamedSharding) and a.sharding.mesh.size > 1


def _moved(weight: jax.Array, axes: tuple[int, int], in_place: bool) -> jax.Array:
    """weight with an axis moved, its sharding moved alike; in_place: weight's buffer
    freed once the moved copy exists."""
    sharding = weight.sharding
    if isinstance(sharding, NamedSharding):
        spec = list(full_spec(sharding.spec, weight.ndim))
        spec.insert(axes[1] % weight.ndim, spec.pop(axes[0]))
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec))
    moved = jax.jit(lambda a: jnp.moveaxis(a, *axes), out_shardings=sharding)(weight)
    if in_place:
        weight.delete()
    return moved
