"""DeepSeek-V3-style MTP draft module, and the draft pass that stays exact under chunked prefill.

An MTP module at position i reads the main model's hidden state h_i and the embedding of
token i+1, writes its own KV entry at position i and predicts token i+2. Inside one step
the draft pass runs over every row of the batch with the ids shifted left by one within
each request. The last valid row of a request (the boundary row) has no following row:

  - when the rows reach the end of the known tokens (has_output), token i+1 is the one
    the main model just sampled or verified;
  - otherwise the request is mid-prefill and token i+1 is the FIRST TOKEN OF THE NEXT
    CHUNK, a known prompt token the scheduler puts in batch.next_chunk_token.

    boundary = jnp.where(has_output, sampled, next_chunk_token)

`mtp_boundary="sampled"` reproduces the pre-fix behaviour (the sampled token everywhere)
for ablations; nothing else differs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxmtp.attention import AttentionFn
from jaxmtp.batch import Batch
from jaxmtp.cache import KVCache
from jaxmtp.config import MTP_LAYOUTS, ModelConfig
from jaxmtp.model import decoder_layer, logits, rms_norm
from jaxmtp.params import MTPParams, Params

BOUNDARY_MODES = ("next_chunk", "sampled")


def module_forward(
    module: MTPParams,
    embed: jax.Array,
    cfg: ModelConfig,
    prev_hidden: jax.Array,
    next_ids: jax.Array,
    batch: Batch,
    k_pages: jax.Array,
    v_pages: jax.Array,
    attention: AttentionFn,
):
    """x = proj(concat(norm(embed(t_{i+1})), norm(h_i))), then one decoder block.
    Returns the block's output (before the module's final norm) and its K/V pages."""
    e = rms_norm(embed[next_ids], module.token_norm, cfg.rms_norm_eps)
    h = rms_norm(prev_hidden, module.hidden_norm, cfg.rms_norm_eps)
    x = e @ module.proj_token + h @ module.proj_hidden
    return decoder_layer(module.block, cfg, x, batch, k_pages, v_pages, attention)


def module_logits(params: Params, module: MTPParams, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    head = params.head() if module.lm_head is None else module.lm_head
    return logits(head, module.final_norm, cfg, x)


def main_hidden_for_mtp(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    if MTP_LAYOUTS[cfg.mtp_layout].hidden_after_final_norm:
        return rms_norm(hidden, params.final_norm, cfg.rms_norm_eps)
    return hidden


def propose(
    params: Params,
    cfg: ModelConfig,
    hidden: jax.Array,
    batch: Batch,
    tokens: jax.Array,
    num_accepted: jax.Array,
    cache: KVCache,
    attention: AttentionFn,
    num_drafts: int,
    boundary_mode: str,
) -> tuple[jax.Array, KVCache, jax.Array]:
    """Draft pass over all rows, then num_drafts-1 chained steps of the module.

    hidden: main model output [T, H]; tokens/num_accepted: what verification emitted.
    Returns drafts [B, num_drafts], the cache with draft KV written, and the boundary
    tokens [B] the draft pass used (for tests and ablations)."""
    t = hidden.shape[0]
    b = batch.kv_len.shape[0]
    module = params.mtp[0]
    layer = cfg.num_layers  # the module's cache layer, after the main model's
    active = batch.query_start[1:] > batch.query_start[:-1]
    seq_idx = jnp.arange(b)

    # the boundary row: the last row whose main-model KV is valid after this step
    boundary_row = batch.sample_index[seq_idx, num_accepted]
    sampled = tokens[seq_idx, num_accepted]
    if boundary_mode == "next_chunk":
        boundary_token = jnp.where(batch.has_output, sampled, batch.next_chunk_token)
    else:
        boundary_token = sampled
    next_ids = jnp.concatenate([batch.input_ids[1:], batch.input_ids[:1]])
    next_ids = next_ids.at[jnp.where(active, boundary_row, t)].set(boundary_token, mode="drop")

    prev = main_hidden_for_mtp(params, cfg, hidden)
    k_layers, v_layers = list(cache.k), list(cache.v)
    x, k_layers[layer], v_layers[layer] = module_forward(
        module, params.embed, cfg, prev, next_ids, batch, k_layers[layer], v_layers[layer], attention
    )
    x = x[boundary_row]  # [B, H]
    draft = jnp.argmax(module_logits(params, module, cfg, x), axis=-1).astype(jnp.int32)
    drafts = [draft]

    # Chained steps reuse the module on one row per request, at the next position,
    # feeding its own output hidden state and its own argmax token.
    proposing = active & batch.has_output
    page_size = cache.page_size
    position = batch.positions[boundary_row]
    for _ in range(1, num_drafts):
        position = position + 1
        page = batch.page_table[seq_idx, position // page_size]
        chain = dataclasses.replace(
            batch,
            input_ids=draft,
            positions=position,
            slot_mapping=jnp.where(proposing, page * page_size + position % page_size, cache.scratch_slot),
            query_start=jnp.arange(b + 1, dtype=jnp.int32),
            # idle requests still own their one row; kv_len 1 keeps it a valid
            # (ignored) attention row for the kernel, and its KV goes to the scratch page
            kv_len=jnp.where(proposing, position + 1, 1),
        )
        x, k_layers[layer], v_layers[layer] = module_forward(
            module, params.embed, cfg, x, draft, chain, k_layers[layer], v_layers[layer], attention
        )
        draft = jnp.argmax(module_logits(params, module, cfg, x), axis=-1).astype(jnp.int32)
        drafts.append(draft)
    return jnp.stack(drafts, axis=1), KVCache(k=k_layers, v=v_layers), boundary_token
