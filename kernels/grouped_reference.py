"""The grouped and paired matmuls' plain-jnp references (kernels/grouped_matmul.py has the
layout and the kernels): XLA's ragged_dot over sorted rows, a gathered matrix per row for
the paired form; fp8 experts dequantized, float32 products."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxmtp.kernels.fp8_matmul import dequantize_blocks

HIGHEST = lax.Precision.HIGHEST


def _sorted_lhs(lhs, rows):
    return lhs if rows is None else lhs[rows]


def _ragged_dot(lhs, rhs, group_sizes):
    return lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32), precision=HIGHEST,
                          preferred_element_type=jnp.float32)


def _dequantized(lhs, rhs, scale_inv, scale_block, k_major):
    """(lhs, rhs) to multiply, rhs [G, K, (2,) N] (k_major: held [G, (2,) N, K]): as they
    are, or for an fp8 rhs both in float32 with rhs times its block scales."""
    rhs = jnp.moveaxis(rhs, -1, 1) if k_major else rhs
    if scale_inv is None:
        return lhs, rhs
    bk, bn = scale_block
    block = (1, bk, 1, bn) if rhs.ndim == 4 else (1, bk, bn)
    return lhs.astype(jnp.float32), dequantize_blocks(rhs, scale_inv, block)


def grouped_matmul_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                             rows: jax.Array | None = None, *, scale_inv: jax.Array | None = None,
                             scale_block: tuple[int, int] | None = None, k_major: bool = False) -> jax.Array:
    """lhs rows of group g times rhs[g], in float32 accumulation (XLA's ragged_dot)."""
    a, w = _dequantized(_sorted_lhs(lhs, rows), rhs, scale_inv, scale_block, k_major)
    return _ragged_dot(a, w, group_sizes).astype(lhs.dtype)


def silu_and_mul(both: jax.Array, n: int) -> jax.Array:
    """silu(gate) * up of float32 products [M, 2N], gate then up."""
    return jax.nn.silu(both[:, :n]) * both[:, n:]


def grouped_swiglu_reference(lhs: jax.Array, gate_up: jax.Array, group_sizes: jax.Array,
                             rows: jax.Array | None = None, *, scale_inv: jax.Array | None = None,
                             scale_block: tuple[int, int] | None = None, k_major: bool = False) -> jax.Array:
    """silu(lhs @ gate[g]) * (lhs @ up[g]) per group, from float32 accumulators."""
    a, w = _dequantized(_sorted_lhs(lhs, rows), gate_up, scale_inv, scale_block, k_major)
    num_groups, k, _, n = w.shape
    both = _ragged_dot(a, w.reshape(num_groups, k, 2 * n), group_sizes)
    return silu_and_mul(both, n).astype(lhs.dtype)


def _paired_product(lhs, rhs, pair_groups, rows, scale_inv, scale_block, k_major):
    """Each row times its group's matrix, float32: [M, N] ([M, 2, N] for gate_up); rows
    of group G (held elsewhere) 0. Gathers a matrix a row: for tests' sizes."""
    num_groups = rhs.shape[0]
    a, w = _dequantized(_sorted_lhs(lhs, rows), rhs, scale_inv, scale_block, k_major)
    held = pair_groups < num_groups
    w = w[jnp.minimum(pair_groups, num_groups - 1)].astype(jnp.float32)
    out = jnp.einsum("mk,mk...->m...", a.astype(jnp.float32), w, precision=HIGHEST)
    return jnp.where(held.reshape((-1,) + (1,) * (out.ndim - 1)), out, 0.0)


def paired_matmul_reference(lhs: jax.Array, rhs: jax.Array, pair_groups: jax.Array, rows: jax.Array | None = None,
                            *, scale_inv: jax.Array | None = None,
                            scale_block: tuple[int, int] | None = None, k_major: bool = False) -> jax.Array:
    """Row i times rhs[pair_groups[i]] (0 where pair_groups[i] = G), float32 accumulation."""
    return _paired_product(lhs, rhs, pair_groups, rows, scale_inv, scale_block, k_major).astype(lhs.dtype)


def paired_swiglu_reference(lhs: jax.Array, gate_up: jax.Array, pair_groups: jax.Array,
                            rows: jax.Array | None = None, *, scale_inv: jax.Array | None = None,
                            scale_block: tuple[int, int] | None = None, k_major: bool = False) -> jax.Array:
    """silu(row @ gate[g]) * (row @ up[g]) for each row's group g (0 where g = G)."""
    n = gate_up.shape[-2 if k_major else -1]
    both = _paired_product(lhs, gate_up, pair_groups, rows, scale_inv, scale_block, k_major).reshape(-1, 2 * n)
    return silu_and_mul(both, n).astype(lhs.dtype)
