"""Logits processing inside the step: allowed_token_ids, bad_words, min_tokens,
logit_bias, then the repetition, frequency and presence penalties, in vLLM's order.

What the processors read across steps lives on the device, in a LogitsState row per
running request (its state slot, kept by the scheduler): the generated tokens' counts,
which tokens are in the prompt or end the request, the static bias, the last generated
tokens and the bad words' token sequences. The host writes a row once, when a request
that asks for processing is admitted (again after a preemption); every step then adds
the tokens it emits, so under async scheduling a carried request's state is current
although the host has not read its last step.

Verify rows see exactly what plain decoding would: row j of a request samples after
its output so far plus the drafts of rows 0..j-1, so its counts, its bad-word history
and its output index (min_tokens) include those drafts. A row's distribution is then
the one plain decoding has at that output index, and the sampler's keyed draw
(jaxmtp/worker/sampling.py) makes speculation change nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp.engine.sampling_params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS
from jaxmtp.models.params import pytree_dataclass

IN_PROMPT, ENDS_REQUEST = 1, 2  # token_flags bits
NO_TOKEN = -1  # recent_tokens before the first output token; matches no prefix
ANY_TOKEN = -2  # bad_prefix left of a shorter word's prefix: matches every token


@pytree_dataclass
class LogitsState:
    """One row per state slot (S: max_num_seqs), V the vocabulary, L = MAX_BAD_WORD_TOKENS."""

    output_counts: jax.Array  # [S, V] int32: how often each token was generated
    token_flags: jax.Array  # [S, V] int8: IN_PROMPT | ENDS_REQUEST (EOS and stop_token_ids)
    bias: jax.Array  # [S, V] float32: logit_bias, -inf outside allowed_token_ids
    recent_tokens: jax.Array  # [S, L-1] int32: the last generated tokens, oldest first
    bad_prefix: jax.Array  # [S, W, L-1] int32: each bad word but its last token, right-aligned
    bad_last: jax.Array  # [S, W] int32: each bad word's last token (V: no word)


def state_row_shapes(vocab_size: int) -> dict[str, tuple[tuple[int, ...], type]]:
    """Shape and dtype of one slot's row of each LogitsState field."""
    tail = MAX_BAD_WORD_TOKENS - 1
    return {
        "output_counts": ((vocab_size,), np.int32),
        "token_flags": ((vocab_size,), np.int8),
        "bias": ((vocab_size,), np.float32),
        "recent_tokens": ((tail,), np.int32),
        "bad_prefix": ((MAX_BAD_WORDS, tail), np.int32),
        "bad_last": ((MAX_BAD_WORDS,), np.int32),
    }


def zero_state(num_slots: int, vocab_size: int) -> LogitsState:
    return LogitsState(**{
        name: np.zeros((num_slots,) + shape, dtype) for name, (shape, dtype) in state_row_shapes(vocab_size).items()
    })


def padded_state_rows(seqs, vocab_size: int, num_slots: int) -> tuple[np.ndarray | None, dict[str, np.ndarray] | None]:
    """The slots [N] and LogitsState rows of sequences that ask for logits processing and
    were admitted since their last step, N padded to a power of two (few compiled shapes;
    padding slots past the last of num_slots)."""
    if not seqs:
        return None, None
    size = 1 << (len(seqs) - 1).bit_length()
    rows = {name: np.concatenate([row, np.zeros((size - len(seqs),) + row.shape[1:], row.dtype)])
            for name, row in state_rows(seqs, vocab_size).items()}
    slots = np.full(size, num_slots, np.int32)
    slots[: len(seqs)] = [seq.state_slot for seq in seqs]
    return slots, rows


def state_rows(seqs, vocab_size: int) -> dict[str, np.ndarray]:
    """Host side: the LogitsState rows of newly admitted sequences, from their prompt,
    output so far (a preempted request's) and SamplingParams; O(V) per sequence."""
    n, tail = len(seqs), MAX_BAD_WORD_TOKENS - 1
    rows = {name: np.zeros((n,) + shape, dtype) for name, (shape, dtype) in state_row_shapes(vocab_size).items()}
    rows["recent_tokens"][:] = NO_TOKEN
    rows["bad_prefix"][:] = ANY_TOKEN
    rows["bad_last"][:] = vocab_size
    for i, seq in enumerate(seqs):
        params, output = seq.params, seq.output_token_ids
        rows["output_counts"][i] = np.bincount(output, minlength=vocab_size)[:vocab_size]
        rows["token_flags"][i, seq.prompt_token_ids] |= IN_PROMPT
        rows["token_flags"][i, sorted(seq.stop_token_ids)] |= ENDS_REQUEST
        if params.allowed_token_ids is not None:
            rows["bias"][i] = -np.inf
            rows["bias"][i, params.allowed_token_ids] = 0.0
        for token, value in (params.logit_bias or {}).items():
            rows["bias"][i, token] += value
        recent = output[-tail:]
        if recent:
            rows["recent_tokens"][i, tail - len(recent) :] = recent
        for w, word in enumerate(seq.bad_words_ids):
            if len(word) > 1:
                rows["bad_prefix"][i, w, tail - (len(word) - 1) :] = word[:-1]
            rows["bad_last"][i, w] = word[-1]
    return rows


def _write_rows(state: LogitsState, slots: jax.Array, rows: dict) -> LogitsState:
    # padding entries carry slot S (past the rows): their writes are dropped
    return LogitsState(**{
        name: getattr(state, name).at[slots].set(rows[name], mode="drop", unique_indices=True)
        for name in state_row_shapes(1)
    })


write_rows = jax.jit(_write_rows, donate_argnums=0)


def _penalized(x, count, seen, repetition, frequency, presence):
    """The penalties on logits x of tokens generated `count` times (seen: in the prompt
    or generated); per-request params broadcast against x."""
    x = jnp.where(seen, jnp.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * count - presence * (count > 0)


def process_logits(logits, state: LogitsState, batch, drafts) -> jax.Array:
    """logits [B, R, V] of the verify rows; drafts [B, R-1], the draft checked at row j
    is drafts[:, j] (so rows after j sample after it). Rows of requests without a state
    slot come back unchanged."""
    b, r, v = logits.shape
    active = batch.state_slot >= 0
    slot = jnp.where(active, batch.state_slot, 0)
    flags = state.token_flags[slot]  # [B, V]
    x = logits + state.bias[slot][:, None, :]

    # bad words: a word's last token is banned at row j when the tokens before it end
    # with the rest of the word (generated tokens, then the drafts before row j)
    tail = state.recent_tokens.shape[1]
    history = jnp.concatenate([state.recent_tokens[slot], drafts], axis=1)  # [B, L-1 + R-1]
    window = jax.vmap(lambda j: jax.lax.dynamic_slice_in_dim(history, j, tail, axis=1), out_axes=1)(jnp.arange(r))
    prefix = state.bad_prefix[slot]  # [B, W, L-1]
    matched = jnp.all((prefix[:, None] == window[:, :, None]) | (prefix[:, None] == ANY_TOKEN), axis=-1)  # [B, R, W]
    banned = jnp.where(matched, state.bad_last[slot][:, None, :], v)
    rows = jnp.broadcast_to(jnp.arange(r)[None, :, None], banned.shape)
    requests = jnp.broadcast_to(jnp.arange(b)[:, None, None], banned.shape)
    x = x.at[requests, rows, banned].set(-jnp.inf, mode="drop")

    # min_tokens: row j samples output token output_index + j
    early = batch.output_index[:, None] + jnp.arange(r) < batch.min_tokens[:, None]  # [B, R]
    x = jnp.where(early[:, :, None] & ((flags & ENDS_REQUEST) != 0)[:, None, :], -jnp.inf, x)

    # penalties: with the counts before this step over the whole vocabulary, then, at
    # row j, again for each token drafted before it, with the drafts counted
    params = [p[:, None, None] for p in (batch.repetition_penalty, batch.frequency_penalty, batch.presence_penalty)]
    counts = state.output_counts[slot]  # [B, V]
    in_prompt = (flags & IN_PROMPT) != 0
    before = x
    x = _penalized(x, counts[:, None, :], in_prompt[:, None, :] | (counts[:, None, :] > 0), *params)
    if r > 1:
        earlier = jnp.arange(r)[None, :] > jnp.arange(r - 1)[:, None]  # [R-1 drafts, R rows]: drafted before the row
        token = jnp.broadcast_to(drafts[:, :, None], (b, r - 1, r))  # [B, i, j]: draft i, seen from row j
        drafted = jnp.sum((drafts[:, None, :, None] == drafts[:, :, None, None]) & earlier[None, None, :, :], axis=2)
        count = jnp.take_along_axis(counts, drafts, axis=1)[:, :, None] + drafted  # [B, i, j]
        seen = jnp.take_along_axis(in_prompt, drafts, axis=1)[:, :, None] | (count > 0)
        rows = jnp.broadcast_to(jnp.arange(r)[None, None, :], token.shape)
        requests = jnp.broadcast_to(jnp.arange(b)[:, None, None], token.shape)
        value = _penalized(before[requests, rows, token], count, seen, *params)
        x = x.at[requests, rows, jnp.where(earlier[None], token, v)].set(value, mode="drop")
    return jnp.where(active[:, None, None], x, logits)


def record_emitted(state: LogitsState, batch, tokens, num_accepted) -> LogitsState:
    """The state after a step: each emitting request's tokens[:num_accepted + 1] counted
    and appended to its recent tokens."""
    b, r = tokens.shape
    num_slots = state.bias.shape[0]
    emits = (batch.state_slot >= 0) & batch.has_output
    slot = jnp.where(emits, batch.state_slot, num_slots)  # not emitting: dropped
    emitted = jnp.arange(r)[None, :] <= num_accepted[:, None]
    counts = state.output_counts.at[jnp.broadcast_to(slot[:, None], tokens.shape), tokens].add(
        emitted.astype(jnp.int32), mode="drop"
    )
    tail = state.recent_tokens.shape[1]
    history = jnp.concatenate([state.recent_tokens[jnp.minimum(slot, num_slots - 1)], tokens], axis=1)
    recent = jax.vmap(lambda h, n: jax.lax.dynamic_slice_in_dim(h, n, tail))(history, num_accepted + 1)
    recent_tokens = state.recent_tokens.at[slot].set(recent, mode="drop")
    return LogitsState(counts, state.token_flags, state.bias, recent_tokens, state.bad_prefix, state.bad_last)
