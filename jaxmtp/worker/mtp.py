"""DeepSeek-V3-style MTP draft modules, and the draft pass that stays exact under chunked prefill.

Module j (1-based) at position i reads the previous module's output h^{j-1}_i (h^0: the
main model's hidden state) and the embedding of token i+j, writes its own KV entry at
position i and outputs h^j_i, whose logits predict token i+j+1. The draft pass runs
modules 1..M (M = min(k, modules in the checkpoint)) over the step's rows; module j's
first proposal d_j is its output at the request's boundary row (its last row with
valid main KV, at position P).

A row reads a token of this step's rows while it lies at or before P; past P it reads
what follows the boundary:

  - a mid-prefill request (rows short of the known tokens): the next prompt tokens,
    which the scheduler puts in batch.next_chunk_token [B, M];
  - a request whose rows reach the end of the known tokens (has_output): the token the
    main model just sampled or verified, then the drafts d_1, d_2, ... of this step.

    boundary = jnp.where(has_output, sampled, next_chunk_token[:, 0])

A row that read a draft is provisional: the next step recomputes it with the true
token. So module j also runs over up to j-1 rows before the request's first row
(batch.with_rows_before), first-(j-1)..first-1; row first-j read token `first`, the
step before's boundary token, and stays. Module j reads h^{j-1} at its rows from the
hidden pages (jaxmtp/worker/cache.py), where module j-1 wrote it, this step or an earlier one.

Drafts past M (k > M) chain module M one position further each time, on its own output
hidden state and its previous draft; those rows are rewritten by the next step.

`mtp_boundary="sampled"` reproduces the pre-fix behaviour (the sampled token, then the
drafts, after every request's boundary) for ablations; nothing else differs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxmtp.models.config import MTP_LAYOUTS, ModelConfig
from jaxmtp.models.model import LayerOps, decoder_layer, logits, rms_norm
from jaxmtp.models.params import MTPParams, Params
from jaxmtp.worker.batch import Batch, row_owner, slot_of, with_rows_before
from jaxmtp.worker.cache import KVCache, dropped_index, read_hidden, write_slots
from jaxmtp.worker.sharding import argmax_vocab


def module_forward(
    module: MTPParams,
    embed: jax.Array,
    cfg: ModelConfig,
    prev_hidden: jax.Array,
    next_ids: jax.Array,
    batch: Batch,
    k_pages: jax.Array,
    v_pages: jax.Array,
    ops: LayerOps,
):
    """x = proj(concat(norm(embed(t_{i+1})), norm(h_i))), then one decoder block.
    Returns the block's output (before the module's final norm) and its K/V pages."""
    e = rms_norm(embed[next_ids], module.token_norm, cfg.rms_norm_eps)
    h = rms_norm(prev_hidden, module.hidden_norm, cfg.rms_norm_eps)
    x = e @ module.proj_token + h @ module.proj_hidden
    return decoder_layer(module.block, cfg, x, batch, k_pages, v_pages, ops)


def module_logits(params: Params, module: MTPParams, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    head = params.head() if module.lm_head is None else module.lm_head
    return logits(head, module.final_norm, cfg, x)


def main_hidden_for_mtp(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    if MTP_LAYOUTS[cfg.mtp_layout].hidden_after_final_norm:
        return rms_norm(hidden, params.final_norm, cfg.rms_norm_eps)
    return hidden


def tokens_ahead(rows: Batch, ahead: int, last: jax.Array, beyond: jax.Array) -> jax.Array:
    """The token `ahead` positions after each row: the input id of a later row of its
    request while that lies at or before the request's boundary position `last` [B];
    past it, beyond[b, ahead - (last - position) - 1]. Rows past the boundary (rejected
    verify rows) clip the index: their KV lies behind the next step's kv_len."""
    n = rows.input_ids.shape[0]
    row_seq = row_owner(rows.query_start, n)
    target = rows.positions + ahead
    later_row = rows.input_ids[jnp.minimum(jnp.arange(n) + ahead, n - 1)]
    after = beyond[row_seq, jnp.clip(target - last[row_seq] - 1, 0, ahead - 1)]
    return jnp.where(target <= last[row_seq], later_row, after)


def propose(
    params: Params,
    cfg: ModelConfig,
    hidden: jax.Array,
    batch: Batch,
    tokens: jax.Array,
    num_accepted: jax.Array,
    cache: KVCache,
    ops: LayerOps,
    num_drafts: int,
    boundary_mode: str,
    mesh: Mesh | None,
) -> tuple[jax.Array, KVCache, jax.Array]:
    """The draft pass: modules 1..M over the rows, then num_drafts - M chained steps of
    module M.

    hidden: main model output [T, H]; tokens/num_accepted: what verification emitted;
    cache: the whole cache or its draft part (KVCache.draft_part), whose last m layers
    are the modules' (m = min(num_drafts, modules in params));
    mesh: the tensor-parallel mesh, over which each draft's argmax runs on the
    vocab-sharded logits without gathering them (sharding.argmax_vocab).
    Returns drafts [B, num_drafts], the cache with draft KV (and hidden pages) written,
    and the boundary tokens [B] the draft pass used (for tests and ablations)."""
    b = batch.kv_len.shape[0]
    m = min(num_drafts, len(params.mtp))
    active = batch.query_start[1:] > batch.query_start[:-1]
    seq_idx = jnp.arange(b)

    # the boundary row: the last row whose main-model KV is valid after this step
    boundary_row = batch.sample_index[seq_idx, num_accepted]
    last = batch.positions[boundary_row]
    sampled = tokens[seq_idx, num_accepted]
    # Requests whose tokens after the boundary are the sampled one, then this step's
    # drafts (filled in below as each module makes its own); the others read prompt tokens.
    reads_drafts = batch.has_output if boundary_mode == "next_chunk" else jnp.ones_like(batch.has_output)
    beyond = batch.next_chunk_token.at[:, 0].set(jnp.where(reads_drafts, sampled, batch.next_chunk_token[:, 0]))

    prev = main_hidden_for_mtp(params, cfg, hidden)
    k_layers, v_layers, hidden_pages = list(cache.k), list(cache.v), list(cache.hidden)
    drafts = []
    for j in range(1, m + 1):
        # its cache layer: the modules' layers come last, after the main model's when the
        # cache holds those (a masked step's finish takes the draft part alone)
        module, layer = params.mtp[j - 1], len(k_layers) - m + j - 1
        if j == 1:
            rows = batch
        else:
            rows = with_rows_before(batch, j - 1, cache.page_size, cache.num_slots)
            prev = read_hidden(hidden_pages[j - 2], rows.slot_mapping)
        with jax.named_scope("draft_layer"):
            x, k_layers[layer], v_layers[layer] = module_forward(
                module, params.embed, cfg, prev, tokens_ahead(rows, j, last, beyond), rows,
                k_layers[layer], v_layers[layer], ops,
            )
        if j < m:
            hidden_pages[j - 1] = write_slots(hidden_pages[j - 1], rows.slot_mapping, x)
        x = x[rows.sample_index[seq_idx, num_accepted]]  # [B, H] at the boundary rows
        with jax.named_scope("draft_head"):
            draft = argmax_vocab(module_logits(params, module, cfg, x), mesh)
        drafts.append(draft)
        if j < m:
            beyond = beyond.at[:, j].set(jnp.where(reads_drafts, draft, beyond[:, j]))

    # Chained steps reuse module M (module, layer, x and draft are its own from the last
    # pass above) on one row per request, at the next position, feeding its own output
    # hidden state (after its final norm where MTPLayout.chain_after_module_norm) and
    # its own argmax token.
    proposing = active & batch.has_output
    page_size = cache.page_size
    position = last
    chain_normed = MTP_LAYOUTS[cfg.mtp_layout].chain_after_module_norm
    for _ in range(m, num_drafts):
        if chain_normed:
            x = rms_norm(x, module.final_norm, cfg.rms_norm_eps)
        position = position + 1
        chain = dataclasses.replace(
            batch,
            input_ids=draft,
            positions=position,
            slot_mapping=jnp.where(
                proposing, slot_of(batch.page_table, seq_idx, position, page_size), dropped_index(cache.num_slots, seq_idx)
            ),
            query_start=jnp.arange(b + 1, dtype=jnp.int32),
            # idle requests still own their one row; kv_len 1 keeps it a valid
            # (ignored) attention row for the kernel, and its KV write is dropped
            kv_len=jnp.where(proposing, position + 1, 1),
        )
        with jax.named_scope("draft_layer"):
            x, k_layers[layer], v_layers[layer] = module_forward(
                module, params.embed, cfg, x, draft, chain, k_layers[layer], v_layers[layer], ops
            )
        with jax.named_scope("draft_head"):
            draft = argmax_vocab(module_logits(params, module, cfg, x), mesh)
        drafts.append(draft)
    cache = KVCache(k=k_layers, v=v_layers, hidden=hidden_pages)
    return jnp.stack(drafts, axis=1), cache, beyond[:, 0]
