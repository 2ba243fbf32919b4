"""Prefix caching, host side only (no JAX): full KV pages identified by a hash chain
over their tokens, reused by later requests that start with the same tokens.

The MTP module's KV entry at position i is built from the main hidden state h_i and the
embedding of token i+1, so the draft KV at the LAST row of a page depends on the first
token AFTER the page. A cached page is therefore a version of its content: its tokens
(and all tokens before it, through the hash chain) plus the token that followed it
when its last row was written. A lookup reuses a page whole only with the version whose
following token is the new request's; when only another version is cached (the request
diverges exactly at the page's end) or nothing follows the page yet (the prompt ends
with it), the page is reused as a private copy whose last row is recomputed
(copy-on-write): the hit stays within one token of the longest cached prefix. See
docs/prefix-cache.md for the design and the measured alternatives.

With M > 1 MTP modules drafting, module j's row i is built from token i+j: a page's
version is the M tokens after it, and a step rewrites up to M-1 rows before its first,
so every hit ends in a private copy (docs/prefix-cache.md, "Several MTP modules").

A hybrid model's sequence also needs its recurrent state where the hit ends: with
snapshots (jaxmtp/engine/state_snapshots.py) a hit ends at its last page with one.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxmtp.engine.state_snapshots import StateSnapshots

# How a lookup treats the last row of the last reused page (see the module docstring):
#   exact: reuse the version followed by the request's next token, else copy-on-write
#   drop:  reuse only pages followed by a known token, then drop the last one (vLLM)
#   stale: reuse any version, whatever token followed it (what engines that key pages by
#          their tokens alone do; for ablations)
PREFIX_CACHE_BOUNDARIES = ("exact", "drop", "stale")


def page_hash(parent_hash: int, tokens: tuple[int, ...], salt: int) -> int:
    """The hash chain: a page's hash covers its tokens, every token before it (through
    its parent's hash) and the salt (what else decides the KV: the model)."""
    return hash((parent_hash, salt, tokens))


def model_salt(*facts) -> int:
    """A stable 64-bit salt from the facts that decide the KV for given tokens."""
    return int.from_bytes(hashlib.sha256(repr(facts).encode()).digest()[:8], "little")


@dataclasses.dataclass(eq=False)
class CachedPage:
    page: int  # the KV page id
    hash: int  # page_hash over the page's tokens and its parent's hash
    tokens: tuple[int, ...]  # checked on lookup, with the parent: a hash collision is a miss, never a wrong hit
    # the tokens after the page that its draft KV was built from (M of them; None without MTP)
    following: tuple[int, ...] | None
    parent: CachedPage | None  # the previous page's entry (None for a sequence's first page)


@dataclasses.dataclass
class PrefixHit:
    pages: list[CachedPage]  # reused whole, in order
    copy_source: CachedPage | None  # the page after them, reusable but for its last row: copy-on-write
    state_snapshot: int | None = None  # the recurrent state after the pages (hybrid models)


@dataclasses.dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up: all known tokens of every admitted sequence
    hits: int = 0  # tokens of those whose KV was reused
    evictions: int = 0  # cached pages taken back for new KV

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class PrefixCache:
    """An index of cached full pages by hash and following tokens. The pages themselves,
    their reference counts and the eviction order belong to the PageAllocator, which
    asks holds(page) when a page's last holder lets go and calls forget(page) when it
    evicts one. Salts (what besides the tokens decides the KV: the model, and a
    request's cache_salt) are given with each lookup and registration."""

    def __init__(self, page_size: int, with_draft_kv: bool, boundary: str = "exact", num_draft_modules: int = 1,
                 snapshots: StateSnapshots | None = None):
        self.page_size = page_size
        self.snapshots = snapshots  # a hybrid model's recurrent-state snapshots, else None
        self.with_draft_kv = with_draft_kv  # the cache has MTP layers, so a page's following tokens matter
        self.boundary = boundary
        # The tokens after a page its KV depends on: module j's row at the page's last
        # position reads the token j ahead, so M with M MTP modules drafting (without MTP,
        # 1: a page followed by nothing yet has its last row recomputed for the logits).
        self.num_following = max(num_draft_modules, 1) if with_draft_kv else 1
        self.table: dict[int, dict[tuple[int, ...] | None, CachedPage]] = {}  # hash -> following -> entry
        self.by_page: dict[int, CachedPage] = {}
        self.stats = PrefixCacheStats()

    # ----- lookup and registration --------------------------------------------------

    def lookup(self, token_ids: list[int], salt: int) -> PrefixHit:
        """The longest cached prefix of token_ids, in full pages; with snapshots, the
        longest that ends with one, reused whole."""
        hit = self._lookup(token_ids, salt)
        if self.snapshots is None:
            return hit
        num_pages, snapshot = self.snapshots.hit_end(hit.pages)
        return PrefixHit(hit.pages[:num_pages], None, snapshot)

    def _lookup(self, token_ids: list[int], salt: int) -> PrefixHit:
        size = self.page_size
        pages: list[CachedPage] = []
        parent = None
        for start in range(0, len(token_ids) - size + 1, size):
            versions = self._versions(parent, tuple(token_ids[start : start + size]), salt)
            if not versions:
                break
            following = self._following(token_ids, start + size)
            entry = versions.get(following if self.with_draft_kv else None)
            if entry is None and following is not None and self.boundary == "stale":
                entry = next(iter(versions.values()))  # the ablation: its draft row was built from another token
            if entry is None or following is None:
                # The page is right but for its last row(s): nothing follows it yet (the row is
                # recomputed for the logits), or its draft rows were built from other tokens.
                if self.boundary == "drop":  # vLLM: matched if a known token follows, then dropped
                    return PrefixHit(pages if following is not None else pages[:-1], None)
                return PrefixHit(pages, entry or next(iter(versions.values())))
            pages.append(entry)
            parent = entry
        if self.boundary == "drop":
            return PrefixHit(pages[:-1], None)
        if self.num_following > 1 and pages:  # the last matched page is copied, never shared
            return PrefixHit(pages[:-1], pages[-1])
        return PrefixHit(pages, None)

    def register(
        self, token_ids: list[int], num_computed: int, pages: list[int], cached_prefix: list[CachedPage], salt: int
    ) -> None:
        """Index a request's full pages whose KV is final, appending their entries to its
        cached_prefix (the entries of its leading pages so far): every row computed, and the token after
        the page known (the draft KV at its last row was built from it). With M > 1
        modules, every module's rows exact (module j's row i, built from token i+j, is
        exact once a step whose boundary lies at or after position i+j-1 has run), and the
        M tokens after the page known: a step still queued may have rewritten its last
        rows from tokens the host has not read yet."""
        size, ahead = self.page_size, self.num_following
        num_final = min(num_computed - (ahead - 1), len(token_ids) - ahead) // size
        parent = cached_prefix[-1] if cached_prefix else None
        for j in range(len(cached_prefix), num_final):
            tokens = tuple(token_ids[j * size : (j + 1) * size])
            after = self._following(token_ids, (j + 1) * size) if self.with_draft_kv else None
            digest = page_hash(parent.hash if parent else 0, tokens, salt)
            versions = self.table.setdefault(digest, {})
            entry = versions.get(after)
            if entry is None:
                entry = CachedPage(pages[j], digest, tokens, after, parent)
                versions[after] = entry
                self.by_page[entry.page] = entry
            elif entry.tokens != tokens or entry.parent is not parent:
                return  # a hash collision: this page and the rest of the request's pages stay uncached
            # else another request cached the same version first; this one keeps its own copy
            cached_prefix.append(entry)
            parent = entry

    def _following(self, token_ids: list[int], end: int) -> tuple[int, ...] | None:
        """The version a page ending at `end` needs: the tokens after it that its KV
        depends on, or None while they are not all known."""
        after = tuple(token_ids[end : end + self.num_following])
        return after if len(after) == self.num_following else None

    def _versions(self, parent: CachedPage | None, tokens: tuple[int, ...], salt: int) -> dict[tuple[int, ...] | None, CachedPage]:
        """Cached entries with exactly these tokens after exactly this parent, by following tokens."""
        versions = self.table.get(page_hash(parent.hash if parent else 0, tokens, salt), {})
        return {t: e for t, e in versions.items() if e.tokens == tokens and e.parent is parent}

    # ----- the allocator's questions ---------------------------------------------

    def holds(self, page: int) -> bool:
        """Whether the page holds KV this index can hand out again."""
        return page in self.by_page

    def forget(self, page: int) -> None:
        """The allocator evicted the page for new KV: drop its entry."""
        entry = self.by_page.pop(page)
        versions = self.table[entry.hash]
        del versions[entry.following]
        if not versions:
            del self.table[entry.hash]
        if self.snapshots is not None:
            self.snapshots.forget(entry)
        self.stats.evictions += 1

    def clear(self) -> None:
        self.table.clear()
        self.by_page.clear()
        if self.snapshots is not None:
            self.snapshots.clear()
