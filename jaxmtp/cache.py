"""Paged KV cache: device pages as a donated pytree, and the host-side page allocator."""

from __future__ import annotations

from collections import deque

import jax
import jax.numpy as jnp

from jaxmtp.config import ModelConfig
from jaxmtp.params import pytree_dataclass


@pytree_dataclass
class KVCache:
    """Per-layer K and V pages, each [num_pages + 1, page_size, num_kv_heads, head_dim].

    The main model's layers come first, then one layer per MTP module: draft KV lives
    in the same page slots as the main model's, so one page table serves both and
    preemption or prefix caching carry draft KV with no extra bookkeeping.

    The last page belongs to no request: rows with nothing to write (padding, idle
    draft-chain rows) write there, so every scatter index is in bounds and no write
    needs dropping.
    """

    k: list[jax.Array]
    v: list[jax.Array]

    @property
    def num_pages(self) -> int:
        """Pages requests can own (the scratch page not counted)."""
        return self.k[0].shape[0] - 1

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def scratch_slot(self) -> int:
        return scratch_slot(self.k[0])


def scratch_slot(pages: jax.Array) -> int:
    """A slot in the scratch page of one layer's pages: where rows with nothing to
    write write."""
    return (pages.shape[0] - 1) * pages.shape[1]


def allocate_cache(
    cfg: ModelConfig, num_pages: int, page_size: int, num_mtp_layers: int, sharding: jax.sharding.Sharding | None = None
) -> KVCache:
    """sharding (jaxmtp.sharding.cache_sharding under tensor parallelism) places each
    device's kv heads directly on it."""
    shape = (num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim)
    n = cfg.num_layers + num_mtp_layers
    # zeros, not empty: a page read before it is written must hold finite values.
    return KVCache(
        k=[jnp.zeros(shape, cfg.jnp_dtype, device=sharding) for _ in range(n)],
        v=[jnp.zeros(shape, cfg.jnp_dtype, device=sharding) for _ in range(n)],
    )


class PageAllocator:
    """Free list of page ids. Pages are handed out in units and returned whole."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.free_pages: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_pages):
            raise MemoryError(f"asked for {n} KV pages, {len(self.free_pages)} free")
        return [self.free_pages.popleft() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self.free_pages.extend(pages)


