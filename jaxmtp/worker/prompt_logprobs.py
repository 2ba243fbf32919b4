"""Prompt logprobs on the device: every row's log-probability of the token after it (the
next row's input, or for a chunk's last row the first token of the next chunk), with
the top alternatives, computed in blocks of rows so that the full [T, V] logits never
live at once. Only steps compiled with BatchShape.prompt_logprobs run this; the host
keeps the rows of requests that asked for them (their prompt positions)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmtp.models import model
from jaxmtp.models.params import pytree_dataclass
from jaxmtp.worker.batch import row_owner
from jaxmtp.worker.sampling import chosen_logprobs
from jaxmtp.worker.sharding import gather_vocab

ROWS_PER_BLOCK = 256


@pytree_dataclass
class PromptLogprobs:
    logprobs: jax.Array  # [T] of the token after each row
    ranks: jax.Array  # [T] its rank: 1 + the tokens with a higher logprob
    top_logprobs: jax.Array  # [T, n]
    top_token_ids: jax.Array  # [T, n]


def next_tokens(batch) -> jax.Array:
    """The token after each row: the next row's input id within the request's rows,
    else the first token of its next chunk (0 past the known tokens)."""
    t = batch.input_ids.shape[0]
    owner = row_owner(batch.query_start, t)
    rows = jnp.arange(t)
    within = rows + 1 < batch.query_start[owner + 1]
    return jnp.where(within, batch.input_ids[jnp.minimum(rows + 1, t - 1)], batch.next_chunk_token[owner, 0])


def prompt_logprobs(params, cfg, hidden, batch, num_top: int, mesh) -> PromptLogprobs:
    t = hidden.shape[0]
    block = min(t, ROWS_PER_BLOCK)
    targets = next_tokens(batch)
    head, norm = params.head(), params.final_norm

    def one_block(args):
        rows, target = args
        logits = model.logits(head, norm, cfg, rows)
        if mesh is not None:
            logits = gather_vocab(logits, mesh)
        # every row of the block is scored: the top alternatives are always asked for
        chosen, rank, top_values, top_ids = chosen_logprobs(logits, target, num_top)
        if not num_top:
            top_values, top_ids = jnp.zeros((block, 0), chosen.dtype), jnp.zeros((block, 0), jnp.int32)
        return chosen, rank, top_values, top_ids

    blocks = (hidden.reshape(t // block, block, -1), targets.reshape(t // block, block))
    chosen, rank, top_values, top_ids = jax.lax.map(one_block, blocks)
    n = top_values.shape[-1]
    return PromptLogprobs(chosen.reshape(t), rank.reshape(t), top_values.reshape(t, n), top_ids.reshape(t, n).astype(jnp.int32))
