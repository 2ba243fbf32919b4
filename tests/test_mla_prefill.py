"""The split-form MLA prefill (kernels/mla_prefill.py: the cached prefix absorbed, the
step's own rows expanded, merged) in interpret mode against float64 NumPy and the jnp
reference, its place behind mla_attention_fn's measured table, and its Triton lowering.

Random inputs are fresh per test (the seed is in every failure message); cache slots
nobody may attend hold NaN or 1e30 (test_kernels.make_case), and so do the latent rows
of padding rows: a row read that should not be shows up as NaN or a wild value."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmtp.kernels.mla_prefill as mp
from jaxmtp.kernels.mla_prefill import OwnRowsConfig, mla_split_prefill
from jaxmtp.models.layers import rotate
from jaxmtp.models.mla import mla_attention_fn
from test_kernels import make_case
from test_moe_kernels import mla_float64, seeded
from test_moe_mla_pallas import DR, HEADS, R, entry_point_args, taken_rows
from tolerances import assert_within, gamma

DN = DV = 16  # the own-rows kernel tiles powers of 2 of at least 16


def split_case(rng, seqs, page_size=4, shared_pages=0):
    """mla_split_prefill's arguments: latent and rope pages (make_case), the step's own
    latent and rope rows as the cache holds them at each row's position (NaN for rows
    no sequence owns), fresh queries (the rope part taken as rotated) and weights."""
    _, kv, _, kv_lens, page_table, query_start = make_case(
        rng, seqs, num_q_heads=1, num_kv_heads=1, head_dim=R + DR, page_size=page_size, dtype=jnp.float32)
    if shared_pages:  # the second sequence's first pages are the first's (a prefix-cache hit)
        page_table = page_table.at[1, :shared_pages].set(page_table[0, :shared_pages])
    num_rows = int(query_start[-1]) + 3
    flat, table = np.asarray(kv).reshape(-1, R + DR), np.asarray(page_table)
    own = np.full((num_rows, R + DR), np.nan, np.float32)
    for s, (rows, kv_len) in enumerate(seqs):
        for j in range(rows):
            pos = kv_len - rows + j
            own[int(query_start[s]) + j] = flat[table[s, pos // page_size] * page_size + pos % page_size]
    q_nope = jnp.asarray(rng.standard_normal((num_rows, HEADS, DN)), jnp.float32)
    q_rope = jnp.asarray(rng.standard_normal((num_rows, HEADS, DR)), jnp.float32)
    w_uk = jnp.asarray(0.4 * rng.standard_normal((R, HEADS, DN)), jnp.float32)
    w_uv = jnp.asarray(rng.standard_normal((R, HEADS, DV)), jnp.float32)
    return (q_nope, q_rope, jnp.asarray(own[:, :R]), jnp.asarray(own[:, R:]), kv[..., :R], kv[..., R:], kv_lens,
            page_table, query_start, w_uk, w_uv)


@pytest.mark.parametrize("case", [
    # a whole prompt (no prefix: the own rows alone), chunks after a prefix that start
    # mid-page (positions 18, 30), a chunk of several q blocks and kv steps, beside decode
    # and verify sequences and a padding one, which come out 0
    dict(seqs=[(9, 9), (1, 7), (5, 23), (0, 0), (40, 100), (2, 5), (3, 33)], decode_rows=2,
         config=OwnRowsConfig(16, 16, 4, 2)),
    # the default tiling (one q block and kv step a sequence); the second sequence's first
    # three pages the first's (a prefix-cache hit), its chunk starting mid-page
    dict(seqs=[(6, 14), (7, 19), (1, 4), (13, 13)], decode_rows=1, config=None, shared_pages=3),
    # the prefix expanded: 16 tokens a pass over the prefixes' 108 (7 passes, each
    # prefix but the first spanning two or more, a pass holding the ends of one and the
    # start of the next), and one pass holding them all
    dict(seqs=[(9, 9), (1, 7), (5, 23), (0, 0), (40, 100), (2, 5), (3, 33)], decode_rows=2,
         config=OwnRowsConfig(16, 16, 4, 2, prefix_window=16)),
    dict(seqs=[(6, 14), (7, 19), (1, 4), (13, 13)], decode_rows=1, config=OwnRowsConfig(prefix_window=128),
         shared_pages=3),
], ids=["blocks-and-steps", "default-tiling-shared-pages", "prefix-expanded-passes", "prefix-expanded-one-pass"])
def test_split_prefill_matches_float64(case):
    """Every prefill row within two float32 evaluations of float64 (the prefix's result,
    absorbed or expanded, and the own rows' are each one evaluation over part of the
    context, mla_float64's bound over the whole; their merges add a few roundings, well
    inside it); the other rows exactly 0, no NaN."""
    rng, seed = seeded()
    args = split_case(rng, case["seqs"], shared_pages=case.get("shared_pages", 0))
    q_nope, q_rope, _, _, latent_pages, rope_pages, kv_lens, page_table, query_start, w_uk, w_uv = args
    got = np.asarray(mla_split_prefill(*args, sm_scale=0.3, decode_rows=case["decode_rows"], interpret=True,
                                       config=case["config"]))
    assert not np.isnan(got).any(), f"seed={seed}: NaN (a row not written, or a poisoned slot or row read)"
    taken = taken_rows(query_start, got.shape[0], case["decode_rows"], prefill=True)
    assert (got[~taken] == 0).all(), f"seed={seed}: rows the split form does not take must be 0"
    want, bound = mla_float64(q_nope, q_rope, latent_pages, rope_pages, kv_lens, page_table, query_start, w_uk, w_uv,
                              0.3)
    assert_within(got[taken], want[taken], 2 * bound[taken], f"seed={seed}")


def test_the_prefix_call_returns_each_rows_log_sum_exp():
    """mla_absorbed_attention(prefix_only=True): each prefill row's softmax over its
    sequence's tokens before the step's rows, and log2 of its denominator over base-2
    logits, against float64; -inf and 0 where the prefix is empty (a whole prompt) and
    for the decode row the call does not take."""
    from jaxmtp.kernels.mla_attention import mla_absorbed_attention

    rng, seed = seeded()
    seqs = [(9, 9), (5, 23), (1, 4), (4, 70)]
    q_nope, q_rope, _, _, latent_pages, rope_pages, kv_lens, page_table, query_start, w_uk, _ = split_case(rng, seqs)
    q_latent = jnp.einsum("thd,rhd->thr", q_nope, w_uk)
    out, lse = mla_absorbed_attention(q_latent, q_rope, latent_pages, rope_pages, kv_lens, page_table, query_start,
                                      sm_scale=0.3, decode_rows=1, prefill=True, interpret=True, prefix_only=True)
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    q = np.concatenate([np.asarray(q_latent, np.float64), np.asarray(q_rope, np.float64)], -1)
    keys = np.concatenate([latent_pages, rope_pages], -1).astype(np.float64).reshape(-1, R + DR)
    table, page_size = np.asarray(page_table), latent_pages.shape[1]
    for s, (rows, kv_len) in enumerate(seqs):
        slots = [table[s, t // page_size] * page_size + t % page_size for t in range(kv_len - rows)]
        for row in range(int(query_start[s]), int(query_start[s]) + rows):
            if not slots or rows == 1:  # a whole prompt, or a decode row the call leaves alone
                assert (lse[row] == -np.inf).all() and (out[row] == 0).all(), f"seed={seed} row {row}"
                continue
            logits = keys[slots] @ q[row].T * 0.3 / np.log(2)  # [tokens, heads], base 2
            top = logits.max(0)
            weights = np.exp2(logits - top)
            probs = weights / weights.sum(0)
            want = probs.T @ keys[slots][:, :R]
            # attention_float64's bound: the logits' dot products (R + Dr terms) err by
            # gamma_D of their magnitude L; the log2 of the sum of N exponentials adds gamma_{N+4}
            # of the largest |logit| (the shift, the exp2s, the sum, the log2)
            magnitude = (np.abs(keys[slots]) @ np.abs(q[row]).T * 0.3 / np.log(2)).max(0)
            n = len(slots)
            lse_bound = 2 * gamma(R + DR) * magnitude + gamma(n + 4) * np.maximum(np.abs(top), 1)
            assert_within(lse[row], top + np.log2(weights.sum(0)), lse_bound, f"seed={seed} row {row} lse")
            relative = 2 * gamma(R + DR) * magnitude * np.log(2) + gamma(3 * n + 4) + gamma(n)
            assert_within(out[row], want, relative[:, None] * (probs.T @ np.abs(keys[slots][:, :R])),
                          f"seed={seed} row {row}")


def test_the_entry_point_takes_the_split_form_where_its_table_names_the_shape(monkeypatch):
    """mla_attention_fn on pallas_interpret: with an entry in mla_prefill_paths.json for
    the shape, context and row buckets, the prefill rows run the split form (at the
    entry's tiling) and equal the reference backend (the jnp expanded form) within two
    float32 evaluations, at the nearest row bucket measured; without one, or where the
    nearest says "absorbed", the absorbed call."""
    import jaxmtp.models.mla as mla
    from jaxmtp.kernels.tiling_table import row_bucket

    rng, seed = seeded()
    args = entry_point_args(rng, [(1, 9), (2, 3), (0, 0), (5, 11), (1, 1), (6, 6)], dn=DN, dv=DV)
    q, cos, sin, _, _, _, _, _, kv_lens, page_table, query_start, w_uk, w_uv = args
    num_rows, context = q.shape[0], page_table.shape[1] * args[5].shape[1]
    tiling = OwnRowsConfig(16, 16, 4, 2)
    calls = []

    def split(*a, config, **kw):
        calls.append(config)
        return mla_split_prefill(*a, config=config, **kw)

    monkeypatch.setattr(mla, "mla_split_prefill", split)
    key = (HEADS, R, DR, DN, DV, row_bucket(context))
    options = dict(sm_scale=0.3, rope_interleave=True)
    want, _, _ = mla_attention_fn("reference", decode_rows=2)(*args, **options)
    other = OwnRowsConfig(32, 16, 4, 2)
    for entry, taken in (({row_bucket(num_rows): tiling}, [tiling]), ({}, []), ({row_bucket(num_rows): "absorbed"}, []),
                         # the nearest row bucket measured
                         ({2 * row_bucket(num_rows): tiling, 16 * row_bucket(num_rows): other}, [tiling]),
                         ({row_bucket(num_rows) // 2: "absorbed", 8 * row_bucket(num_rows): tiling}, [])):
        monkeypatch.setitem(mp.MEASURED_PATHS, key, entry)
        calls.clear()
        mla_attention_fn("pallas_interpret", decode_rows=2)(*args, **options)
        assert calls == taken, entry
    monkeypatch.setitem(mp.MEASURED_PATHS, key, {row_bucket(num_rows): tiling})
    got, got_latent, got_rope = mla_attention_fn("pallas_interpret", decode_rows=2)(*args, **options)
    q_rope = rotate(q[..., -DR:], cos, sin, True)
    _, bound = mla_float64(q[..., :-DR], q_rope, got_latent, got_rope, kv_lens, page_table, query_start, w_uk, w_uv,
                           0.3)
    assert_within(got, want, 2 * bound, f"seed={seed}")  # two float32 evaluations


def test_the_split_form_lowers_for_the_gpu_at_moonlight_shapes():
    """Both of its calls through the Triton lowering, from the CPU (what interpret mode
    does not check: the tile shapes Triton accepts), at Moonlight's MLA (16 heads, R
    512, rope 64, nope and value 128, bf16, pages of 16) for a 2048-row chunk, at the
    default own-rows tiling and a 128-row one with 8 warps, the prefix absorbed, and with
    the prefix expanded 8192 tokens a pass."""
    rows, heads, rank, rope, nope = 2048, 16, 512, 64, 128
    shapes = [((rows, heads, nope), jnp.bfloat16), ((rows, heads, rope), jnp.bfloat16), ((rows, rank), jnp.bfloat16),
              ((rows, rope), jnp.bfloat16), ((1024, 16, 1, rank), jnp.bfloat16), ((1024, 16, 1, rope), jnp.bfloat16),
              ((1,), jnp.int32), ((1, 512), jnp.int32), ((2,), jnp.int32), ((rank, heads, nope), jnp.bfloat16),
              ((rank, heads, nope), jnp.bfloat16)]
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    for config, prefix_kernel in ((OwnRowsConfig(), "mla_prefix_attention"),
                                  (OwnRowsConfig(128, 64, 8, 2), "mla_prefix_attention"),
                                  (OwnRowsConfig(prefix_window=8192), "mla_context_attention")):
        traced = jax.jit(lambda *a: mla_split_prefill(*a, sm_scale=0.1, decode_rows=1, config=config)).trace(*args)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert "mla_own_rows_attention" in text and prefix_kernel in text, config
