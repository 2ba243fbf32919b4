"""Plain-jnp multi-head latent attention over a paged latent cache: the references, and
the engine's path off GPUs (on GPUs both kinds of rows run kernels/mla_attention.py).

Layout (jaxmtp/worker/cache.py, MLA):
  latent_pages  [num_pages, page_size, 1, R]   the compressed latent c (after its norm)
  rope_pages    [num_pages, page_size, 1, Dr]  the shared rope key (after RoPE)
  kv_lens, page_table, query_start: as kernels/reference.py (ragged q rows, each
  sequence's rows its last tokens, attending causally; unowned rows come out 0)
  w_uk [R, Hq, Dn], w_uv [R, Hq, Dv]: kv_b_proj split per head, K's nope part and V

Head h's key at token s is (c_s @ w_uk[:, h], k_rope_s) and its value c_s @ w_uv[:, h].
The expanded form builds those keys and values; the absorbed form folds w_uk into the
query (q_latent = q_nope @ w_uk^T, R values per head) and attends over the latent
itself, leaving w_uv to the caller: it reads R + Dr values a token instead of
Hq * (Dn + Dv), which is what makes decoding over a long context cheap.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmtp.kernels.reference import row_ownership

HIGHEST = jax.lax.Precision.HIGHEST


def _context(latent_pages, rope_pages, kv_lens, page_table, query_start, num_rows):
    """Each row's sequence's whole context ([T, C, R], [T, C, Dr], float32), which
    tokens it may attend to [T, C], and which rows are owned [T]."""
    page_size = latent_pages.shape[1]
    context = page_table.shape[1] * page_size
    seq, owned = row_ownership(query_start, num_rows)
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    position = kv_lens[seq] - (query_start[seq + 1] - rows)
    row_pages = page_table[seq]
    latent = latent_pages[row_pages].reshape(num_rows, context, -1).astype(jnp.float32)
    rope = rope_pages[row_pages].reshape(num_rows, context, -1).astype(jnp.float32)
    token = jnp.arange(context, dtype=jnp.int32)
    allowed = owned[:, None] & (token[None, :] <= position[:, None])
    return latent, rope, allowed, owned


def _softmax(scores, allowed):
    """Masked softmax over the last axis of [T, H, C]; fully masked rows give 0.
    where(), not arithmetic: values in slots not attended never leak in."""
    scores = jnp.where(allowed[:, None, :], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.exp(scores - row_max)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    return probs / jnp.where(denom > 0, denom, 1.0)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def mla_absorbed_attention_reference(
    q_latent, q_rope, latent_pages, rope_pages, kv_lens, page_table, query_start, *, sm_scale
):
    """q_latent [T, Hq, R] (W_UK folded in), q_rope [T, Hq, Dr] -> [T, Hq, R]: the
    attention-weighted latent, to be multiplied by W_UV. Float32 math."""
    latent, rope, allowed, owned = _context(latent_pages, rope_pages, kv_lens, page_table, query_start, q_latent.shape[0])
    scores = jnp.einsum("thr,tcr->thc", q_latent.astype(jnp.float32), latent, precision=HIGHEST)
    scores += jnp.einsum("thd,tcd->thc", q_rope.astype(jnp.float32), rope, precision=HIGHEST)
    probs = _softmax(scores * sm_scale, allowed)
    latent = jnp.where(allowed[:, :, None], latent, 0.0)
    out = jnp.einsum("thc,tcr->thr", probs, latent, precision=HIGHEST)
    return jnp.where(owned[:, None, None], out, 0.0).astype(q_latent.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def mla_expanded_attention_reference(
    q_nope, q_rope, latent_pages, rope_pages, kv_lens, page_table, query_start, w_uk, w_uv, *, sm_scale
):
    """q_nope [T, Hq, Dn], q_rope [T, Hq, Dr] -> [T, Hq, Dv], from keys and values
    expanded out of the latent for every context token. Float32 math."""
    latent, rope, allowed, owned = _context(latent_pages, rope_pages, kv_lens, page_table, query_start, q_nope.shape[0])
    latent = jnp.where(allowed[:, :, None], latent, 0.0)
    k_nope = jnp.einsum("tcr,rhd->tchd", latent, w_uk.astype(jnp.float32), precision=HIGHEST)
    v = jnp.einsum("tcr,rhd->tchd", latent, w_uv.astype(jnp.float32), precision=HIGHEST)
    scores = jnp.einsum("thd,tchd->thc", q_nope.astype(jnp.float32), k_nope, precision=HIGHEST)
    scores += jnp.einsum("thd,tcd->thc", q_rope.astype(jnp.float32), rope, precision=HIGHEST)
    probs = _softmax(scores * sm_scale, allowed)
    out = jnp.einsum("thc,tchd->thd", probs, v, precision=HIGHEST)
    return jnp.where(owned[:, None, None], out, 0.0).astype(q_nope.dtype)
