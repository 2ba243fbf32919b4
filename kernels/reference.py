"""Plain-jnp ragged paged attention: the reference and the engine's CPU path.

Layout (fixed by the engine's paged KV cache):
  q        [T, Hq, D]                  flattened ragged query rows, T padded
  k_pages  [num_pages, page_size, Hkv, D]  one layer's paged cache (v_pages too)
  kv_lens  int32 [B]                   tokens in the cache per sequence, new rows included
  page_table int32 [B, P]              token t of sequence s lives in page
                                       page_table[s, t // page_size], slot t % page_size
  query_start int32 [B + 1]            sequence s owns q rows query_start[s]:query_start[s+1]

The q rows of a sequence are its last tokens: row query_start[s] + j sits at position
kv_lens[s] - nq + j (nq = rows of s) and attends causally to positions 0..itself.
Rows owned by no sequence come out exactly 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def row_ownership(query_start: jax.Array, num_rows: int):
    """Per q row: (owning sequence, whether any sequence owns it).

    A row's sequence is the number of sequences that end at or before it; rows
    outside [query_start[0], query_start[B]) are padding (their sequence is clamped
    to a valid index so that gathers stay in bounds).
    """
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    num_seqs = query_start.shape[0] - 1
    seq = jnp.sum(query_start[1:][None, :] <= rows[:, None], axis=1, dtype=jnp.int32)
    owned = (rows >= query_start[0]) & (rows < query_start[num_seqs])
    return jnp.minimum(seq, num_seqs - 1), owned


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def ragged_paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    query_start: jax.Array,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Causal GQA attention of ragged q rows over a paged KV cache; float32 math."""
    num_rows, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    pages_per_seq = page_table.shape[1]
    group = num_q_heads // num_kv_heads
    context = pages_per_seq * page_size
    if sm_scale is None:
        sm_scale = head_dim**-0.5

    seq, owned = row_ownership(query_start, num_rows)
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    # Row j of nq rows sits at kv_len - nq + j, i.e. kv_len - (end of its rows - row).
    position = kv_lens[seq] - (query_start[seq + 1] - rows)

    # Every row sees its own sequence's whole page table; masking does the rest.
    row_pages = page_table[seq]  # [T, P]
    k = k_pages[row_pages].reshape(num_rows, context, num_kv_heads, head_dim)
    v = v_pages[row_pages].reshape(num_rows, context, num_kv_heads, head_dim)

    token = jnp.arange(context, dtype=jnp.int32)
    allowed = owned[:, None] & (token[None, :] <= position[:, None])
    if sliding_window is not None:
        allowed &= token[None, :] > position[:, None] - sliding_window

    qg = q.astype(jnp.float32).reshape(num_rows, num_kv_heads, group, head_dim)
    logits = jnp.einsum(
        "tkgd,tskd->tkgs", qg, k.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    ) * sm_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    # where(), not arithmetic, so that NaN or huge values in slots that are not
    # attended (other sequences' pages, stale slots past kv_len) never leak in.
    logits = jnp.where(allowed[:, None, None, :], logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.exp(logits - row_max)
    denom = jnp.sum(probs, axis=-1)
    v = jnp.where(allowed[:, :, None, None], v.astype(jnp.float32), 0.0)
    out = jnp.einsum("tkgs,tskd->tkgd", probs, v, precision=jax.lax.Precision.HIGHEST)
    out = out / jnp.where(denom > 0, denom, 1.0)[..., None]
    out = jnp.where(owned[:, None, None, None], out, 0.0)
    return out.reshape(num_rows, num_q_heads, head_dim).astype(q.dtype)
