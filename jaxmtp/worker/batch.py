"""The batch pytree the jitted step reads, and the host-side builder that pads a
schedule to a few fixed bucket shapes so nothing recompiles after warm-up."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp.kernels.reference import row_ownership
from jaxmtp.models.params import pytree_dataclass
from jaxmtp.worker.cache import dropped_index


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
    # logits processing (jaxmtp/worker/logits_processors.py): the request's LogitsState row, or -1
    # for a request that asks for none
    state_slot: jax.Array  # [B] int32
    min_tokens: jax.Array  # [B] int32
    repetition_penalty: jax.Array  # [B] float32
    frequency_penalty: jax.Array  # [B] float32
    presence_penalty: jax.Array  # [B] float32
    # [B] int32: the request's row in the previous step's carry, or -1. A carried
    # request was still in flight on the device when this batch was built: its input
    # ids are placeholders and its positions assume no draft was accepted; the step
    # fills both in from the carry (apply_carry).
    carry_index: jax.Array
    # [B] int32: the request's slot in a hybrid model's recurrent state tables
    # (jaxmtp/worker/recurrent.py; Sequence.state_slot); other models ignore it
    recurrent_slot: jax.Array


# The batch crosses to the device as two flat buffers, ints and floats: one transfer
# instead of one per field (each costs host time every step). Field order below.
INT_FIELDS = (
    "input_ids", "positions", "slot_mapping", "query_start", "kv_len", "page_table", "sample_index",
    "num_drafts", "has_output", "next_chunk_token", "top_k", "seed", "output_index",
    "state_slot", "min_tokens", "carry_index", "recurrent_slot",
)
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


def lookahead_width(num_draft_modules: int) -> int:
    """next_chunk_token's width: the M tokens the draft modules read, and at least the
    one prompt logprobs score a chunk's last row with."""
    return max(num_draft_modules, 1)


def mask_words(vocab_size: int) -> int:
    """W: int32 words of a token bitmask."""
    return (vocab_size + 31) // 32


def field_shapes(t: int, b: int, pages_per_seq: int, k: int, m: int) -> dict[str, tuple[int, ...]]:
    per_request = {
        "query_start": (b + 1,), "page_table": (b, pages_per_seq), "sample_index": (b, k + 1), "next_chunk_token": (b, m),
    }
    per_row = ("input_ids", "positions", "slot_mapping")
    return {f: per_request.get(f, (t,) if f in per_row else (b,)) for f in INT_FIELDS + FLOAT_FIELDS}


def unprocessed(num_seqs: int) -> dict[str, np.ndarray]:
    """The per-request state fields of requests that use none (no logits processing, no
    penalties; recurrent slot 0, which only a hybrid model reads), for batches built by
    hand (training, benchmarks)."""
    return dict(recurrent_slot=np.zeros(num_seqs, np.int32),
        state_slot=np.full(num_seqs, -1, np.int32), min_tokens=np.zeros(num_seqs, np.int32),
        repetition_penalty=np.ones(num_seqs, np.float32), frequency_penalty=np.zeros(num_seqs, np.float32),
        presence_penalty=np.zeros(num_seqs, np.float32),
    )


def row_owner(query_start: jax.Array, num_rows: int) -> jax.Array:
    """The request each of num_rows rows belongs to (padding rows: clamped to the last)."""
    return row_ownership(query_start, num_rows)[0]


def slot_of(page_table: jax.Array, row_seq: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    return page_table[row_seq, positions // page_size] * page_size + positions % page_size


@pytree_dataclass
class Carry:
    """What a step leaves for the next one's carried requests, per request row of the
    step (S rows: the largest request bucket)."""

    num_accepted: jax.Array  # [S] drafts accepted
    last_token: jax.Array  # [S] the last token emitted
    drafts: jax.Array  # [S, k] the next drafts to verify

    @classmethod
    def zeros(cls, num_rows: int, k: int) -> Carry:
        return cls(np.zeros(num_rows, np.int32), np.zeros(num_rows, np.int32), np.zeros((num_rows, k), np.int32))


def apply_carry(batch: Batch, carry: Carry, page_size: int) -> Batch:
    """Device side: finish the rows of carried requests from the previous step's carry.
    A carried request's rows are [last token] + drafts, shifted by the accepted count."""
    t, b = batch.input_ids.shape[0], batch.kv_len.shape[0]
    rows = jnp.arange(t, dtype=jnp.int32)
    row_seq = row_owner(batch.query_start, t)
    carried = batch.carry_index >= 0  # [B]
    source = jnp.maximum(batch.carry_index, 0)
    accepted = jnp.where(carried, carry.num_accepted[source], 0)
    carried_ids = jnp.concatenate([carry.last_token[source][:, None], carry.drafts[source]], axis=1)  # [B, 1 + k]
    row_carried = carried[row_seq] & (rows < batch.query_start[b])
    offset = jnp.clip(rows - batch.query_start[row_seq], 0, carried_ids.shape[1] - 1)
    positions = batch.positions + jnp.where(row_carried, accepted[row_seq], 0)
    slots = slot_of(batch.page_table, row_seq, positions, page_size)
    return dataclasses.replace(
        batch,
        input_ids=jnp.where(row_carried, carried_ids[row_seq, offset], batch.input_ids),
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


def unpack_batch(ints: jax.Array, floats: jax.Array, shape: BatchShape, k: int, m: int) -> Batch:
    """Device side (inside the jitted step): the fields back from the two buffers, for a
    batch of this (static) shape; k drafts, M MTP modules drafting."""
    sizes = field_shapes(shape.num_tokens, shape.num_seqs, shape.pages_per_seq, k, m)
    fields, offsets = {}, {"int": 0, "float": 0}
    for name, field_shape in sizes.items():
        kind, buffer = ("int", ints) if name in INT_FIELDS else ("float", floats)
        n = int(np.prod(field_shape))
        fields[name] = buffer[offsets[kind] : offsets[kind] + n].reshape(field_shape)
        offsets[kind] += n
    fields["has_output"] = fields["has_output"] != 0
    fields["seed"] = jax.lax.bitcast_convert_type(fields["seed"], jnp.uint32)
    return Batch(**fields)


@dataclasses.dataclass(frozen=True)
class BatchShape:
    num_tokens: int  # T
    num_seqs: int  # B
    # Every request greedy, none asking for top logprobs or logits processing: the step is
    # compiled without sampling, top logprobs and logits processing (a masked step's greedy
    # program masks the logits before the argmax). A general shape runs them all, without
    # a branch: XLA:GPU runs a lax.cond from the host, reading its predicate back each
    # step, which stalls the launch queue.
    greedy: bool = True
    # P: the page table's width, a bucket of the longest scheduled request's pages (the
    # attention kernel's KV range and split count follow it); None: the widest
    pages_per_seq: int | None = None
    # some request asks for prompt logprobs: every row's logits are computed
    # (jaxmtp/worker/prompt_logprobs.py); compiled on first use
    prompt_logprobs: bool = False
    # some request is constrained (structured outputs): the step runs as two programs,
    # the second taking the verify rows' token bitmasks (jaxmtp/worker/step.py)
    masked: bool = False
    # every request's rows this step are decode rows (at most k + 1: decode and verify):
    # an MLA layer runs its decode call alone (models.mla.mla_attention_fn), the experts
    # take their tiling from the requests' rows, not the padding (models.moe.moe_ffn's
    # max_rows). Only models with MLA or MoE layers get such shapes (BucketPlan.decode_rows)
    decode_only: bool = False

    def holds(self, other: BatchShape) -> bool:
        """Whether a batch padded to `other` fits this shape too (full shapes): as many
        rows, requests and table columns or more, and sampling compiled if it needs it.
        Padding rows and requests touch no real one's values (a differently shaped
        program may round differently, as when batch composition changes the bucket)."""
        return (self.num_tokens >= other.num_tokens and self.num_seqs >= other.num_seqs
                and self.pages_per_seq >= other.pages_per_seq and (other.greedy or not self.greedy)
                and (other.decode_only or not self.decode_only)
                # the programs differ with these (a masked step is two) or the outputs do (prompt logprobs)
                and self.masked == other.masked and self.prompt_logprobs == other.prompt_logprobs)


# The kinds of step besides the plain one, as (masked, prompt_logprobs): a step of one
# kind runs only on a program of that kind (BatchShape.holds)
OTHER_KINDS = ((True, False), (False, True), (True, True))


def powers_of_two(lo: int, hi: int) -> list[int]:
    sizes, n = [], lo
    while n < hi:
        sizes.append(n)
        n *= 2
    return sizes + [hi]


# Page-table widths grow by this factor from MIN_TABLE_WIDTH pages up to the widest: a
# 128k-token context gets a few widths, so a step of short requests sends and reads a
# short table, while a model of short contexts keeps one width (no extra shapes).
TABLE_WIDTH_FACTOR = 4
MIN_TABLE_WIDTH = 512


def table_widths(max_pages_per_seq: int) -> list[int]:
    widths, width = [], MIN_TABLE_WIDTH
    while width * TABLE_WIDTH_FACTOR <= max_pages_per_seq:
        widths.append(width)
        width *= TABLE_WIDTH_FACTOR
    return widths + [max_pages_per_seq]


class BucketPlan:
    """The fixed shapes the step is compiled for: tokens and requests, powers of two,
    and the page table's widths; with decode_rows (a model with MLA or MoE layers, k + 1), also
    decode-only shapes, of the sizes a batch of requests with at most decode_rows rows
    each can take."""

    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int, max_pages_per_seq: int, min_tokens: int = 8,
                 decode_rows: int | None = None):
        self.decode_rows = decode_rows
        self.token_sizes = powers_of_two(min(min_tokens, max_num_batched_tokens), max_num_batched_tokens)
        # a step's requests own a row each: never more of them than max_num_batched_tokens
        self.seq_sizes = powers_of_two(1, min(max_num_seqs, max_num_batched_tokens))
        self.table_widths = table_widths(max_pages_per_seq)

    def shape_for(
        self, num_tokens: int, num_seqs: int, greedy: bool = True, num_pages: int = 0, prompt_logprobs: bool = False,
        masked: bool = False, longest_run: int = 0,
    ) -> BatchShape:
        """The smallest shape that holds num_tokens rows of num_seqs requests, the
        longest holding num_pages pages, the longest run of one request's rows
        longest_run (decode-only when that is a decode's)."""
        t = next(s for s in self.token_sizes if s >= num_tokens)
        b = next(s for s in self.seq_sizes if s >= num_seqs)
        p = next(w for w in self.table_widths if w >= num_pages)
        decode_only = self.decode_rows is not None and longest_run <= self.decode_rows
        return BatchShape(t, b, greedy, p, prompt_logprobs, masked, decode_only)

    def seq_sizes_for(self, num_tokens: int) -> list[int]:
        # every request owns at least one row, so B never exceeds T
        return [b for b in self.seq_sizes if b <= num_tokens]

    def all_shapes(self, masked: bool = False, prompt_logprobs: bool = False) -> list[BatchShape]:
        """Smallest first, of one kind (OTHER_KINDS)."""
        return [
            BatchShape(t, b, greedy, p, prompt_logprobs, masked, decode_only)
            for t in self.token_sizes
            for b in self.seq_sizes_for(t)
            for decode_only in (True, False) if not decode_only or self._decode_only_fits(t, b)
            for greedy in (True, False)
            for p in self.table_widths
        ]

    def _decode_only_fits(self, t: int, b: int) -> bool:
        """Whether shape_for gives a decode-only batch of b requests (its bucket) t rows:
        the smallest bucket, or one under b requests' decode rows."""
        return self.decode_rows is not None and (t == self.token_sizes[0] or t // 2 < b * self.decode_rows)

    def largest(self, masked: bool = False, prompt_logprobs: bool = False) -> BatchShape:
        """The shape that holds every batch of its kind the scheduler can make."""
        t = self.token_sizes[-1]
        return BatchShape(t, self.seq_sizes_for(t)[-1], False, self.table_widths[-1], prompt_logprobs, masked)


def build_batch(
    scheduled, shape: BatchShape, max_pages_per_seq: int, page_size: int, num_slots: int, k: int, m: int = 1,
) -> Batch:
    """Numpy arrays for one step, vectorised over requests and rows; `scheduled` is a list
    of scheduler.ScheduledRows; num_slots: the cache's slots (padding rows write past
    them, dropped); m: MTP modules the draft pass runs (next_chunk_token's width)."""
    t, b, n = shape.num_tokens, shape.num_seqs, len(scheduled)
    seqs = [item.seq for item in scheduled]
    lengths = np.fromiter((len(item.token_ids) for item in scheduled), np.int32, n)
    starts = np.fromiter((item.start for item in scheduled), np.int32, n)
    num_drafts = np.fromiter((item.num_drafts for item in scheduled), np.int32, n)
    ends = np.cumsum(lengths, dtype=np.int32)
    total = int(ends[-1]) if n else 0
    query_start = np.full(b + 1, total, np.int32)
    query_start[0], query_start[1 : n + 1] = 0, ends
    row_seq = np.repeat(np.arange(n, dtype=np.int32), lengths)
    positions = np.zeros(t, np.int32)
    positions[:total] = starts[row_seq] + np.arange(total, dtype=np.int32) - query_start[row_seq]
    input_ids = np.zeros(t, np.int32)
    input_ids[:total] = np.fromiter(itertools.chain.from_iterable(item.token_ids for item in scheduled), np.int32, total)
    page_table = np.zeros((b, shape.pages_per_seq or max_pages_per_seq), np.int32)
    for i, seq in enumerate(seqs):
        page_table[i, : len(seq.pages)] = seq.pages
    slot_mapping = dropped_index(num_slots, np.arange(t, dtype=np.int32))  # padding rows: dropped
    slot_mapping[:total] = slot_of(page_table, row_seq, positions[:total], page_size)

    def per_request(values, dtype, fill=0, width=None):
        out = np.full((b,) if width is None else (b, width), fill, dtype)
        out[:n] = np.asarray(values, dtype).reshape((n,) + out.shape[1:])
        return out

    # verify rows 0..num_drafts; for a prefill chunk only its last row
    last_row = ends - 1
    sample_index = np.zeros((b, k + 1), np.int32)
    sample_index[:n] = np.minimum((last_row - num_drafts)[:, None] + np.arange(k + 1), last_row[:, None])
    params = [seq.params for seq in seqs]
    return Batch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start=query_start,
        kv_len=per_request(starts + lengths, np.int32),
        page_table=page_table,
        sample_index=sample_index,
        num_drafts=per_request(num_drafts, np.int32),
        has_output=per_request([item.has_output for item in scheduled], bool, False),
        next_chunk_token=per_request([(item.next_chunk_tokens + (0,) * m)[:m] for item in scheduled], np.int32, 0, m),
        temperature=per_request([p.temperature for p in params], np.float32),
        top_k=per_request([p.top_k for p in params], np.int32),
        top_p=per_request([p.top_p for p in params], np.float32, 1.0),
        min_p=per_request([p.min_p for p in params], np.float32),
        seed=per_request([seq.seed for seq in seqs], np.uint32),
        output_index=per_request([len(seq.output_token_ids) for seq in seqs], np.int32),
        state_slot=per_request([seq.state_slot if seq.params.processes_logits else -1 for seq in seqs], np.int32, -1),
        min_tokens=per_request([p.min_tokens for p in params], np.int32),
        repetition_penalty=per_request([p.repetition_penalty for p in params], np.float32, 1.0),
        frequency_penalty=per_request([p.frequency_penalty for p in params], np.float32),
        presence_penalty=per_request([p.presence_penalty for p in params], np.float32),
        carry_index=per_request([item.carry_index for item in scheduled], np.int32, -1),
        recurrent_slot=per_request([seq.state_slot or 0 for seq in seqs], np.int32),
    )
