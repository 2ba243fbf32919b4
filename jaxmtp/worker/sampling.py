"""On-device sampling and speculative verification.

Drafts are the MTP module's argmax, a point-mass proposal q, so lossless speculative
sampling reduces to: accept draft d with probability p(d), otherwise sample from p with
d removed, renormalised; after k accepted drafts sample a bonus token from p. Both come
from one sample of p per row, keyed by the request's seed and the row's output index:
the draft is accepted when it is that sample, and the sample is what the row emits.
Greedy rows are the same rule with the argmax for the sample.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def filter_logits(logits, temperature, top_k, top_p, min_p):
    """Temperature, top-k, top-p and min-p over logits [N, V] with per-row params [N].
    Returns logits of the distribution to sample from (masked entries -inf)."""
    # restricted unconditionally: a row without top-k, top-p or min-p keeps every token,
    # and skipping the sort under a lax.cond would stall the step on the host (docs/architecture.md)
    return restrict(logits / jnp.maximum(temperature, 1e-6)[:, None], top_k, top_p, min_p)


# Which restriction a platform runs, from benchmarks/sampling.py (docs/benchmarks,
# 2026-12-04): the fewest rows from which the threshold search beat the sort; a platform
# not listed sorts. On the CPU the search won at every shape measured (128256 tokens a row:
# 1 row 2.8 ms against 27.3 for the sort, 32 rows 59 against 843); on the H200 only the
# sort is timed yet (0.95-1.1 ms a call at 32 rows, 0.11 ms at 1 row).
RESTRICT_SEARCH_FROM_ROWS = {"cpu": 1}
# The search's digit: it tries 2**RESTRICT_DIGIT_BITS values of the threshold's next digit
# in one pass over the rows (32 / RESTRICT_DIGIT_BITS passes a search), one reduction per
# value above 0. 1 bit was the fastest on the CPU (32 rows: 59 ms, 2 bits 179, 4 bits 350);
# on a GPU, where XLA may run sibling reductions as one kernel, fewer passes may win.
RESTRICT_DIGIT_BITS = 1


def restrict(x, top_k, top_p, min_p, search: bool | None = None, digit_bits: int = RESTRICT_DIGIT_BITS):
    """Scaled logits [N, V] with the tokens outside each row's top-k, top-p and min-p at -inf.

    A token is kept when its value is at least the row's k-th largest (ties with it kept,
    as vLLM's top-k keeps them), the tokens of greater value hold less than top_p of the
    top-k tokens' mass (the smallest set of values reaching top_p, every token of its
    last value included) and its probability is at least min_p times the largest. The
    two thresholds come from a sort of each row, or (`search`; by default where
    RESTRICT_SEARCH_FROM_ROWS says) from a search over the values' bits: passes over the
    row that each count (or weigh) the tokens at or above 2**digit_bits - 1 thresholds."""
    x = x.astype(jnp.float32)
    rows, vocab = x.shape
    if search is None:
        search = rows >= RESTRICT_SEARCH_FROM_ROWS.get(jax.default_backend(), rows + 1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    # top_p = 1 keeps everything: a float32 sum can reach the whole mass before the tail
    whole = top_p >= 1.0
    relative = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))  # each token's probability over the largest's
    if search:
        keys = _ordered_keys(x)
        kth = _largest_key_reaching(keys, None, k, digit_bits)
        weight = jnp.where(keys >= kth[:, None], relative, 0.0)
        mass_cutoff = _largest_key_reaching(keys, weight, top_p * jnp.sum(weight, axis=-1), digit_bits)
        keep = keys >= jnp.where(whole, kth, jnp.maximum(mass_cutoff, kth))[:, None]
    else:
        desc = -jnp.sort(-x, axis=-1)
        kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
        desc_weight = jnp.where(desc >= kth, jnp.exp(desc - desc[:, :1]), 0.0)
        # the mass of the values before each sorted position (a tie group's first position
        # sees only greater values: the cutoff, the smallest value kept, keeps its group)
        mass_before = jnp.cumsum(desc_weight, axis=-1) - desc_weight
        reach = (mass_before < top_p[:, None] * jnp.sum(desc_weight, axis=-1, keepdims=True)) | whole[:, None]
        cutoff = jnp.min(jnp.where(reach & (desc >= kth), desc, jnp.inf), axis=-1, keepdims=True)
        keep = x >= cutoff
    # (keep holds the top-k alone: min-p needs no top-k mask of its own)
    return jnp.where(keep & (relative >= min_p[:, None]), x, NEG_INF)


def _ordered_keys(x):
    """float32 [N, V] -> uint32 keys in the values' order (-0.0 as 0.0): the sign bit set
    on non-negative values, every bit flipped on negative ones."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _largest_key_reaching(keys, weight, target, digit_bits: int):
    """Per row, the largest t with (the count of keys >= t, or with `weight` [N, V] >= 0
    their weight) >= target [N], built a digit at a time from the top bits: the digit is
    the largest of its 2**digit_bits values whose threshold still reaches the target
    (the total falls as the threshold rises). A row whose target no threshold above 0
    reaches gets 0, keeping every key (the whole total may round under top_p times
    itself)."""
    if 32 % digit_bits:
        raise ValueError(f"digit_bits must divide 32, got {digit_bits}")
    found = jnp.zeros(keys.shape[:-1], jnp.uint32)
    for shift in range(32 - digit_bits, -1, -digit_bits):
        # one reduction over the rows per candidate digit: siblings over the same keys, which
        # XLA may fuse into one pass (a broadcast [N, digits, V] is read once a digit); digit
        # 0's threshold is the one found so far, which reaches: not summed again
        digit = jnp.zeros_like(found)  # the digits above 0 whose threshold reaches: a prefix
        for value in range(1, 2**digit_bits):
            above = keys >= (found | jnp.uint32(value << shift))[:, None]
            total = jnp.sum(above, axis=-1, dtype=jnp.int32) if weight is None else jnp.sum(
                jnp.where(above, weight, 0.0), axis=-1)
            digit += (total >= target).astype(jnp.uint32)
        found = found | digit << shift
    return found


def row_keys(seed, output_index, num_rows: int):
    """A key per (request, row): fixed by the request's seed and the index of the
    output token the row produces, so batch composition never changes a sample."""
    def keys_for(s, idx):
        base = jax.random.key(s)
        return jax.vmap(lambda j: jax.random.fold_in(base, idx + j))(jnp.arange(num_rows))

    return jax.vmap(keys_for)(seed, output_index)  # [B, R]


def _sample_rows(logits, sampling):
    """Per row, a sample of the filtered target distribution: the Gumbel-max draw under
    noise keyed by the request's seed and the row's output index."""
    b, r, v = logits.shape
    temperature, top_k, top_p, min_p, seed, output_index = sampling
    rep = lambda x: jnp.repeat(x, r)  # noqa: E731 per-request -> per-row
    filtered = filter_logits(
        logits.reshape(b * r, v), rep(temperature), rep(top_k), rep(top_p), rep(min_p)
    ).reshape(b, r, v)
    keys = row_keys(seed, output_index, r)
    gumbel = jax.vmap(jax.vmap(lambda key: jax.random.gumbel(key, (v,))))(keys)
    return jnp.argmax(filtered + gumbel, axis=-1)


def verify_and_sample(logits, drafts, num_drafts, batch):
    """logits [B, R, V] at the verify rows (R = k+1), drafts [B, k] proposed for rows
    1..k, num_drafts [B]. Returns (tokens [B, R], num_accepted [B]); the request's
    output is tokens[:num_accepted + 1].

    Row j's token is the target's own sample there (the argmax for greedy rows), and
    the draft checked at row j is accepted exactly when it equals that sample. For a
    point-mass draft d this is lossless speculative sampling: the sample is d with
    probability p(d), and otherwise a sample of p with d removed, renormalised. The
    token at an output index therefore does not depend on whether a draft was verified
    there: a seeded request emits the same tokens with or without speculation, and
    when preemption or batch composition changes how its tokens fall into steps."""
    greedy = batch.temperature == 0.0
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampling = (batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.seed, batch.output_index)
    # an all-greedy batch without logprobs or logits processing runs a greedy shape,
    # which leaves this out (step._verify); here the greedy rows take the argmax
    sampled = _sample_rows(logits, sampling)
    return accept_drafts(jnp.where(greedy[:, None], argmax, sampled.astype(jnp.int32)), drafts, num_drafts)


def accept_drafts(tokens, drafts, num_drafts):
    """tokens [B, R], the target's sample at each verify row, against drafts [B, R-1]
    and num_drafts [B]: (tokens, num_accepted [B]), the drafts accepted in a row from
    the first. A step compiled for an all-greedy batch passes the argmax alone here
    (sharding.argmax_vocab), and leaves the sampling branch out of the program."""
    b, r = tokens.shape
    # drafts padded to R: the draft checked at row j is drafts[j] (row j predicts it)
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), drafts.dtype)], axis=1)
    accept = (tokens == padded) & (jnp.arange(r)[None, :] < num_drafts[:, None])
    num_accepted = jnp.sum(jnp.cumprod(accept, axis=1), axis=1)
    return tokens.astype(jnp.int32), num_accepted.astype(jnp.int32)


# top_k_by_chunks' chunk for the top logprobs, from benchmarks/sampling.py on the H200
# (docs/benchmarks, 2026-12-04, the top 20 over 128256 tokens, us a call): 1 row 93 with
# chunks of 2048 against 154 for lax.top_k alone (and 169 with 512); 32 rows 242 with 512,
# 269 with 2048, 976 alone; 256 rows 1558 with 512, 1868 with 2048, 2311 alone.
TOP_K_MANY_ROWS = 32  # rows from which TOP_K_CHUNK is the faster
TOP_K_CHUNK_FEW_ROWS, TOP_K_CHUNK = 2048, 512


def chosen_logprobs(logits, tokens, num_top: int):
    """Log-probabilities (of the raw model distribution) of tokens [B, R], their ranks
    (1 + the number of logits strictly greater than the token's, as vLLM ranks a chosen
    token), and the top num_top alternatives per row (num_top: the most the engine serves,
    the same whether or not a request of the batch asked for them)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    chosen_logits = jnp.take_along_axis(logits, tokens[..., None], axis=-1)
    ranks = jnp.sum(logits > chosen_logits, axis=-1, dtype=jnp.int32) + 1
    if num_top == 0:
        return chosen, ranks, None, None
    rows = logp.size // logp.shape[-1]
    top_values, top_ids = top_k_by_chunks(logp, num_top, TOP_K_CHUNK_FEW_ROWS if rows < TOP_K_MANY_ROWS else TOP_K_CHUNK)
    return chosen, ranks, top_values, top_ids


def top_k_by_chunks(x, k: int, chunk: int):
    """lax.top_k(x, k) over the last axis, exactly (ties to the lower index), in two
    passes: the top k of each chunk of the axis, then of those candidates."""
    *lead, v = x.shape
    num_chunks = -(-v // chunk)
    padded = jnp.pad(x, [(0, 0)] * len(lead) + [(0, num_chunks * chunk - v)], constant_values=-jnp.inf)
    values, ids = jax.lax.top_k(padded.reshape(*lead, num_chunks, chunk), min(k, chunk))
    ids = ids + (jnp.arange(num_chunks) * chunk)[:, None]
    values, pick = jax.lax.top_k(values.reshape(*lead, -1), k)
    return values, jnp.take_along_axis(ids.reshape(*lead, -1), pick, axis=-1)
