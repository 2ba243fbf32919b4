"""Paged KV cache: device pages as a donated pytree and the page copy behind
copy-on-write (the host-side page allocator is jaxmtp/engine/allocator.py)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxmtp.models.config import ModelConfig
from jaxmtp.models.params import pytree_dataclass
from jaxmtp.worker.sharding import cache_sharding, hidden_pages_sharding


@pytree_dataclass
class KVCache:
    """Per-layer K and V pages, each [num_pages, page_size, num_kv_heads, head_dim];
    for an MLA model (DeepSeek-V3) the compressed latent instead, k
    [num_pages, page_size, 1, kv_lora_rank] and the shared rope key in v
    [num_pages, page_size, 1, qk_rope_head_dim] (jaxmtp/models/mla.py).

    The main model's layers come first (a hybrid model's full-attention ones: its
    linear-attention layers keep a recurrent state instead, jaxmtp/worker/recurrent.py),
    then one layer per MTP module the draft pass
    runs: draft KV lives in the same page slots as the main model's, so one page table
    serves both and preemption or prefix caching carry draft KV with no extra bookkeeping.

    With M > 1 modules, `hidden` holds the outputs of modules 1..M-1 ("hidden pages",
    each [num_pages, page_size, hidden_size]) in the same slots: module j reads
    module j-1's output at its position, also at positions an earlier step computed
    (jaxmtp/worker/mtp.py).

    Rows with nothing to write (padding, idle draft-chain rows) point past the last
    slot, each row at its own slot (`dropped_index`): XLA's scatter drops out-of-range
    updates, and with every index distinct the writes are a scatter with unique indices,
    which XLA emits as plain stores. One shared slot for them all made it an atomic
    read-modify-write the padding rows contended on (docs/benchmarks/README.md, runs j-m).
    """

    k: list[jax.Array]
    v: list[jax.Array]
    hidden: list[jax.Array] = dataclasses.field(default_factory=list)

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def draft_part(self, num_kv_layers: int) -> KVCache:
        """The MTP modules' layers and hidden pages (the layers after the main model's
        num_kv_layers): all of the cache the draft pass reads or writes."""
        return KVCache(k=self.k[num_kv_layers:], v=self.v[num_kv_layers:], hidden=self.hidden)

    def with_draft_part(self, draft: KVCache) -> KVCache:
        """This cache with its draft part (draft_part) replaced by draft."""
        main = len(self.k) - len(draft.k)
        return KVCache(k=self.k[:main] + list(draft.k), v=self.v[:main] + list(draft.v), hidden=list(draft.hidden))


def dropped_index(size, row):
    """Where row `row` (an int or an index array) of a scatter into `size` entries (slots,
    or pages) writes when it has nothing to write: past the end, so XLA drops the write,
    and its own index, so the scatter's indices stay unique."""
    return size + row


def write_slots(pages: jax.Array, slots: jax.Array, x: jax.Array) -> jax.Array:
    """Scatter rows x [rows, ...] into slots of pages [num_pages, page_size, ...]. The
    slots must be distinct; those past the end (dropped_index) are dropped. With the
    pages donated XLA updates them in place."""
    shape = pages.shape
    flat = pages.reshape((-1,) + shape[2:])
    return flat.at[slots].set(x.astype(pages.dtype), mode="drop", unique_indices=True).reshape(shape)


def read_hidden(pages: jax.Array, slots: jax.Array) -> jax.Array:
    """The hidden states [rows, H] at these slots of one module's hidden pages; a
    dropped row's slot is clamped to the last one (its value is never used)."""
    return pages.reshape(-1, pages.shape[-1]).at[slots].get(mode="clip")


def allocate_cache(cfg: ModelConfig, num_pages: int, page_size: int, num_mtp_layers: int, mesh: Mesh | None = None) -> KVCache:
    """num_mtp_layers: MTP modules the draft pass runs (M), with M - 1 hidden pages.
    Under tensor parallelism (mesh) each device's kv heads are placed directly on it;
    MLA's latent pages and the hidden pages are whole on every device (jaxmtp/worker/sharding.py)."""
    shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    v_shape = shape
    if cfg.mla is not None:
        shape, v_shape = (num_pages, page_size, 1, cfg.mla.kv_lora_rank), (num_pages, page_size, 1, cfg.mla.qk_rope_head_dim)
    hidden_shape = (num_pages, page_size, cfg.hidden_size)
    kv_sharding, hidden_sharding = (None, None) if mesh is None else (cache_sharding(mesh, cfg), hidden_pages_sharding(mesh))
    n = cfg.num_kv_layers + num_mtp_layers
    # zeros, not empty: a page read before it is written must hold finite values.
    return KVCache(
        k=[jnp.zeros(shape, cfg.jnp_dtype, device=kv_sharding) for _ in range(n)],
        v=[jnp.zeros(v_shape, cfg.jnp_dtype, device=kv_sharding) for _ in range(n)],
        hidden=[jnp.zeros(hidden_shape, cfg.jnp_dtype, device=hidden_sharding) for _ in range(num_mtp_layers - 1)],
    )


# Page copies per copy_pages call: a fixed shape, compiled once. A step needs one copy
# per admitted request whose cached prefix ends in a copy-on-write page.
PAGE_COPY_BATCH = 8


def page_copy_arrays(copies: list[tuple[int, int]], num_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) [PAGE_COPY_BATCH] for up to PAGE_COPY_BATCH (source, destination) page copies."""
    return copy_arrays(copies, PAGE_COPY_BATCH, num_pages)


def copy_arrays(copies: list[tuple[int, int]], size: int, num_dst: int) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) [size] for up to size (source, destination) copies into a table of
    num_dst entries (pages, or recurrent-state slots and snapshots); padding copies read
    entry 0 and write past the last entry (dropped), each its own."""
    src = np.zeros(size, np.int32)
    dst = dropped_index(num_dst, np.arange(size, dtype=np.int32))
    if copies:
        src[: len(copies)], dst[: len(copies)] = zip(*copies)
    return src, dst


@functools.partial(jax.jit, donate_argnums=0)
def copy_pages(cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """Copy page src[i] to page dst[i] in every layer (main and MTP) and hidden page. Every
    source is read before any destination is written; destinations are distinct pages,
    and those past the last page are dropped (page_copy_arrays' padding)."""
    return jax.tree.map(lambda x: x.at[dst].set(x[src], mode="drop", unique_indices=True), cache)
