"""The joint distribution of the tokens a request emits through verify rows, against the
exact one computed in float64.

What it covers: `sampling.verify_and_sample` driven step after step as the engine drives
it, on a synthetic target whose logits at position i depend on i and on the token at
i-1 (a first-order Markov chain over a 6-token vocabulary, so the target distribution
of the first L tokens is small enough to write out: 6^L cells). Each step verifies k
point-mass drafts (the argmax of a separate, noisy draft table, chained on the previous
draft as the MTP module's proposals are), so a verify row j sees the logits conditioned
on drafts 1..j, which differ from the emitted prefix whenever a draft is rejected. The
request's output index moves by num_accepted + 1 per step, so the L tokens span one to L
steps. Lossless speculative sampling must give exactly plain sequential sampling of the
filtered target: P(x_1..x_L) = prod_i filtered(logits[i, x_{i-1}])[x_i].

Cases: k in {2, 3} x temperature in {0.5, 1} x {no filter, top-k, top-p, min-p, all
three}, all in one batch (one compile per k), each case its own fresh seeds. Test: G-test
of the empirical counts against the exact distribution (test_sampling.g_test); a case
fails at p < 1e-4 / (number of cases) / 2, so the whole test fails by chance with
probability <= 1e-4 (Bonferroni, halved as g_test's calibration asks). A sample in a
cell of probability 0 fails at once. 12000 samples per case: with 10000, each planted bug
below already failed at p < 1e-30 in every case it affects.

Planted bugs that this test catches (tried by hand): acceptance decided on the logits
before filtering; all verify rows of a step sharing one random key; every step of a
request reusing the same noise (output index left out of the key).

The same requests sampled plainly, one token a step, must also give the same tokens key
for key: a row's token is the target's sample under noise keyed by its output index,
whether or not a draft was verified there (what keeps a seeded request's output
independent of preemption, tests/test_seeded_mtp.py).
"""

from __future__ import annotations

import functools
import itertools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp.worker.sampling import verify_and_sample
from test_sampling import g_test, numpy_filtered_probs
from tolerances import softmax_relative

VOCAB = 6
BOS = VOCAB  # the "previous token" of position 0
SAMPLES = 12_000
FILTERS = [(-1, 1.0, 0.0), (3, 1.0, 0.0), (-1, 0.8, 0.0), (-1, 1.0, 0.15), (4, 0.9, 0.1)]  # top_k, top_p, min_p
CASES = [(k, t, *f) for k in (2, 3) for t in (0.5, 1.0) for f in FILTERS]
ALPHA = 1e-4 / len(CASES) / 2  # halved: test_sampling.g_test


@functools.partial(jax.jit, static_argnames="num_rows")
def verify_step(logits, drafts, temperature, top_k, top_p, min_p, seed, output_index, num_rows):
    n = logits.shape[0]
    batch = types.SimpleNamespace(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                                  output_index=output_index)
    num_drafts = jnp.full(n, num_rows - 1, jnp.int32)
    return verify_and_sample(logits, drafts, num_drafts, batch)


def make_tables(rng, length: int, k: int):
    """Target logits [positions, previous token, V] whose filter decisions sit clear of
    their thresholds in float32 (float32 and float64 may decide differently right at
    one), and a draft table: the target's plus noise, so drafts are often but not
    always the target's likeliest token."""
    while True:
        base = rng.normal(0, 1.5, size=VOCAB)
        target = (base + rng.normal(0, 0.8, size=(length + k + 1, VOCAB + 1, VOCAB))).astype(np.float32)
        margins = []
        for t, (top_k, top_p, min_p) in itertools.product((0.5, 1.0), FILTERS):
            for row in target[:length].reshape(-1, VOCAB):
                numpy_filtered_probs(row, t, top_k, top_p, min_p, margin=margins)
        # a decision's two sides (the mass or ratio against its threshold) each within
        # softmax_relative of float64's at the lowest temperature
        if min(margins) > 2 * softmax_relative(float(np.abs(target[:length]).max()) / 0.5, VOCAB):
            return target, target + rng.normal(0, 1.0, size=target.shape).astype(np.float32)


def exact_distribution(target, length, temperature, top_k, top_p, min_p) -> np.ndarray:
    """P(x_1..x_length) over VOCAB^length cells (row-major), float64."""
    probs = np.array([[numpy_filtered_probs(target[i, prev], temperature, top_k, top_p, min_p)
                       for prev in range(VOCAB + 1)] for i in range(length)])
    joint = probs[0, BOS]
    for i in range(1, length):  # a cell's last token is its index mod VOCAB
        joint = (joint[:, None] * probs[i, np.arange(len(joint)) % VOCAB]).reshape(-1)
    return joint.reshape(-1)


def run_requests(target, drafts_table, length: int, k: int, params, seeds):
    """Every sample a request of its own, stepped until it has `length` tokens. params:
    per sample (temperature, top_k, top_p, min_p) arrays. Returns tokens [N, length]."""
    n = len(seeds)
    out = np.zeros((n, length + k + 1), np.int64)
    count = np.zeros(n, np.int64)
    last = np.full(n, BOS)
    rows = np.arange(n)
    args = [jnp.asarray(p) for p in params] + [jnp.asarray(seeds)]
    while (count < length).any():
        at = np.minimum(count, length)  # requests already done keep stepping, ignored
        drafts = np.zeros((n, k), np.int64)
        prev = last
        for j in range(k):  # chained point-mass proposals
            drafts[:, j] = np.argmax(drafts_table[at + j, prev], axis=-1)
            prev = drafts[:, j]
        previous = np.concatenate([last[:, None], drafts], axis=1)  # row j reads the prefix + drafts 1..j
        logits = target[at[:, None] + np.arange(k + 1), previous]
        tokens, accepted = verify_step(jnp.asarray(logits), jnp.asarray(drafts, jnp.int32), *args[:4], args[4],
                                       jnp.asarray(count, jnp.int32), num_rows=k + 1)
        tokens, accepted = np.asarray(tokens), np.asarray(accepted)
        assert (tokens[:, :k] == drafts)[np.arange(k)[None] < accepted[:, None]].all()
        for j in range(k + 1):
            emits = (j <= accepted) & (count + j < out.shape[1])
            out[rows[emits], (count + j)[emits]] = tokens[emits, j]
        last = tokens[rows, accepted]
        count = count + accepted + 1
    return out[:, :length]


@pytest.mark.parametrize("k", [2, 3])
def test_joint_distribution_through_verify_rows_is_exact(rng, k):
    length = k + 1
    target, drafts_table = make_tables(rng, length, k)
    cases = [c for c in CASES if c[0] == k]
    params = [np.repeat(np.array([c[i] for c in cases], dtype), SAMPLES) for i, dtype in
              ((1, np.float32), (2, np.int32), (3, np.float32), (4, np.float32))]
    seeds = rng.integers(0, 2**32, size=SAMPLES * len(cases), dtype=np.uint32)
    tokens = run_requests(target, drafts_table, length, k, params, seeds)
    codes = np.ravel_multi_index(tokens.T, (VOCAB,) * length)
    failures = []
    for c, (_, t, top_k, top_p, min_p) in enumerate(cases):
        observed = np.bincount(codes[c * SAMPLES : (c + 1) * SAMPLES], minlength=VOCAB**length)
        exact = exact_distribution(target, length, t, top_k, top_p, min_p)
        impossible = observed[exact == 0].sum()
        p, bins = g_test(observed, exact)
        if impossible or p < ALPHA:
            failures.append(f"T={t} top_k={top_k} top_p={top_p} min_p={min_p}: p={p:.2e} over {bins} bins, "
                            f"{impossible} samples of probability 0")
    assert not failures, f"k={k} (alpha {ALPHA:.1e} per case):\n" + "\n".join(failures)

    plain = run_requests(target, drafts_table, length, 0, params, seeds)
    differ = np.flatnonzero((plain != tokens).any(axis=1))
    assert not len(differ), f"k={k}: {len(differ)} requests emit other tokens than plain sampling, e.g. seed {seeds[differ[0]]}"
