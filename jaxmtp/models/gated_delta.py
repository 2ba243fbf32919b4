"""Gated DeltaNet, the linear attention of Qwen3-Next / Qwen3.5, in plain jnp over the
engine's flattened ragged batch: the reference a kernel is checked against, and the
math as transformers' modeling_qwen3_next.py computes it.

The batch: T rows, the tokens of B requests back to back (padded); request b owns rows
query_start[b]:query_start[b+1] (a padding request owns none; rows at and past
query_start[B] are padding). Each request keeps two states in tables indexed by its
slot: the conv state [N, K-1, C] (its last K-1 conv inputs, oldest first) and the
recurrent state [N, Hv, dk, dv]. A fresh request (its first chunk) starts from zeros;
any other continues from its table rows. Nothing here writes a table for a request
without rows, so a padding request's slot may be any valid row.

Per row of a request and per value head h, with S the [dk, dv] state:
    S <- exp(g) S;  delta = beta (v - k^T S);  S <- S + k delta^T;  o = q^T S
with q and k l2-normalised, q scaled by 1/sqrt(dk), and value head h reading key head
h // (Hv // Hk). Everything is computed in float32 (inputs may be bfloat16), matrix
products at full float32 precision (no TF32)."""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxmtp.kernels.reference import row_ownership

F32 = jnp.float32
L2NORM_EPS = 1e-6  # transformers' l2norm (as the FLA library's)
# rows per chunk of the chunked form: each request's rows are cut from its own first row
# (_chunk_layout), so a request's chunks do not depend on the batch around it
CHUNK = 64


def _einsum(spec: str, *operands: jax.Array) -> jax.Array:
    return jnp.einsum(spec, *operands, precision=jax.lax.Precision.HIGHEST)


def stored_states(table: jax.Array, slots: jax.Array, fresh: jax.Array) -> jax.Array:
    """Each request's starting state [B, ...] in float32: its table row, or zeros when
    fresh (whatever the table holds there, NaN included)."""
    start = table[slots].astype(F32)
    return jnp.where(fresh.reshape((-1,) + (1,) * (start.ndim - 1)), 0.0, start)


# --- the short causal conv over q|k|v ------------------------------------------------


def _conv_inputs(x, conv_state, query_start, slots, fresh, owner, last, width):
    """For each (owner, last) pair: the `width` conv inputs [n, width, C] (oldest first)
    of request `owner` ending at its row `last` (counted from its first row in this batch;
    -1: before it). Inputs before the request's first row come from its stored window
    (zeros when fresh): position p < 0 is the window's entry K-1+p."""
    history = conv_state.shape[1]
    pos = last[:, None] - (width - 1) + jnp.arange(width)  # [n, width]
    rows = jnp.clip(query_start[owner][:, None] + pos, 0, x.shape[0] - 1)
    stored = stored_states(conv_state, slots, fresh)[owner[:, None], jnp.clip(history + pos, 0, history - 1)]
    return jnp.where((pos >= 0)[..., None], x[rows].astype(F32), stored)


def causal_conv1d(x: jax.Array, weight: jax.Array, conv_state: jax.Array, query_start: jax.Array,
                  slots: jax.Array, fresh: jax.Array) -> jax.Array:
    """The depthwise causal conv then SiLU, as Qwen3NextGatedDeltaNet applies it to the
    concatenated q|k|v channels: y[t, c] = silu(sum_j weight[c, j] x[t - (K-1) + j, c]),
    where inputs before a request's first row in this batch come from its conv state.

    x [T, C] the rows' conv inputs; weight [C, K] (conv1d.weight squeezed: tap K-1 meets
    the current row); conv_state [N, K-1, C] each slot's last K-1 inputs, oldest first;
    query_start [B+1], slots [B], fresh [B] as the module docstring says.
    Returns y [T, C] float32, zeros on padding rows. The table is not written: conv_tail
    gives the windows the caller may commit (jaxmtp.worker.recurrent)."""
    num_rows = x.shape[0]
    rows = jnp.arange(num_rows)
    owner = row_ownership(query_start, num_rows)[0]
    window = _conv_inputs(x, conv_state, query_start, slots, fresh, owner, rows - query_start[owner], weight.shape[1])
    y = jax.nn.silu(_einsum("tjc,cj->tc", window, weight.astype(F32)))
    return jnp.where((rows < query_start[-1])[:, None], y, 0.0)


def conv_tail(x: jax.Array, conv_state: jax.Array, query_start: jax.Array, slots: jax.Array, fresh: jax.Array,
              keep: int) -> jax.Array:
    """Each request's conv windows [B, keep, K-1, C] after its last `keep` rows, as
    gated_delta_recurrent's tail holds its recurrent states: window i holds the K-1
    inputs ending at its row count - keep + i (count: the request's rows; where that
    precedes its first row, earlier inputs come from its stored window, zeros when
    fresh). jaxmtp.worker.recurrent writes them and commits the one the caller keeps."""
    num_requests = slots.shape[0]
    count = query_start[1:] - query_start[:-1]
    last = jnp.maximum(count[:, None] - keep + jnp.arange(keep), -1).reshape(-1)
    owner = jnp.repeat(jnp.arange(num_requests), keep)
    window = _conv_inputs(x, conv_state, query_start, slots, fresh, owner, last, conv_state.shape[1])
    return window.reshape((num_requests, keep) + window.shape[1:])


# --- the gated delta rule -------------------------------------------------------------


def gates(a: jax.Array, b: jax.Array, A_log: jax.Array, dt_bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row and value head, from in_proj_ba's a and b [T, Hv]: the log-decay
    g = -exp(A_log) softplus(a + dt_bias) (float32) and the write strength
    beta = sigmoid(b), computed in b's dtype as transformers does, then float32."""
    g = -jnp.exp(A_log.astype(F32)) * jax.nn.softplus(a.astype(F32) + dt_bias.astype(F32))
    return g, jax.nn.sigmoid(b).astype(F32)


def _l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def prepare_inputs(q, k, v, g, beta):
    """float32 inputs per value head: q and k l2-normalised (use_qk_l2norm_in_kernel),
    q scaled by 1/sqrt(dk), key heads repeated to the value heads (repeat_interleave:
    value head h reads key head h // (Hv // Hk))."""
    repeats = v.shape[1] // q.shape[1]
    q = _l2norm(q.astype(F32)) * q.shape[-1] ** -0.5
    k = _l2norm(k.astype(F32))
    q, k = jnp.repeat(q, repeats, axis=1), jnp.repeat(k, repeats, axis=1)
    return q, k, v.astype(F32), g.astype(F32), beta.astype(F32)


def _delta_step(state, q, k, v, g, beta):
    """One row for every value head: state [Hv, dk, dv]; q, k [Hv, dk]; v [Hv, dv];
    g, beta [Hv]. Returns the state after the row and the row's output [Hv, dv]."""
    state = state * jnp.exp(g)[:, None, None]
    delta = (v - _einsum("hk,hkv->hv", k, state)) * beta[:, None]
    state = state + k[:, :, None] * delta[:, None, :]
    return state, _einsum("hk,hkv->hv", q, state)


def scan_rows(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array,
              query_start: jax.Array, slots: jax.Array, fresh: jax.Array, keep: int) -> tuple[jax.Array, jax.Array]:
    """gated_delta_recurrent over prepared inputs (prepare_inputs': q, k [T, Hv, dk]), as
    one scan over the batch's rows (kernels/gated_delta.py runs the requests side by side)."""
    num_rows, num_requests = v.shape[0], slots.shape[0]
    start = stored_states(state, slots, fresh)
    rows = jnp.arange(num_rows)
    owner = row_ownership(query_start, num_rows)[0]
    valid = rows < query_start[-1]
    first = valid & (rows == query_start[owner])
    tail_index = keep - (query_start[owner + 1] - rows)  # < 0: a row before the last `keep`

    def row(carry, xs):
        current, tail = carry
        q_t, k_t, v_t, g_t, beta_t, b, is_valid, is_first, i = xs
        before = jnp.where(is_first, start[b], current)
        # padding rows come after every request's: the state they leave is never read
        after, o = _delta_step(before, q_t, k_t, v_t, g_t, beta_t)
        at = jnp.maximum(i, 0)
        tail = tail.at[b, at].set(jnp.where(is_valid & (i >= 0), after, tail[b, at]))
        return (after, tail), jnp.where(is_valid, o, 0.0)

    tail = jnp.broadcast_to(start[:, None], (num_requests, keep) + start.shape[1:])
    (_, tail), o = jax.lax.scan(row, (jnp.zeros_like(start[0]), tail),
                                (q, k, v, g, beta, owner, valid, first, tail_index))
    return o, tail


OverRows = Callable[..., tuple[jax.Array, jax.Array]]


def gated_delta_recurrent(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array,
                          query_start: jax.Array, slots: jax.Array, fresh: jax.Array, keep: int,
                          over_rows: OverRows = scan_rows) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule one row at a time: for decode and MTP verification, whose few
    rows per request may each be the last one committed. over_rows (scan_rows or a kernel
    of its contract) runs the rows.

    q, k [T, Hk, dk] and v [T, Hv, dv] the conv's outputs split into heads (q and k not
    yet normalised); g, beta [T, Hv] from gates(); state [N, Hv, dk, dv] the recurrent
    table; query_start, slots, fresh as the module docstring says; keep (static) how many
    of each request's last states to return.
    Returns o [T, Hv, dv] float32 (zeros on padding rows) and tail [B, keep, Hv, dk, dv]:
    tail[b, i] is request b's state after its row query_start[b+1] - keep + i, or where
    that row precedes its first, its starting state (stored, or zeros when fresh).
    jaxmtp.worker.recurrent writes them and commits the one the caller keeps."""
    return over_rows(*prepare_inputs(q, k, v, g, beta), state, query_start, slots, fresh, keep)


def chunk_count(num_rows: int, num_requests: int, chunk: int) -> int:
    """The most chunks of `chunk` rows that num_requests requests of num_rows rows in all
    can need, each request cut from its own first row (static: the chunked form's size)."""
    return (num_rows + min(num_requests, num_rows) * (chunk - 1)) // chunk


def _chunk_layout(query_start: jax.Array, num_rows: int, chunk: int):
    """Each request's rows cut into chunks of `chunk` from its own first row (its last
    chunk padded), all requests' chunks back to back. Returns: num_chunks (static, the
    most B requests of T rows can need), dest [T] each row's place in the flat
    [num_chunks * chunk] layout (padding rows: past it) and chunk_start [B + 1]: request
    b owns chunks chunk_start[b]:chunk_start[b+1] (the chunks past chunk_start[B] hold
    no rows)."""
    num_chunks = chunk_count(num_rows, query_start.shape[0] - 1, chunk)
    per_request = (query_start[1:] - query_start[:-1] + chunk - 1) // chunk
    chunk_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(per_request).astype(jnp.int32)])
    rows = jnp.arange(num_rows)
    owner = row_ownership(query_start, num_rows)[0]
    dest = jnp.where(rows < query_start[-1], chunk_start[owner] * chunk + rows - query_start[owner], num_chunks * chunk)
    return num_chunks, dest, chunk_start


def _to_chunks(x: jax.Array, dest: jax.Array, num_chunks: int, chunk: int) -> jax.Array:
    """Rows [T, H, ...] into chunks [num_chunks, H, chunk, ...], zeros where no row
    lands: a zero row (k = v = 0, beta = 0, g = 0) leaves the state as it is."""
    flat = jnp.zeros((num_chunks * chunk,) + x.shape[1:], x.dtype).at[dest].set(x, mode="drop")
    return jnp.moveaxis(flat.reshape((num_chunks, chunk) + x.shape[1:]), 1, 2)


def _diagonal_blocks(x: jax.Array, size: int) -> jax.Array:
    """The [size, size] blocks on the diagonal of x [..., C, C]: [..., C // size, size, size]."""
    count = x.shape[-1] // size
    blocks = x.reshape(x.shape[:-2] + (count, size, count, size))
    return jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)


def _unit_lower_inverse(lower: jax.Array) -> jax.Array:
    """(I + lower)^-1 for strictly lower-triangular lower [..., C, C] (C a power of 2), by
    recursive doubling of the diagonal blocks: the inverses of the s x s diagonal blocks
    give those of the 2s x 2s ones, [[A, 0], [L, B]]^-1 = [[A^-1, 0], [-B^-1 L A^-1,
    B^-1]], all blocks of a level in two batched products: log2(C) levels, where a
    substitution a row at a time takes C - 1 steps of a whole-matrix update each (on a
    GPU, launches that cost more than the arithmetic). Exact block algebra, no series
    (a Neumann series of lower would cancel terms far larger than the result). Not
    lax.linalg.triangular_solve: on CPU, jaxlib's batched LAPACK call splits its batch
    over the thread pool and waits for it, and two such calls running at once (XLA runs
    independent ones concurrently) were seen to deadlock on 2 cores."""
    size = lower.shape[-1]
    inverse = jnp.ones(lower.shape[:-1] + (1, 1), lower.dtype)  # the 1 x 1 diagonal blocks, [..., C, 1, 1]
    half = 1
    while half < size:
        a_inv, b_inv = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        lower_left = _diagonal_blocks(lower, 2 * half)[..., half:, :half]
        left = -_einsum("...ij,...jk,...kl->...il", b_inv, lower_left, a_inv)
        top = jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], axis=-1)
        inverse = jnp.concatenate([top, jnp.concatenate([left, b_inv], axis=-1)], axis=-2)
        half *= 2
    return inverse[..., 0, :, :]


class ChunkTerms(NamedTuple):
    """What the scan over chunks reads, per chunk and value head ([n, Hv, C, ...] float32,
    decay [n, Hv])."""

    u: jax.Array  # [n, Hv, C, dv] the new values, before the old state's read is added
    w: jax.Array  # [n, Hv, C, dk] the keys that read the old state
    q_decayed: jax.Array  # [n, Hv, C, dk]
    attn: jax.Array  # [n, Hv, C, C] the intra-chunk attention, decays applied
    k_to_end: jax.Array  # [n, Hv, C, dk] the keys decayed to the chunk's end
    decay: jax.Array  # [n, Hv] the chunk's total decay


def _intra_chunk(q, k, v, g, beta) -> ChunkTerms:
    """The first phase of torch_chunk_gated_delta_rule, for every chunk at once (inputs
    [n, Hv, C, ...]). Within a chunk, with cum the cumulative log-decay and
    D[i, j] = exp(cum_i - cum_j) for j <= i, the UT transform (I + strictly_lower(beta_i
    k_i.k_j D[i, j]))^-1 turns the C delta updates into u and w."""
    size = g.shape[-1]
    cum = jnp.cumsum(g, axis=-1)
    causal = jnp.tril(jnp.ones((size, size), bool))
    decay = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    k_beta = k * beta[..., None]
    strictly_lower = jnp.tril(jnp.ones((size, size), bool), -1)
    ut = _unit_lower_inverse(jnp.where(strictly_lower, _einsum("nhid,nhjd->nhij", k_beta, k) * decay, 0.0))
    return ChunkTerms(
        u=_einsum("nhij,nhjv->nhiv", ut, v * beta[..., None]),
        w=_einsum("nhij,nhjk->nhik", ut, k_beta * jnp.exp(cum)[..., None]),
        q_decayed=q * jnp.exp(cum)[..., None],
        attn=_einsum("nhid,nhjd->nhij", q, k) * decay,
        k_to_end=k * jnp.exp(cum[..., -1:] - cum)[..., None],
        decay=jnp.exp(cum[..., -1]),
    )


def scan_chunks(terms: ChunkTerms, chunk_start: jax.Array, state: jax.Array, slots: jax.Array, fresh: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
    """The second phase: each request's chunks in order, carrying its state from its
    starting one (its table row, zeros when fresh): per chunk, v_new = u - w S, the
    outputs q_decayed S + attn v_new, then S <- decay S + k_to_end^T v_new. A scan over all
    chunks, restarting at each request's first (kernels/gated_delta.py runs the requests
    side by side).

    terms [n, ...] from _intra_chunk; chunk_start [B + 1] as _chunk_layout's; state,
    slots, fresh as gated_delta_recurrent's. Returns the chunks' outputs [n, Hv, C, dv]
    (any values in chunks no request owns) and final [B, Hv, dk, dv]: each request's
    state after its last chunk (its starting state if it has none)."""
    num_chunks = terms.decay.shape[0]
    start = stored_states(state, slots, fresh)
    chunks = jnp.arange(num_chunks)
    chunk_owner = row_ownership(chunk_start, num_chunks)[0]
    real = chunks < chunk_start[-1]
    first = chunks == chunk_start[chunk_owner]

    def one_chunk(carry, xs):
        current, final = carry
        t, b, is_real, is_first = xs
        current = jnp.where(is_first, start[b], current)
        v_new = t.u - _einsum("hck,hkv->hcv", t.w, current)
        o = _einsum("hck,hkv->hcv", t.q_decayed, current) + _einsum("hij,hjv->hiv", t.attn, v_new)
        current = current * t.decay[:, None, None] + _einsum("hck,hcv->hkv", t.k_to_end, v_new)
        final = final.at[b].set(jnp.where(is_real, current, final[b]))
        return (current, final), o

    (_, final), o = jax.lax.scan(one_chunk, (jnp.zeros_like(start[0]), start), (terms, chunk_owner, real, first))
    return o, final


AcrossChunks = Callable[[ChunkTerms, jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def gated_delta_chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array,
                        query_start: jax.Array, slots: jax.Array, fresh: jax.Array, chunk: int = CHUNK,
                        across_chunks: AcrossChunks = scan_chunks) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule in chunks (the WY / UT-transform form of
    torch_chunk_gated_delta_rule), for prefill: the same result as gated_delta_recurrent
    within float32 rounding, with matrix products in place of one step per row. Each
    request's rows are cut into chunks from its own first row (_chunk_layout); the
    chunks' terms are computed all at once, then across_chunks (scan_chunks or a kernel
    of its contract) carries each request's state through its chunks.

    Arguments as gated_delta_recurrent's; chunk (static) the chunk length.
    Returns o [T, Hv, dv] float32 (zeros on padding rows) and final [B, Hv, dk, dv]: each
    request's state after its last row (its starting state if it has none)."""
    q, k, v, g, beta = prepare_inputs(q, k, v, g, beta)
    num_rows = v.shape[0]
    num_chunks, dest, chunk_start = _chunk_layout(query_start, num_rows, chunk)
    q, k, v, g, beta = (_to_chunks(x, dest, num_chunks, chunk) for x in (q, k, v, g, beta))
    o, final = across_chunks(_intra_chunk(q, k, v, g, beta), chunk_start, state, slots, fresh)
    o = jnp.moveaxis(o, 2, 1)  # [chunks, C, Hv, dv]
    o = o.reshape((num_chunks * chunk,) + o.shape[2:])
    rows_valid = jnp.arange(num_rows) < query_start[-1]
    return jnp.where(rows_valid[:, None, None], o[jnp.minimum(dest, num_chunks * chunk - 1)], 0.0), final
