"""Ragged paged attention: the Pallas kernel (interpret mode, CPU) against the jnp
reference, and the reference against a float64 NumPy loop.

Inputs are random and fresh per test (the seed is in every failure message). Cache
slots that no q row may attend (other sequences' pages, slots past kv_len, pages
owned by nobody) hold NaN or huge values, so reading one shows up. Pallas'
interpret mode fills outputs with NaN before the kernel runs, so an owned row the
kernel failed to write shows up as NaN too.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fresh_rng
from tolerances import assert_within, attention_float64
from jaxmtp.kernels import (
    KernelConfig,
    default_config,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)


def _new_rng():
    rng = fresh_rng()
    return rng, rng.bit_generator.seed_seq.entropy


def make_case(rng, seqs, *, num_q_heads, num_kv_heads, head_dim, page_size, dtype,
              pad_rows=3, spare_pages=4):
    """Inputs for sequences given as (q rows, kv_len); (0, 0) is a padding sequence.

    Pages are handed out in shuffled order; page-table entries a sequence does not
    use point at poisoned pages; T carries pad_rows rows owned by nobody.
    """
    pages_needed = [math.ceil(kv_len / page_size) for _, kv_len in seqs]
    pages_per_seq = max(pages_needed) + 1
    num_pages = sum(pages_needed) + spare_pages
    order = rng.permutation(num_pages)
    owned_pages, unowned_pages = order[: sum(pages_needed)], order[sum(pages_needed):]
    page_table = rng.choice(unowned_pages, size=(len(seqs), pages_per_seq)).astype(np.int32)

    shape = (num_pages, page_size, num_kv_heads, head_dim)
    # Unattended slots: NaN in V (0 * NaN stays NaN) and a NaN/huge mix in K.
    k = np.where(rng.random(shape) < 0.5, np.nan, 1e30).astype(np.float32)
    v = np.full(shape, np.nan, np.float32)
    next_page = 0
    for s, ((_, kv_len), n) in enumerate(zip(seqs, pages_needed)):
        pages = owned_pages[next_page: next_page + n]
        next_page += n
        page_table[s, :n] = pages
        for t in range(kv_len):
            page, slot = pages[t // page_size], t % page_size
            k[page, slot] = rng.standard_normal((num_kv_heads, head_dim))
            v[page, slot] = rng.standard_normal((num_kv_heads, head_dim))

    rows = [nq for nq, _ in seqs]
    query_start = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
    num_rows = int(query_start[-1]) + pad_rows
    q = rng.standard_normal((num_rows, num_q_heads, head_dim))
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(k, dtype),
        jnp.asarray(v, dtype),
        jnp.asarray([kv_len for _, kv_len in seqs], jnp.int32),
        jnp.asarray(page_table),
        jnp.asarray(query_start),
    )


def relative_error(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def check_kernel(args, seed, *, config=None, **options):
    """Kernel (interpret) == reference; unowned rows exactly 0; nothing NaN. float32:
    elementwise within twice one evaluation's rounding bound (tolerances.attention_float64);
    bf16: the kernel feeds bf16 probabilities to the PV product and rounds its output to
    bf16, the reference keeps float32 probabilities: a relative error of a few bf16
    roundings (u = 2^-8), at most 3 u = 1.2e-2 over the rows."""
    q, query_start = args[0], np.asarray(args[5])
    ref = ragged_paged_attention_reference(*args, **options)
    out = ragged_paged_attention(*args, interpret=True, config=config, **options)
    assert out.shape == q.shape and out.dtype == q.dtype
    out32 = np.asarray(out, np.float32)
    assert not np.isnan(out32).any(), f"seed={seed}: NaN in output (unwritten or poisoned)"
    owned = np.zeros(q.shape[0], bool)
    owned[query_start[0]: query_start[-1]] = True
    assert (out32[~owned] == 0).all(), f"seed={seed}: unowned rows are not 0"
    assert (np.asarray(ref, np.float32)[~owned] == 0).all(), f"seed={seed}: reference unowned rows"
    if q.dtype == jnp.float32:
        _, bound, _ = attention_float64(*args, **options)
        assert_within(out32[owned], np.asarray(ref)[owned], 2 * bound[owned], f"seed={seed}")
    else:
        error = relative_error(out32[owned], np.asarray(ref, np.float32)[owned])
        assert error < 3 * 2.0**-8, f"seed={seed}: relative error {error:.2e}"


@pytest.mark.parametrize("options", [{}, {"sliding_window": 5, "soft_cap": 2.0}])
def test_reference_matches_float64_loop(options):
    rng, seed = _new_rng()
    seqs = [(1, 9), (0, 0), (4, 13), (7, 7), (3, 20)]
    args = make_case(rng, seqs, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4,
                     dtype=jnp.float32)
    ref = np.asarray(ragged_paged_attention_reference(*args, **options))
    expected, bound, _ = attention_float64(*args, **options)
    assert not np.isnan(ref).any(), f"seed={seed}"
    assert_within(ref, expected, bound, f"seed={seed}")


def test_decode_only():
    rng, seed = _new_rng()
    seqs = [(1, int(n)) for n in rng.integers(1, 70, size=6)] + [(0, 0)]
    args = make_case(rng, seqs, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=8,
                     dtype=jnp.bfloat16)
    check_kernel(args, seed)


def test_verify_rows():
    rng, seed = _new_rng()
    seqs = [(int(n), int(n) + int(c)) for n, c in zip(rng.integers(2, 6, size=5), rng.integers(0, 40, size=5))]
    args = make_case(rng, seqs, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                     dtype=jnp.float32)
    check_kernel(args, seed)


def test_prefill_chunks():
    rng, seed = _new_rng()
    # A first chunk, a middle chunk (cache before it), a final odd-sized chunk.
    seqs = [(24, 24), (17, 50), (9, 61)]
    args = make_case(rng, seqs, num_q_heads=2, num_kv_heads=2, head_dim=16, page_size=8,
                     dtype=jnp.float32)
    check_kernel(args, seed, config=KernelConfig(block_q=8, block_kv=16, num_splits=1,
                                                 num_warps=4, num_stages=2))


MIXED = [(1, 37), (0, 0), (3, 22), (20, 45), (1, 1), (5, 5), (0, 0), (11, 11)]


@pytest.mark.parametrize(
    "dtype,head_dim,num_q_heads,num_kv_heads",
    [
        (jnp.float32, 8, 2, 2),
        (jnp.bfloat16, 16, 4, 2),
        (jnp.float32, 64, 8, 2),
        (jnp.bfloat16, 64, 8, 2),
        (jnp.float32, 16, 6, 2),  # group of 3: padded to 4 inside the kernel
    ],
)
def test_mixed_batch(dtype, head_dim, num_q_heads, num_kv_heads):
    rng, seed = _new_rng()
    args = make_case(rng, MIXED, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, page_size=8, dtype=dtype)
    check_kernel(args, seed)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("options", [{"sliding_window": 9}, {"soft_cap": 3.0},
                                     {"sliding_window": 16, "soft_cap": 5.0, "sm_scale": 0.3}])
def test_window_soft_cap_and_splits(options, num_splits):
    rng, seed = _new_rng()
    args = make_case(rng, MIXED, num_q_heads=4, num_kv_heads=1, head_dim=16, page_size=4,
                     dtype=jnp.float32)
    # block_kv 8 over contexts up to 45: several fully-visible steps between masked ones.
    config = KernelConfig(block_q=4, block_kv=8, num_splits=num_splits, num_warps=4, num_stages=2)
    check_kernel(args, seed, config=config, **options)


def test_page_size_one_and_padding_only_tail():
    rng, seed = _new_rng()
    seqs = [(2, 6), (1, 3), (0, 0), (0, 0)]
    args = make_case(rng, seqs, num_q_heads=2, num_kv_heads=1, head_dim=8, page_size=1,
                     dtype=jnp.float32, pad_rows=9)
    check_kernel(args, seed)


def test_default_config_shapes():
    decode = default_config(num_rows=128, num_seqs=128, group=4, num_kv_heads=8, max_context=4096)
    assert decode.block_q * 4 == 16 and decode.num_splits == 1
    # 32 sequences x 8 kv heads already outnumber the H200's 132 multiprocessors
    assert default_config(num_rows=32, num_seqs=32, group=4, num_kv_heads=8, max_context=4096).num_splits == 1
    small_decode = default_config(num_rows=8, num_seqs=8, group=4, num_kv_heads=8, max_context=4096)
    assert small_decode.num_splits > 1
    # batch 1 would want 33 splits; the merge reads every split, live or idle
    assert 1 < default_config(num_rows=8, num_seqs=1, group=4, num_kv_heads=8, max_context=4096).num_splits <= 8
    # Verify rows (k+1 = 2) share decode's tile and splits.
    verify = default_config(num_rows=16, num_seqs=8, group=4, num_kv_heads=8, max_context=4096)
    assert verify.block_q == small_decode.block_q and verify.num_splits == small_decode.num_splits
    prefill = default_config(num_rows=2048, num_seqs=1, group=4, num_kv_heads=8, max_context=4096)
    assert prefill.block_q * 4 == 256 and prefill.num_warps == 8


@pytest.mark.parametrize("extra", [1, 2])
def test_rows_before_each_request_as_a_draft_module_lays_them_out(extra):
    """MTP module j > 1 recomputes up to j-1 rows before each request's first row
    (jaxmtp.worker.batch.with_rows_before): the kernel takes that layout as it comes, every row
    at the position with_rows_before gave it (its kv_len minus its rows after it)."""
    import dataclasses

    from jaxmtp.worker.batch import Batch, field_shapes, with_rows_before

    rng, seed = _new_rng()
    page_size, k, pad_rows = 4, 2, 3
    # (first position, rows): verify rows, a chunk mid-prompt, a prompt's first chunk,
    # a one-row decode at position 1 (fewer rows before it than asked), a padding request
    spans = [(int(rng.integers(5, 20)), k + 1), (int(rng.integers(8, 20)), 5), (0, 4), (1, 1), (0, 0)]
    rows = np.array([n for _, n in spans])
    t, b = int(rows.sum()) + pad_rows, len(spans)
    query_start = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
    positions = np.zeros(t, np.int32)
    for s, (first, n) in enumerate(spans):
        positions[query_start[s]: query_start[s + 1]] = first + np.arange(n)
    fields = {name: np.zeros(shape, np.int32) for name, shape in field_shapes(t, b, 8, k, 1).items()}
    batch = Batch(**fields)
    batch = dataclasses.replace(
        batch, query_start=jnp.asarray(query_start), positions=jnp.asarray(positions),
        kv_len=jnp.asarray([first + n if n else 0 for first, n in spans], jnp.int32),
    )
    before = with_rows_before(batch, extra, page_size, num_slots=64 * page_size)
    new_start = np.asarray(before.query_start)
    new_rows = np.diff(new_start)
    expected = [n + min(extra, first) if n else 0 for first, n in spans]
    assert new_rows.tolist() == expected, f"seed={seed}"
    kv_len = np.asarray(before.kv_len)
    for s in range(b):
        got = np.asarray(before.positions)[new_start[s]: new_start[s + 1]]
        assert got.tolist() == (kv_len[s] - new_rows[s] + np.arange(new_rows[s])).tolist(), f"seed={seed}"
    total_rows = before.input_ids.shape[0]
    args = make_case(rng, list(zip(new_rows.tolist(), kv_len.tolist())), num_q_heads=4, num_kv_heads=2,
                     head_dim=16, page_size=page_size, dtype=jnp.float32,
                     pad_rows=total_rows - int(new_rows.sum()))
    check_kernel(args, seed)
