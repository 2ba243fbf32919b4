"""The one function every projection of the model goes through: x @ w, plus a bias
where the layer has one."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def linear(x: jax.Array, w: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """x [T, K] times w [K, ...] (an [in, out] matrix, or gate and up stacked [K, 2, I]).
    A bias is added as nn.Linear adds it (addmm): to the float32 accumulator, before
    the one rounding to x's dtype; rounding the product first and then the sum again
    moves float16 logits measurably further from float32's (tests/test_parity.py)."""
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    if bias is None:
        return jax.lax.dot_general(x, w, dims)
    return (jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32) + bias).astype(x.dtype)
