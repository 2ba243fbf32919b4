"""Tolerances derived from the arithmetic they check, so that a randomized test fails
for a wrong result and never for rounding.

Float32 has unit roundoff u = 2^-24. A float32 sum of n terms (each a rounded product,
in any order) lies within gamma_n * sum|terms| of the exact sum, gamma_n = n u / (1 - n u)
(Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.5 and
Lemma 3.1). Each bound below is that result carried through the computation to first
order in u: one float32 evaluation against the exact (float64) value. Two float32
evaluations in different orders (a kernel and its reference) lie within twice it."""

from __future__ import annotations

import math

import numpy as np

U32 = 2.0**-24
# XLA's float32 exp, tanh and division are within 2 ulp (4 u) of the exact value; a
# nonlinearity of a few of them (SiLU: exp, add, divide, multiply) within 8 u
NONLINEAR_ROUNDING = 8 * U32
SILU_SLOPE = 1.1  # max |d/dx x sigmoid(x)|


def gamma(n: int) -> float:
    return n * U32 / (1 - n * U32)


def assert_within(got, want, bound, what: str = "") -> None:
    """|got - want| <= bound elementwise, want exact (float64) or another evaluation."""
    error = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    bound = np.broadcast_to(np.asarray(bound, np.float64), error.shape)
    past = error > bound
    if past.any():
        worst = np.unravel_index(np.argmax(error - bound), error.shape)
        raise AssertionError(f"{what}: {int(past.sum())} of {error.size} elements past their rounding bound; worst at "
                             f"{tuple(map(int, worst))}: error {error[worst]:.3e}, bound {bound[worst]:.3e}")


# The summing stages of one decoder layer: its two norms, q/k/v, q.k, the softmax's sum,
# p.v, o, the MLP's (or router's and experts') gate/up, down, the experts' weighted sum
# and the two residual adds
STAGES_PER_LAYER = 12


def reordered_model_bound(scale: float, num_layers: int, max_terms: int) -> float:
    """How far apart two float32 evaluations of one model over the same tokens can lie
    when only the order of their sums differs (batches of other shapes, other chunks,
    other devices). To first order each lies within the sum over its summing stages of
    gamma(terms) times the magnitude of what the stage sums, of the exact value,
    provided no stage amplifies the error handed to it more than its input's magnitude
    (a residual add and an RMSNorm do not; the tests' small models at their scale about
    do not: the one assumption). With every stage summing at most max_terms terms (the
    widest dot product or the longest context), of magnitude at most scale (the compared
    values' largest, the residual stream's scale), over num_layers decoder layers (MTP
    modules included), the two lie within 2 STAGES_PER_LAYER num_layers gamma(max_terms)
    scale. A wrong value (another token's row, a stale page) is off by about scale."""
    return 2 * STAGES_PER_LAYER * num_layers * gamma(max_terms) * scale


def rounded_activations_bound(scale: float, num_layers: int, max_terms: int, unit_roundoff: float) -> float:
    """How far a model whose activations are rounded to a narrower float (float16: u =
    2^-11, bfloat16: 2^-8) after each summing stage, the sums accumulating in float32,
    lies from the same weights computed exactly: each of STAGES_PER_LAYER stages a layer
    (the head one more layer) rounds once (u) after a float32 sum (gamma of its terms),
    at most the values' scale, to first order and with the assumption of
    reordered_model_bound (no stage amplifies the error handed to it)."""
    return STAGES_PER_LAYER * (num_layers + 1) * (unit_roundoff + gamma(max_terms)) * scale


def logits_bound(expected, num_layers: int, max_terms: int) -> float:
    """How far two float32 evaluations of a model's logits (ours and transformers', or
    ours over other batches, chunks or devices) may lie apart: reordered_model_bound at
    the logits' scale, the final norm and LM head counted as one more layer's stages."""
    return reordered_model_bound(float(np.abs(np.asarray(expected)).max()), num_layers + 1, max_terms)


def log_softmax_bound(logits_error: float, vocab: int, scale: float) -> float:
    """How far float32 log_softmax values (of magnitude at most scale) lie from the exact
    log_softmax of logits that are each within logits_error of the ones it was given:
    log-sum-exp is 1-Lipschitz in the max norm, so a logit's move and the log-sum-exp's
    add up to twice logits_error; float32's own evaluation adds the sum of vocab
    exponentials (gamma_vocab, relative, so as much absolutely in its log), the exp and
    log (NONLINEAR_ROUNDING) and the subtraction's rounding (one u of the value)."""
    return 2 * logits_error + gamma(vocab) + NONLINEAR_ROUNDING + U32 * scale


def logprob_bound(logits, num_layers: int, max_terms: int) -> float:
    """How far a float32 evaluation of a model's logprobs lies from the exact log_softmax
    of logits from another float32 evaluation, given those logits [..., vocab] (their
    scale; logprobs are at most the logits' spread plus log(vocab) in magnitude)."""
    logits = np.asarray(logits, np.float64)
    vocab = logits.shape[-1]
    scale = float((logits.max(axis=-1) - logits.min(axis=-1)).max()) + math.log(vocab)
    return log_softmax_bound(logits_bound(logits, num_layers, max_terms), vocab, scale)


def softmax_relative(max_abs_scaled_logit: float, vocab: int) -> float:
    """How far, relatively, float32 softmax probabilities (and filter decisions on them:
    cumulative mass, ratios to the top probability) lie from float64's: twice the
    largest scaled logit's rounding (u |x / T|, through the max-shift), the sum of the
    exponentials (gamma_vocab), the exp and the division (NONLINEAR_ROUNDING)."""
    return 2 * U32 * max_abs_scaled_logit + gamma(vocab) + NONLINEAR_ROUNDING


def matmul_bound(abs_lhs, abs_rhs, k: int) -> np.ndarray:
    """x @ w with a reduction of length k: gamma_k |x| @ |w| (both given as magnitudes)."""
    return gamma(k) * (np.asarray(abs_lhs, np.float64) @ np.asarray(abs_rhs, np.float64))


def swiglu_relative(k: int) -> float:
    """silu(g) * u with g and u float32 dot products of length k, relative to the
    product of their magnitudes (|x| @ |w|): g and u are each within gamma_k of their
    magnitude, silu carries g's error at most SILU_SLOPE-fold and adds its own rounding,
    the product one more u; |silu(g)| <= |g| <= its magnitude."""
    return SILU_SLOPE * gamma(k) + gamma(k) + NONLINEAR_ROUNDING + U32


def attention_float64(q, k_pages, v_pages, kv_lens, page_table, query_start, *, sm_scale=None, sliding_window=None,
                      soft_cap=None, q_magnitude=None, reduction=None):
    """Ragged paged attention one (row, head) at a time in float64 NumPy, and the bound
    on one float32 evaluation's error: the logits' dot products (length D, magnitude
    L = sm_scale |q| |k|) err by at most gamma_D L each, which moves every softmax weight by
    at most 2 gamma_D max L relatively; the softmax's exp, sum (N terms, plus at most
    one rescale per token for an online softmax and one per split for a combine, splits
    <= N) and division add gamma_{3N+4}; the weighted sum of N values adds gamma_N. So
    |error| <= (2 gamma_D max L + gamma_{3N+4} + gamma_N) sum_i p_i |v_i|."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    q_magnitude = np.abs(q) if q_magnitude is None else np.asarray(q_magnitude, np.float64)
    num_rows, num_q_heads, head_dim = q.shape
    reduction = head_dim if reduction is None else reduction
    page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    scale = 1 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    out = np.zeros((num_rows, num_q_heads, v_pages.shape[-1]))
    bound, magnitude_out = np.zeros_like(out), np.zeros_like(out)
    for s in range(len(kv_lens)):
        start, end, kv_len = int(query_start[s]), int(query_start[s + 1]), int(kv_lens[s])
        for j, row in enumerate(range(start, end)):
            pos = kv_len - (end - start) + j
            tokens = [t for t in range(pos + 1) if sliding_window is None or t > pos - sliding_window]
            pages = [int(page_table[s, t // page_size]) for t in tokens]
            slots = [t % page_size for t in tokens]
            for h in range(num_q_heads):
                kv_head = h // (num_q_heads // num_kv_heads)
                keys, values = k_pages[pages, slots, kv_head], v_pages[pages, slots, kv_head]
                logits = keys @ q[row, h] * scale
                if soft_cap is not None:  # tanh is 1-Lipschitz: the logits' error bound holds through it
                    logits = soft_cap * np.tanh(logits / soft_cap)
                weights = np.exp(logits - logits.max())
                weights /= weights.sum()
                out[row, h] = weights @ values
                magnitude = (np.abs(keys) @ q_magnitude[row, h] * scale).max()
                n = len(tokens)
                relative = 2 * gamma(reduction) * magnitude + gamma(3 * n + 4) + gamma(n)
                magnitude_out[row, h] = weights @ np.abs(values)
                bound[row, h] = relative * magnitude_out[row, h]
    return out, bound, magnitude_out
