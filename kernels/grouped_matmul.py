"""Grouped matmul: the expert FFNs of a mixture of experts as one call.

Layout (fixed by jaxmtp/moe.py):
  lhs          [M, K]     rows sorted by group (expert): group g owns rows
                          sum(group_sizes[:g]) .. sum(group_sizes[:g+1]) - 1
  rhs          [G, K, N]  one matrix per group
  group_sizes  int32 [G]  rows per group; they sum to at most M, and rows past the
                          sum (padding) come out 0

A GPU kernel (the Mosaic GPU ragged dot, DESIGN.md's measurements) takes the same
arguments; `grouped_matmul` is the one function the model calls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_matmul_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """lhs rows of group g times rhs[g], in float32 accumulation (XLA's ragged_dot)."""
    out = jax.lax.ragged_dot(
        lhs, rhs, group_sizes.astype(jnp.int32), precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return out.astype(lhs.dtype)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The model's entry point: the reference on every backend until a GPU kernel
    lands here (same signature)."""
    return grouped_matmul_reference(lhs, rhs, group_sizes)
