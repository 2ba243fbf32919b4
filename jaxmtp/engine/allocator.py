"""The one owner of KV pages, host side only (no JAX): reference counts, the free list,
and the least-recently-used order of pages no request holds that still hold cached KV.
The prefix cache (jaxmtp/engine/prefix_cache.py) is an index over those pages; it owns none."""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxmtp.engine.prefix_cache import PrefixCache


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold num_tokens tokens."""
    return -(-num_tokens // page_size)


class PageAllocator:
    """A page is free when no request holds it. With a prefix cache, a page whose last
    holder lets go and that the cache indexes is parked (evictable) instead, and taken
    back, least recently used first, only when the free list is empty."""

    def __init__(self, num_pages: int, page_size: int, prefix_cache: PrefixCache | None = None):
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_cache = prefix_cache
        self.free_pages: deque[int] = deque(range(num_pages))
        self.ref_counts = [0] * num_pages
        self.evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def pages_for(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.page_size)

    @property
    def num_free(self) -> int:
        """Pages an allocation can take: never used, freed, or cached but unheld."""
        return len(self.free_pages) + len(self.evictable)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise MemoryError(f"asked for {n} KV pages, {self.num_free} free")
        pages = [self.free_pages.popleft() if self.free_pages else self._evict() for _ in range(n)]
        for page in pages:
            self.ref_counts[page] = 1
        return pages

    def share(self, pages: list[int]) -> list[int]:
        """Take a reference on pages that hold cached KV (held by others, or parked)."""
        for page in pages:
            if self.ref_counts[page] == 0:
                del self.evictable[page]
            self.ref_counts[page] += 1
        return list(pages)

    def free(self, pages: list[int]) -> None:
        """Drop one reference on each page. Last page first, so that a request's later
        pages are evicted before its earlier ones (which more requests share)."""
        for page in reversed(pages):
            if self.ref_counts[page] <= 0:
                raise RuntimeError(f"KV page {page} freed more often than it was allocated")
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                if self.prefix_cache is not None and self.prefix_cache.holds(page):
                    self.evictable[page] = None
                else:
                    self.free_pages.append(page)

    def _evict(self) -> int:
        """The least recently used parked page, forgotten by the prefix cache."""
        page, _ = self.evictable.popitem(last=False)
        self.prefix_cache.forget(page)
        return page

    def reset(self) -> None:
        """Every page free again and nothing cached (the device cache was rebuilt)."""
        self.free_pages = deque(range(self.num_pages))
        self.ref_counts = [0] * self.num_pages
        self.evictable.clear()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
