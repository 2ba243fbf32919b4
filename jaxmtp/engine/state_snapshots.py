"""Snapshots of a hybrid model's recurrent state at page boundaries, host side only (no
JAX): which entry of the device's snapshot table holds the state after which cached page,
so that a prefix-cache hit can start a sequence past position 0 of a model whose
linear-attention layers carry a state instead of KV (the device's side:
jaxmtp/worker/recurrent.py, copy_committed).

The state after a page depends on every token up to the page's end and on nothing
after it, so one snapshot serves every version of its page (prefix_cache.CachedPage).
It is saved after each prefill chunk (a prompt's, or a preempted request's recompute)
that ends on a page boundary, and while snapshots are on the scheduler ends every chunk
that crosses a boundary at its last one: the slot's committed state after that step is
the state after the page. Decode steps save none: a snapshot every page of an output
would evict the prompts' from the table. It is attached to the page's entry once the
prefix cache registers the page, and freed when that entry is evicted or when the
table runs out, least recently used first (the page then stays cached, but no hit ends
there). A hit ends at its last page with a snapshot and is reused whole, never by
copy-on-write, which starts a row before a page's end where no snapshot is."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxmtp.engine.prefix_cache import CachedPage
    from jaxmtp.engine.sequence import Sequence


class StateSnapshots:
    def __init__(self, num_snapshots: int):
        self.num_snapshots = num_snapshots
        self.free: list[int] = list(range(num_snapshots - 1, -1, -1))
        self.by_entry: OrderedDict[CachedPage, int] = OrderedDict()  # least recently used first

    def take(self) -> int | None:
        """A table entry for a new snapshot: a free one, else the least recently used
        attached one (its page loses its snapshot); None when every entry is pending."""
        if self.free:
            return self.free.pop()
        if self.by_entry:
            return self.by_entry.popitem(last=False)[1]
        return None

    def pending(self, seq: Sequence, num_pages: int) -> int | None:
        """A table entry for the state after seq's first num_pages pages, which the step
        being scheduled saves; attached when the prefix cache registers that page."""
        snapshot = self.take()
        if snapshot is not None:
            seq.pending_snapshots.append((num_pages, snapshot))
        return snapshot

    def attach(self, seq: Sequence) -> None:
        """Attach seq's pending snapshots whose page is registered now (seq.cached_prefix);
        a page that has one already keeps it, and the new one is freed."""
        waiting = []
        for num_pages, snapshot in seq.pending_snapshots:
            if len(seq.cached_prefix) < num_pages:
                waiting.append((num_pages, snapshot))
            elif seq.cached_prefix[num_pages - 1] in self.by_entry:
                self.free.append(snapshot)
            else:
                self.by_entry[seq.cached_prefix[num_pages - 1]] = snapshot
        seq.pending_snapshots = waiting

    def release(self, seq: Sequence) -> None:
        """seq lets go of its pages (registered first): attach what can be, free the rest."""
        self.attach(seq)
        self.free += [snapshot for _, snapshot in seq.pending_snapshots]
        seq.pending_snapshots = []

    def hit_end(self, pages: list[CachedPage]) -> tuple[int, int | None]:
        """How many of a lookup's pages a hit keeps (through the last with a snapshot) and
        that snapshot (marked used), or (0, None)."""
        for n in range(len(pages), 0, -1):
            snapshot = self.by_entry.get(pages[n - 1])
            if snapshot is not None:
                self.by_entry.move_to_end(pages[n - 1])
                return n, snapshot
        return 0, None

    def forget(self, entry: CachedPage) -> None:
        """The page of entry was evicted: its snapshot, if any, is free."""
        snapshot = self.by_entry.pop(entry, None)
        if snapshot is not None:
            self.free.append(snapshot)

    def clear(self) -> None:
        """Every entry free (the device tables were rebuilt; the scheduler dropped the
        running sequences' pending snapshots with their pages)."""
        self.free = list(range(self.num_snapshots - 1, -1, -1))
        self.by_entry.clear()
