"""The one function every projection of the model goes through: x @ w, plus a bias
where the layer has one, for weights in the model's dtype and for fp8 weights with
block scales (jaxmtp/models/quantization.py; jaxmtp.models.params.Fp8Weight). An fp8 weight's
`matmul` says how: the Pallas kernel (jaxmtp/kernels/fp8_matmul.py) on GPUs at its
measured tiling (or the dequantized dot where that measured faster), its jnp reference (dequantize, then one float32 matmul) elsewhere. A weight in the model's
dtype goes through XLA's dot, except inside a step traced with dense kernels on
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

from jaxmtp.kernels.fp8_matmul import (
    dense_matmul, dense_tiling, dequantize_blocks, fp8_matmul_measured, fp8_matmul_reference, is_k_step,
)
from jaxmtp.models.config import check_attention_backend
from jaxmtp.models.params import Fp8Weight
from jaxmtp.models.quantization import Fp8BlockConfig

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
    K-major [P, N, K]."""
    k, out_shape = w.shape[0], w.shape[1:]
    weight = w.weight.reshape(-1, *w.weight.shape[-2:]) if w.k_major else w.weight.reshape(k, -1, out_shape[-1])
    scale = w.scale_inv.reshape(w.scale_inv.shape[0], -1, w.scale_inv.shape[-1])
    matmul = FP8_MATMULS[w.matmul]
    layout = {"k_major": True} if w.k_major else {}
    out = matmul(x, weight, scale, block_k=w.block[0], block_n=w.block[-1], out_dtype=out_dtype, **layout)
    return out.reshape(x.shape[0], *out_shape)


# The fp8 weights that linear() does not multiply by, which keep the [in, out] layout on
# every matmul path: jaxmtp/models/moe.py's experts (the grouped kernels read [E, K, N])
# and jaxmtp/models/mla.py's absorbed kv_b_proj (dense() dequantizes it whole)
IN_MAJOR_WEIGHTS = frozenset({"experts_gate_up", "experts_down", "kv_b_proj"})


def dense(w: jax.Array | Fp8Weight, dtype) -> jax.Array:
    """The weight itself, in dtype (fp8: dequantized), for the products that are not
    x @ w (MLA's absorbed kv_b_proj)."""
    if not isinstance(w, Fp8Weight):
        return w
    return dequantize_blocks(w.in_major_weight, w.scale_inv, w.block).astype(dtype)


def fp8_matmul_for(attention_backend: str, num_devices: int, quantization: Fp8BlockConfig) -> str:
    """The fp8 matmul the engine runs: the Pallas kernel where the attention backend
    picks Pallas kernels (auto on a GPU, pallas, pallas_interpret), on one device; the
    reference under tensor parallelism (XLA cannot split a Pallas call, and would
    gather each weight whole onto every device) and everywhere else."""
    check_attention_backend(attention_backend)
    matmul = attention_backend
    if attention_backend == "auto":
        matmul = "pallas" if jax.default_backend() == "gpu" else "reference"
    if matmul != "reference" and num_devices > 1:
        log.info("fp8 matmuls run the jnp reference under tensor parallelism (the Pallas kernel is one device's)")
        return "reference"
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
    docs/benchmarks/2026-12-03_H200_fp8_sweep_k_major.json), [in, out] for the reference
    and for the weights in IN_MAJOR_WEIGHTS. in_place: a weight changing layout is
    moved in its own buffer, which params loses (a model that fills the device in fp8
    has no room for a second copy); else copied."""

    def convert(path, w):
        if not isinstance(w, Fp8Weight):
            return w
        k_major = matmul != "reference" and path[-1].name not in IN_MAJOR_WEIGHTS
        if k_major == w.k_major:
            return dataclasses.replace(w, matmul=matmul)
        axes = (0, -1) if k_major else (-1, 0)
        shape = jax.eval_shape(lambda a: jnp.moveaxis(a, *axes), w.weight).shape
        weight = (_moved_in_place if in_place else _moved)(w.weight, axes).reshape(shape)
        return dataclasses.replace(w, weight=weight, matmul=matmul, k_major=k_major)

    return jax.tree_util.tree_map_with_path(convert, params, is_leaf=lambda x: isinstance(x, Fp8Weight))


def _moved(weight: jax.Array, axes: tuple[int, int]) -> jax.Array:
    """weight with an axis moved, in weight's shape (the caller reshapes it), so that
    _moved_in_place can write it into weight's own buffer."""
    return jnp.moveaxis(weight, *axes).reshape(weight.shape)


_moved_in_place = jax.jit(_moved, static_argnums=1, donate_argnums=0)
