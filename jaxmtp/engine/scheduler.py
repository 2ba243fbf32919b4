"""Continuous batching, host side only (no JAX): which requests run this step and with
which rows. Decodes go first, then prefill chunks fill what is left of the token budget.
A request is admitted after the longest prefix of its tokens the prefix cache holds.
When KV pages run out the newest running request is preempted and recomputed later.

schedule() returns one SchedulerOutput. With async scheduling a step is scheduled
before the previous one is read: on_dispatch and on_step_output are the two hooks that
keep the host's view of each sequence right meanwhile. A sequence whose emitting step
is in flight has placeholder rows in the next step (filled in on the device from the
step's carry, batch.apply_carry), and its num_computed assumes none of its in-flight
drafts is accepted until on_step_output applies the accepted count."""

from __future__ import annotations

import dataclasses
import operator
from collections import deque
from typing import Callable

from jaxmtp.engine.allocator import PageAllocator
from jaxmtp.engine.prefix_cache import PrefixCache
from jaxmtp.engine.sequence import InFlightRows, Sequence, Status


@dataclasses.dataclass
class ScheduledRows:
    """One request's rows in this step."""

    seq: Sequence
    start: int  # position of the first row
    token_ids: list[int]  # the rows' input ids: a prompt chunk, or [last token] + drafts
    num_drafts: int
    has_output: bool  # the rows reach the end of the known tokens, so this step samples
    # when not has_output, the M tokens after the chunk that the draft pass reads (module j
    # reads the token j positions ahead; M: MTP modules drafting), 0 past the known tokens
    next_chunk_tokens: tuple[int, ...] = ()
    # the request's index in the in-flight step whose output its rows continue, or -1;
    # such rows are placeholders until the device fills them (batch.apply_carry)
    carry_index: int = -1


@dataclasses.dataclass
class SchedulerOutput:
    """What one step runs: every request's rows, and the page copies (source,
    destination) to run on the device before it (copy-on-write of cached pages). A
    hybrid model's recurrent-state snapshots (engine/state_snapshots.py): restored
    (snapshot, state slot) before the step, saved (state slot, snapshot) after it."""

    rows: list[ScheduledRows]
    page_copies: list[tuple[int, int]]
    num_preempted: int = 0  # requests preempted while scheduling this step
    state_restores: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    state_saves: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_chunk_size: int
    page_size: int
    max_pages_per_seq: int
    num_speculative_tokens: int = 0
    num_draft_modules: int = 0  # M: MTP modules the draft pass runs, min(k, modules in the checkpoint)


ARRIVAL = operator.attrgetter("arrival")  # a sequence's admission order


def any_sequence(seq: Sequence) -> bool:
    return True


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, prefix_cache: PrefixCache | None = None,
                 admissible: Callable[[Sequence], bool] = any_sequence):
        self.config = config
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        # a hybrid model's recurrent-state snapshots (engine/state_snapshots.py), else None
        self.snapshots = prefix_cache.snapshots if prefix_cache else None
        # which waiting sequences may be admitted now; the others keep their place in
        # the queue while those behind them are admitted
        self.admissible = admissible
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._page_copies: list[tuple[int, int]] = []
        self._free_state_slots = list(range(config.max_num_seqs - 1, -1, -1))  # a running sequence holds one

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def pages_needed(self, seq: Sequence, num_rows: int) -> int:
        """Extra pages for seq to hold its KV after num_rows more rows, plus k lookahead
        slots the MTP draft chain writes past the verified tokens, plus the drafts an
        in-flight step may still accept."""
        unread = seq.in_flight.max_tokens - 1 if seq.in_flight else 0
        tokens = seq.num_computed + unread + num_rows + self.config.num_speculative_tokens
        return max(0, self.allocator.pages_for(tokens) - len(seq.pages))

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRows] = []
        in_step: set[int] = set()  # ids of the sequences scheduled so far
        preemptions_before = self.num_preemptions
        # Running requests in admission order: decodes first, then unfinished prefills
        # (scheduling changes no running sequence's phase; a preempted one waits).
        decoding, prefilling = [], []
        for seq in sorted(self.running, key=ARRIVAL):
            (prefilling if seq.in_prefill else decoding).append(seq)
        for seq in decoding + prefilling:
            if seq.status is not Status.RUNNING:  # preempted for an older request this step
                continue
            rows = self._rows_for(seq, budget)
            if rows is None or not self._reserve(seq, len(rows.token_ids), in_step):
                continue
            scheduled.append(rows)
            in_step.add(id(seq))
            budget -= len(rows.token_ids)
        # Admit waiting requests while there is room, but not in a step that had to
        # preempt: the pages just freed would readmit the victim at once, and requests
        # would take turns preempting each other without finishing.
        admitting = self.num_preemptions == preemptions_before
        restores: list[tuple[int, int]] = []
        while admitting and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = next((seq for seq in self.waiting if self.admissible(seq)), None)
            rows = None if seq is None else self._admit(seq, budget)
            if rows is None:
                break
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            seq.state_slot, seq.state_written = self._free_state_slots.pop(), False
            if seq.restore_snapshot is not None:
                restores.append((seq.restore_snapshot, seq.state_slot))
                seq.restore_snapshot = None
            self.running.append(seq)
            self._reserve(seq, len(rows.token_ids), in_step)
            scheduled.append(rows)
            in_step.add(id(seq))
            budget -= len(rows.token_ids)
        copies, self._page_copies = self._page_copies, []
        return SchedulerOutput(scheduled, copies, self.num_preemptions - preemptions_before, restores,
                               self._state_saves(scheduled))

    def _state_saves(self, scheduled: list[ScheduledRows]) -> list[tuple[int, int]]:
        """With snapshots: one after each prefill chunk that ends on a page boundary (its
        committed state is then the state there)."""
        saves = []
        for item in scheduled if self.snapshots else ():
            end = item.start + len(item.token_ids)
            if item.seq.in_prefill and end % self.config.page_size == 0:
                snapshot = self.snapshots.pending(item.seq, end // self.config.page_size)
                if snapshot is not None:
                    saves.append((item.seq.state_slot, snapshot))
        return saves

    # ----- the two hooks of async scheduling --------------------------------------------

    def on_dispatch(self, step_id: int, output: SchedulerOutput) -> None:
        """The step is queued on the device: advance each sequence past its rows, with
        none of its drafts accepted yet, and mark the ones whose output is in flight."""
        for i, item in enumerate(output.rows):
            seq = item.seq
            seq.num_computed = item.start + len(item.token_ids) - item.num_drafts
            seq.in_flight = InFlightRows(step_id, i, item.num_drafts + 1) if item.has_output else None

    def on_step_output(
        self, step_id: int, item: ScheduledRows, num_accepted: int, last_token: int, drafts: list[int],
        following: ScheduledRows | None,
    ) -> None:
        """A step's output for one of its sequences was read: num_accepted drafts were
        accepted, last_token is the last it emitted and drafts are its next proposals.
        following: the sequence's rows in the next step if that was dispatched already;
        they were placeholders, and this is what the device filled in."""
        seq = item.seq
        if seq.in_flight is not None and seq.in_flight.step_id == step_id:
            seq.in_flight = None
        seq.num_computed += num_accepted
        seq.drafts = drafts
        if following is not None:
            following.start += num_accepted
            following.token_ids = [last_token] + drafts

    # ----- admission and rows -----------------------------------------------------------

    def _admit(self, seq: Sequence, budget: int) -> ScheduledRows | None:
        """Rows for a waiting seq, after its longest cached prefix; None, with seq left as
        it was, when its pages do not fit."""
        # prompt logprobs need every prompt row computed: no cached prefix for them
        copy = self._reuse_cached_prefix(seq) if self.prefix_cache and not seq.wants_prompt_logprobs else None
        rows = self._rows_for(seq, budget)
        if rows is None or self.pages_needed(seq, len(rows.token_ids)) > self.allocator.num_free:
            self._unshare_prefix(seq)
            return None
        if self.prefix_cache:
            if not seq.num_preemptions:  # a recompute's hits are not the prompt's
                seq.num_cached_tokens = seq.num_computed
            self.prefix_cache.stats.queries += seq.num_tokens
            self.prefix_cache.stats.hits += seq.num_computed
            if copy:
                self._page_copies.append(copy)
        return rows

    def _reuse_cached_prefix(self, seq: Sequence) -> tuple[int, int] | None:
        """Start seq after the longest cached prefix of its tokens, holding a reference on
        each reused page. A page that is right but for its last row (the MTP draft KV there
        was built from another next token, or the row is recomputed for the logits) is
        reused as a private copy with that row recomputed; returns the copy to run. With
        M > 1 MTP modules every hit ends in such a copy, which holds the rows the first step
        rewrites before its first row; without a free page for it, nothing is reused."""
        size = self.config.page_size
        hit = self.prefix_cache.lookup(seq.token_ids, seq.cache_salt)
        seq.restore_snapshot = hit.state_snapshot
        seq.cached_prefix = list(hit.pages)
        seq.pages = self.allocator.share([entry.page for entry in hit.pages])
        seq.num_computed = len(hit.pages) * size
        source = hit.copy_source
        if source is None:
            return None
        self.allocator.share([source.page])  # so that allocating the copy cannot evict it
        copy = None
        if self.allocator.num_free:
            seq.pages += self.allocator.allocate(1)
            seq.num_computed += size - 1
            copy = (source.page, seq.pages[-1])
        elif self.prefix_cache.num_following > 1:
            # with several MTP modules the first step would rewrite rows of a shared page
            self._unshare_prefix(seq)
        # Letting go before the copy runs is safe: the engine runs copies before the step,
        # in order, each reading its sources before writing its destinations.
        self.allocator.free([source.page])
        return copy

    def _unshare_prefix(self, seq: Sequence) -> None:
        """Undo _reuse_cached_prefix: seq, not yet admitted, holds no page again."""
        self.allocator.free(seq.pages)
        seq.pages, seq.cached_prefix, seq.num_computed, seq.restore_snapshot = [], [], 0, None

    def _rows_for(self, seq: Sequence, budget: int) -> ScheduledRows | None:
        tokens = seq.token_ids
        if seq.in_flight is not None:  # continue a step not yet read: rows come from its carry
            num_rows = self.config.num_speculative_tokens + 1
            # a request that may reach max_tokens in flight waits for its result instead
            if len(seq.output_token_ids) + seq.in_flight.max_tokens >= seq.params.max_tokens or num_rows > budget:
                return None
            return ScheduledRows(seq, seq.num_computed, [0] * num_rows, num_rows - 1, True, carry_index=seq.in_flight.index)
        if not seq.in_prefill:  # decode: the last token plus the drafts to verify
            rows = tokens[seq.num_computed :] + seq.drafts
            if len(rows) > budget:
                return None
            return ScheduledRows(seq, seq.num_computed, rows, len(seq.drafts), True)
        size = min(len(tokens) - seq.num_computed, self.config.prefill_chunk_size, budget)
        if size <= 0:
            return None
        end = seq.num_computed + size
        boundary = end // self.config.page_size * self.config.page_size
        if self.snapshots and boundary > seq.num_computed:
            end = boundary  # a chunk that crosses a page boundary ends there: a snapshot is saved
        has_output = end == len(tokens)
        ahead = max(self.config.num_draft_modules, 1)
        after = () if has_output else tuple((tokens[end : end + ahead] + [0] * ahead)[:ahead])
        return ScheduledRows(seq, seq.num_computed, tokens[seq.num_computed : end], 0, has_output, after)

    def _reserve(self, seq: Sequence, num_rows: int, in_step: set[int]) -> bool:
        """Give seq the pages its rows need, preempting the newest running requests that
        arrived after it if necessary. False when seq itself had to be preempted.

        Only newer requests are victims, so the oldest request always progresses: a newer
        one that could take an older one's pages would otherwise preempt it, for example
        while the older one waits for an in-flight step that finishes it, and two
        recomputing requests could take turns preempting each other forever."""
        need = self.pages_needed(seq, num_rows)
        if not need:  # the usual decode step: its pages have room
            return True
        while need > self.allocator.num_free:
            victims = [s for s in self.running if s.arrival > seq.arrival and id(s) not in in_step]
            if not victims:
                self.preempt(seq)
                return False
            self.preempt(max(victims, key=ARRIVAL))
        seq.pages += self.allocator.allocate(need)
        return True

    # ----- leaving ------------------------------------------------------------------------

    def preempt(self, seq: Sequence) -> None:
        """Drop seq's KV; it goes back to the front of the queue and recomputes its
        prompt and output so far as one longer prompt (after what the prefix cache kept)."""
        self._release(seq)
        seq.num_computed = 0
        seq.drafts = []
        seq.in_flight = None
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Release everything seq holds, whether it is running or still waiting."""
        self._release(seq)
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def register_cached_rows(self, rows: list[ScheduledRows]) -> None:
        """register_cached for the sequences of a step just read that still run (a
        finished one registered its pages on release)."""
        if self.prefix_cache:
            for item in rows:
                if not item.seq.finished:
                    self.register_cached(item.seq)

    def register_cached(self, seq: Sequence) -> None:
        """Index seq's pages whose KV is final (a dispatched step's KV is final for every
        later step, which runs after it)."""
        if self.prefix_cache:
            self.prefix_cache.register(seq.token_ids, seq.num_computed, seq.pages, seq.cached_prefix, seq.cache_salt)
            if self.snapshots:
                self.snapshots.attach(seq)

    def _release(self, seq: Sequence) -> None:
        """Give back seq's pages; what it computed stays in the prefix cache."""
        self.register_cached(seq)
        if self.snapshots:
            self.snapshots.release(seq)
        self.allocator.free(seq.pages)
        seq.pages, seq.cached_prefix = [], []
        if seq.state_slot is not None:
            self._free_state_slots.append(seq.state_slot)
            seq.state_slot = None

    def reset(self) -> list[Sequence]:
        """The device cache was rebuilt: every running sequence lost its KV. Returns them
        (the engine fails them); waiting ones hold no pages and stay queued."""
        lost, self.running = self.running, []
        for seq in lost:
            seq.pages, seq.cached_prefix, seq.in_flight, seq.num_computed = [], [], None, 0
            seq.state_slot, seq.pending_snapshots = None, []
        self._page_copies = []
        self._free_state_slots = list(range(self.config.max_num_seqs - 1, -1, -1))
        return lost
