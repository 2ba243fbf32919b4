"""Sampling on the device: filters against a float64 NumPy reference, the sampled
distribution against the exact one, and seeds."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from conftest import STORIES
from jaxmtp import LLM, SamplingParams
from jaxmtp.worker.sampling import _ordered_keys, filter_logits, restrict, top_k_by_chunks, verify_and_sample
from tolerances import assert_within, softmax_relative


def numpy_filtered_probs(logits, temperature, top_k, top_p, min_p, margin=None):
    """The distribution sampling should draw from, in float64: the tokens at or above the
    k-th largest value (ties kept), of those the ones whose greater-valued tokens hold less
    than top_p of their mass, and of those the ones of probability >= min_p times the
    largest. With margin=[] it also records how close each top-p / min-p decision came
    to its threshold."""
    x = logits.astype(np.float64) / temperature
    k = min(top_k, len(x)) if top_k > 0 else len(x)
    in_top_k = x >= np.sort(x)[::-1][k - 1]
    mass = np.where(in_top_k, np.exp(x - x.max()), 0.0)
    mass /= mass.sum()
    mass_greater = (mass[None, :] * (x[None, :] > x[:, None])).sum(axis=1)
    keep = in_top_k & ((mass_greater < top_p) | (top_p >= 1.0)) & (mass >= min_p * mass.max())
    if margin is not None and top_p < 1.0:
        margin.append(np.abs(mass_greater[in_top_k] - top_p).min())
    if margin is not None and min_p > 0.0:
        margin.append(np.abs(mass - min_p * mass.max())[in_top_k].min())
    probs = np.where(keep, np.exp(x - x.max()), 0.0)
    return probs / probs.sum()


def g_test(observed: np.ndarray, expected_probs: np.ndarray) -> tuple[float, int]:
    """p-value of a G-test of counts against probabilities (chi-square asymptotics),
    with the cells expected to hold fewer than 10 samples pooled into one (into the
    smallest other bin if the pool itself is expected to hold fewer). Cells of
    probability 0 are left out: the callers check that they are empty. Measured on
    multinomial draws (6000 over 24 cells to 12000 over 1296): p < 1e-3 came out at a
    rate of 0.8e-3 to 1.5e-3, so callers halve their threshold to keep the rate they state."""
    expected = expected_probs * observed.sum()
    small = (expected < 10) & (expected > 0)
    obs, exp = observed[expected >= 10].astype(np.float64), expected[expected >= 10]
    if small.any():
        pool_obs, pool_exp = observed[small].sum(), expected[small].sum()
        if pool_exp >= 10 or not len(exp):
            obs, exp = np.append(obs, pool_obs), np.append(exp, pool_exp)
        else:
            obs[np.argmin(exp)] += pool_obs
            exp[np.argmin(exp)] += pool_exp
    g = 2 * np.sum(np.where(obs > 0, obs * np.log(np.maximum(obs, 1) / exp), 0.0))
    return float(stats.chi2.sf(g, max(len(obs) - 1, 1))), len(obs)


CASES = [(1.0, -1, 1.0, 0.0), (0.7, 10, 1.0, 0.0), (1.3, -1, 0.8, 0.0), (1.0, -1, 1.0, 0.05), (0.9, 20, 0.6, 0.02),
         (1.0, 6, 0.9, 0.0)]


# the logits of a test row: continuous, or rounded to a grid (as bfloat16 logits are), so
# that groups of equal values, a few tokens each at the top, straddle the k-th largest and
# the top-p cutoff; a grid step whose probability ratios stay clear of CASES' min-p (a
# step of 0.5 puts e^-3 ~ 0.05 next to it)
LOGITS = {"normal": lambda rng, shape: rng.normal(0, 3, size=shape),
          "ties": lambda rng, shape: np.round(rng.normal(0, 3, size=shape) / 0.41) * 0.41}


# filter_logits (the engine's restriction on this platform), and each of restrict's:
# the sort, and the search at 1, 2 and 4 bits a pass (benchmarks/sampling.py times them)
METHODS = {"engine": None, "sort": dict(search=False),
           **{f"search-{bits}": dict(search=True, digit_bits=bits) for bits in (1, 2, 4)}}


@pytest.mark.parametrize("values", LOGITS)
@pytest.mark.parametrize("method", METHODS)
def test_filters_match_numpy_reference(rng, values, method):
    """Every restriction keeps the reference's tokens with the reference's probabilities."""
    vocab, rows = 300, len(CASES) * 8  # each case on 8 rows: a tie at a threshold is in some
    cases = CASES * 8
    for _ in range(50):  # float32 and float64 may decide differently right at a threshold
        logits = LOGITS[values](rng, (rows, vocab)).astype(np.float32)
        # the filter's float32 softmax, and the test's own of its result: twice one's error
        relative = 2 * softmax_relative(float(np.abs(logits).max()) / min(c[0] for c in CASES), vocab)
        margins = []
        for row, case in enumerate(cases):
            numpy_filtered_probs(logits[row], *case, margin=margins)
        if min(margins) > 2 * relative:  # top-p's mass and min-p's ratio, each within relative
            break
    else:
        pytest.fail(f"no draw of {values} logits clear of CASES' thresholds")
    t, k, p, m = (jnp.asarray(np.array(c), dtype) for c, dtype in
                  zip(zip(*cases), (jnp.float32, jnp.int32, jnp.float32, jnp.float32)))
    if METHODS[method] is None:
        got = np.asarray(filter_logits(jnp.asarray(logits), t, k, p, m))
    else:
        got = np.asarray(restrict(jnp.asarray(logits) / t[:, None], k, p, m, **METHODS[method]))
    for row, case in enumerate(cases):
        expected = numpy_filtered_probs(logits[row], *case)
        got_probs = np.exp(got[row] - got[row].max())
        got_probs /= got_probs.sum()
        np.testing.assert_array_equal(got_probs > 0, expected > 0, f"row {row}, case {case}")
        assert_within(got_probs, expected, relative * expected, f"row {row}, case {case}")


def test_the_restriction_follows_the_platform_table(monkeypatch):
    """filter_logits sorts on a platform RESTRICT_SEARCH_FROM_ROWS does not list, and
    from the listed row count on searches instead."""
    from jaxmtp.worker import sampling

    def sorts(rows: int) -> bool:
        args = (jnp.zeros((rows, 64)), jnp.ones(rows), jnp.zeros(rows, jnp.int32), jnp.ones(rows), jnp.zeros(rows))
        return "stablehlo.sort" in jax.jit(filter_logits).lower(*args).as_text()

    monkeypatch.setattr(sampling, "RESTRICT_SEARCH_FROM_ROWS", {})
    assert sorts(1) and sorts(8)
    monkeypatch.setattr(sampling, "RESTRICT_SEARCH_FROM_ROWS", {jax.default_backend(): 4})
    assert sorts(3) and not sorts(4)


def test_ordered_keys_sort_as_the_values(rng):
    """restrict's uint32 keys order as their float32 values, -0.0 equal to 0.0 (subnormal
    values left out: XLA flushes them to zero, keys and comparisons alike)."""
    x = np.concatenate([rng.normal(0, 10, 200), rng.normal(0, 1e-30, 50), [0.0, -0.0, np.inf, -np.inf, 1e38, -1e38]])
    x = rng.permutation(x).astype(np.float32)
    keys = np.asarray(_ordered_keys(jnp.asarray(x)[None]))[0]
    order = lambda v: np.greater.outer(v, v).astype(int) - np.less.outer(v, v)  # noqa: E731
    np.testing.assert_array_equal(order(keys), order(x))


@pytest.mark.parametrize("case", CASES[:3] + CASES[4:])
def test_sample_distribution_matches_filtered_softmax(rng, case):
    vocab, draws = 24, 6000
    logits = rng.normal(0, 1.5, size=vocab).astype(np.float32)
    t, k, p, m = case
    batch = types.SimpleNamespace(
        temperature=jnp.full(draws, t, jnp.float32), top_k=jnp.full(draws, k, jnp.int32),
        top_p=jnp.full(draws, p, jnp.float32), min_p=jnp.full(draws, m, jnp.float32),
        seed=jnp.asarray(rng.integers(0, 2**32, size=draws, dtype=np.uint32)),
        output_index=jnp.zeros(draws, jnp.int32),
    )
    tokens, _ = verify_and_sample(jnp.tile(jnp.asarray(logits), (draws, 1, 1)), jnp.zeros((draws, 0), jnp.int32),
                                  jnp.zeros(draws, jnp.int32), batch)
    counts = np.bincount(np.asarray(tokens[:, 0]), minlength=vocab)
    expected = numpy_filtered_probs(logits, *case)
    assert np.all(counts[expected == 0] == 0)
    # a G-test: each of the five cases fails by chance with probability <= 1e-4 / 5
    p, bins = g_test(counts, expected)
    assert p >= 1e-4 / 5 / 2, f"p={p:.2e} over {bins} bins"


def test_seeds_reproduce_and_differ_whatever_the_batch():
    llm = LLM(STORIES, max_num_seqs=8, max_num_batched_tokens=64)
    seeded = SamplingParams(max_tokens=40, temperature=1.0, seed=1234)
    alone = llm.generate([[1]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([[1]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(
        [[1, 403], [1], [1, 300, 301, 302]],
        [SamplingParams(max_tokens=25, temperature=0.9), seeded, SamplingParams(max_tokens=7, temperature=0.0)],
        use_tqdm=False,
    )[1].outputs[0].token_ids
    other = llm.generate([[1]], SamplingParams(max_tokens=40, temperature=1.0, seed=1235), use_tqdm=False)
    assert alone == again == crowd
    assert other[0].outputs[0].token_ids != alone


def test_n_samples_per_prompt_differ():
    llm = LLM(STORIES, max_num_seqs=8, max_num_batched_tokens=64)
    out = llm.generate([[1]], SamplingParams(max_tokens=20, temperature=1.0, n=3, seed=5), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


def test_top_k_by_chunks_equals_lax_top_k_ties_included(rng):
    """The top logprobs' two-pass top-k gives lax.top_k's values and indices, ties to the
    lower index: integer logits (ties everywhere), chunks smaller than k, equal to the
    axis and larger, and an axis that is not a multiple of the chunk."""
    for shape, k, chunk in [((3, 1000), 20, 64), ((2, 3, 1003), 20, 100), ((4, 50), 5, 8), ((2, 37), 20, 16),
                            ((1, 300), 20, 512), ((2, 256), 20, 256)]:
        x = rng.integers(-4, 5, size=shape).astype(np.float32)
        want = jax.lax.top_k(jnp.asarray(x), k)
        got = top_k_by_chunks(jnp.asarray(x), k, chunk)
        for w, g in zip(want, got):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=str((shape, k, chunk)))

