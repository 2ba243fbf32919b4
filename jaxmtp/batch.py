"""The batch pytree the jitted step reads, and the host-side builder that pads a
schedule to a few fixed bucket shapes so nothing recompiles after warm-up."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp.cache import dropped_index
from jaxmtp.params import pytree_dataclass


@pytree_dataclass
class Batch:
    # rows: T flattened ragged tokens (padded)
    input_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    slot_mapping: jax.Array  # [T] int32; padding rows point past the cache (cache.dropped_index)
    # requests: B (padded; padding requests own no rows and have kv_len 0)
    query_start: jax.Array  # [B+1] int32
    kv_len: jax.Array  # [B] int32, KV length once this step's rows are written
    page_table: jax.Array  # [B, P] int32
    sample_index: jax.Array  # [B, k+1] int32 rows whose logits are read (verify rows or the last prefill row)
    num_drafts: jax.Array  # [B] int32 draft tokens among the request's rows
    has_output: jax.Array  # [B] bool: the rows reach the end of the known tokens
    # [B, M] int32: the first M tokens after a prefill chunk, 0 past the known tokens (M: MTP
    # modules the draft pass runs; module j reads the token j positions ahead)
    next_chunk_token: jax.Array
    temperature: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32, <= 0 disables
    top_p: jax.Array  # [B] float32
    min_p: jax.Array  # [B] float32
    seed: jax.Array  # [B] uint32
    output_index: jax.Array  # [B] int32 tokens generated so far (keys the sampler)
    num_logprobs: jax.Array  # [B] int32 top logprobs asked for (0: none)
    # [B] int32: the request's row in the previous step's carry, or -1. A carried
    # request was still in flight on the device when this batch was built: its input
    # ids are placeholders and its positions assume no draft was accepted; the step
    # fills both in from the carry (apply_carry).
    carry_index: jax.Array


# The batch crosses to the device as two flat buffers, ints and floats: one transfer
# instead of one per field (each costs host time every step). Field order below.
INT_FIELDS = (
    "input_ids", "positions", "slot_mapping", "query_start", "kv_len", "page_table", "sample_index",
    "num_drafts", "has_output", "next_chunk_token", "top_k", "seed", "output_index", "num_logprobs",
    "carry_index",
)
FLOAT_FIELDS = ("temperature", "top_p", "min_p")


def field_shapes(t: int, b: int, pages_per_seq: int, k: int, m: int) -> dict[str, tuple[int, ...]]:
    per_request = {
        "query_start": (b + 1,), "page_table": (b, pages_per_seq), "sample_index": (b, k + 1), "next_chunk_token": (b, m),
    }
    per_row = ("input_ids", "positions", "slot_mapping")
    return {f: per_request.get(f, (t,) if f in per_row else (b,)) for f in INT_FIELDS + FLOAT_FIELDS}


def row_owner(query_start: jax.Array, num_rows: int) -> jax.Array:
    """The request each of num_rows rows belongs to (padding rows: clamped to the last)."""
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    return jnp.minimum(jnp.searchsorted(query_start[1:], rows, side="right"), query_start.shape[0] - 2)


def slot_of(page_table: jax.Array, row_seq: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    return page_table[row_seq, positions // page_size] * page_size + positions % page_size


def apply_carry(batch: Batch, carry: jax.Array, page_size: int) -> Batch:
    """Device side: finish the rows of carried requests from the previous step's carry
    [S, 2 + k] = (drafts accepted, last emitted token, next drafts) per request.
    A carried request's rows are [last token] + drafts, shifted by the accepted count."""
    t, b = batch.input_ids.shape[0], batch.kv_len.shape[0]
    rows = jnp.arange(t, dtype=jnp.int32)
    row_seq = row_owner(batch.query_start, t)
    carried = batch.carry_index >= 0  # [B]
    entry = carry[jnp.maximum(batch.carry_index, 0)]  # [B, 2 + k]
    accepted = jnp.where(carried, entry[:, 0], 0)
    row_carried = carried[row_seq] & (rows < batch.query_start[b])
    offset = jnp.clip(rows - batch.query_start[row_seq], 0, carry.shape[1] - 2)
    positions = batch.positions + jnp.where(row_carried, accepted[row_seq], 0)
    slots = slot_of(batch.page_table, row_seq, positions, page_size)
    return dataclasses.replace(
        batch,
        input_ids=jnp.where(row_carried, entry[row_seq, 1 + offset], batch.input_ids),
        positions=positions,
        slot_mapping=jnp.where(row_carried, slots, batch.slot_mapping),
        kv_len=batch.kv_len + accepted,
        output_index=batch.output_index + jnp.where(carried, accepted + 1, 0),
    )


def with_rows_before(batch: Batch, extra: int, page_size: int, num_slots: int) -> Batch:
    """Device side: the batch's rows with up to `extra` rows before each request's first
    row (fewer near position 0), for a draft module that rewrites rows of earlier steps.
    T + B * extra rows (static); each request's extra rows come first, then its own, so
    they stay the last rows of its unchanged kv_len, as attention takes them. The extra
    rows' input ids belong to earlier steps and are not in the batch: 0. Padding rows'
    writes are dropped (num_slots: the cache's slots)."""
    t, b = batch.input_ids.shape[0], batch.kv_len.shape[0]
    lengths = batch.query_start[1:] - batch.query_start[:-1]
    first = batch.positions[jnp.minimum(batch.query_start[:-1], t - 1)]
    extras = jnp.where(lengths > 0, jnp.minimum(extra, first), 0)
    query_start = jnp.concatenate([batch.query_start[:1], batch.query_start[0] + jnp.cumsum(lengths + extras)])
    n = t + b * extra
    rows = jnp.arange(n, dtype=jnp.int32)
    row_seq = row_owner(query_start, n)
    valid = (rows >= query_start[0]) & (rows < query_start[b])
    offset = rows - query_start[row_seq] - extras[row_seq]  # < 0 on extra rows
    positions = jnp.where(valid, first[row_seq] + offset, 0)
    source = jnp.clip(batch.query_start[row_seq] + offset, 0, t - 1)
    return dataclasses.replace(
        batch,
        input_ids=jnp.where(valid & (offset >= 0), batch.input_ids[source], 0),
        positions=positions,
        slot_mapping=jnp.where(valid, slot_of(batch.page_table, row_seq, positions, page_size), dropped_index(num_slots, rows)),
        query_start=query_start.astype(jnp.int32),
        # a request's rows keep their distance from its end
        sample_index=batch.sample_index + (query_start[1:] - batch.query_start[1:])[:, None],
    )


def pack_batch(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    """Host side: the batch's fields as one int32 and one float32 buffer."""
    ints = np.concatenate([np.asarray(getattr(batch, f)).astype(np.uint32).view(np.int32).ravel()
                           if f == "seed" else np.asarray(getattr(batch, f), np.int32).ravel() for f in INT_FIELDS])
    floats = np.concatenate([np.asarray(getattr(batch, f), np.float32).ravel() for f in FLOAT_FIELDS])
    return ints, floats


def unpack_batch(ints: jax.Array, floats: jax.Array, shapes: tuple[int, int, int, int, int]) -> Batch:
    """Device side (inside the jitted step): the fields back from the two buffers.
    shapes = (T, B, pages per request, k, M), static."""
    sizes = field_shapes(*shapes)
    fields, offsets = {}, {"int": 0, "float": 0}
    for name, shape in sizes.items():
        kind, buffer = ("int", ints) if name in INT_FIELDS else ("float", floats)
        n = int(np.prod(shape))
        fields[name] = buffer[offsets[kind] : offsets[kind] + n].reshape(shape)
        offsets[kind] += n
    fields["has_output"] = fields["has_output"] != 0
    fields["seed"] = jax.lax.bitcast_convert_type(fields["seed"], jnp.uint32)
    return Batch(**fields)


@dataclasses.dataclass(frozen=True)
class BatchShape:
    num_tokens: int  # T
    num_seqs: int  # B
    # Every request greedy and none asking for top logprobs: the step is compiled without
    # the sampling and top-logprob branches. As lax.conds they cost a device-to-host read
    # of the predicate per step wherever XLA runs them from the host (the batch-1 step
    # on the H200 did), which stalls the launch queue.
    greedy: bool = True


def powers_of_two(lo: int, hi: int) -> list[int]:
    sizes, n = [], lo
    while n < hi:
        sizes.append(n)
        n *= 2
    return sizes + [hi]


class BucketPlan:
    """The fixed shapes the step is compiled for: tokens and requests, powers of two."""

    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int, min_tokens: int = 8):
        self.token_sizes = powers_of_two(min(min_tokens, max_num_batched_tokens), max_num_batched_tokens)
        self.seq_sizes = powers_of_two(1, max_num_seqs)

    def shape_for(self, num_tokens: int, num_seqs: int, greedy: bool = True) -> BatchShape:
        t = next(s for s in self.token_sizes if s >= num_tokens)
        b = next(s for s in self.seq_sizes if s >= num_seqs)
        return BatchShape(t, b, greedy)

    def all_shapes(self) -> list[BatchShape]:
        # every request owns at least one row, so B never exceeds T
        return [
            BatchShape(t, b, greedy)
            for t in self.token_sizes
            for b in self.seq_sizes
            if b <= t or b == self.seq_sizes[0]
            for greedy in (True, False)
        ]


def build_batch(
    scheduled, shape: BatchShape, max_pages_per_seq: int, page_size: int, num_slots: int, k: int, m: int = 1
) -> Batch:
    """Numpy arrays for one step; `scheduled` is a list of scheduler.ScheduledRows;
    num_slots: the cache's slots (padding rows write past them, dropped); m: MTP modules
    the draft pass runs (next_chunk_token's width)."""
    t, b = shape.num_tokens, shape.num_seqs
    input_ids = np.zeros(t, np.int32)
    positions = np.zeros(t, np.int32)
    slot_mapping = dropped_index(num_slots, np.arange(t, dtype=np.int32))  # padding rows: dropped
    query_start = np.zeros(b + 1, np.int32)
    kv_len = np.zeros(b, np.int32)
    page_table = np.zeros((b, max_pages_per_seq), np.int32)
    sample_index = np.zeros((b, k + 1), np.int32)
    num_drafts = np.zeros(b, np.int32)
    has_output = np.zeros(b, bool)
    next_chunk_token = np.zeros((b, m), np.int32)
    temperature = np.zeros(b, np.float32)
    top_k = np.zeros(b, np.int32)
    top_p = np.ones(b, np.float32)
    min_p = np.zeros(b, np.float32)
    seed = np.zeros(b, np.uint32)
    output_index = np.zeros(b, np.int32)
    num_logprobs = np.zeros(b, np.int32)
    carry_index = np.full(b, -1, np.int32)
    row = 0
    for i, item in enumerate(scheduled):
        seq, n = item.seq, len(item.token_ids)
        pos = np.arange(item.start, item.start + n)
        pages = np.asarray(seq.pages, np.int32)
        input_ids[row : row + n] = item.token_ids
        positions[row : row + n] = pos
        slot_mapping[row : row + n] = pages[pos // page_size] * page_size + pos % page_size
        page_table[i, : len(pages)] = pages
        kv_len[i] = item.start + n
        # verify rows 0..num_drafts; for a prefill chunk only its last row
        first_sampled = row + n - 1 - item.num_drafts
        sample_index[i] = np.minimum(first_sampled + np.arange(k + 1), row + n - 1)
        num_drafts[i] = item.num_drafts
        has_output[i] = item.has_output
        next_chunk_token[i] = (item.next_chunk_tokens + (0,) * m)[:m]
        params = seq.params
        temperature[i] = params.temperature
        top_k[i] = params.top_k
        top_p[i] = params.top_p
        min_p[i] = params.min_p
        seed[i] = seq.seed
        output_index[i] = len(seq.output_token_ids)
        num_logprobs[i] = params.logprobs or 0
        carry_index[i] = item.carry_index
        row += n
        query_start[i + 1] = row
    query_start[len(scheduled) + 1 :] = row
    return Batch(
        input_ids, positions, slot_mapping, query_start, kv_len, page_table, sample_index, num_drafts,
        has_output, next_chunk_token, temperature, top_k, top_p, min_p, seed, output_index, num_logprobs,
        carry_index,
    )
