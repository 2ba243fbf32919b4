"""The one place the engine's attention goes through: the KV write for the step's new
tokens and the ragged paged attention, Pallas kernel on GPU, jnp reference elsewhere.
Under tensor parallelism both run per device on its own heads (shard_map)."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxmtp.kernels.reference import ragged_paged_attention_reference
from jaxmtp.models.config import check_attention_backend
from jaxmtp.worker.cache import dropped_index, write_slots
from jaxmtp.worker.sharding import shard_over_heads

AttentionFn = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


def pallas_supports(head_dim: int) -> bool:
    """The GPU kernel tiles head_dim as a power of two of at least 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def resolve_backend(name: str, head_dim: int) -> str:
    check_attention_backend(name)
    if name == "auto":
        return "pallas" if jax.default_backend() == "gpu" and pallas_supports(head_dim) else "reference"
    if name.startswith("pallas") and not pallas_supports(head_dim):
        raise ValueError(f"the Pallas attention kernel needs head_dim a power of two >= 16, got {head_dim}")
    return name


def attention_fn(backend: str, head_dim: int, mesh: Mesh | None = None, kernel_config=None) -> AttentionFn:
    """(q, k, v, k_pages, v_pages, slot_mapping, kv_lens, page_table, query_start,
    sliding_window=None) -> (out, k_pages, v_pages): writes this step's K/V rows into
    their page slots, then attends. "auto" is the Pallas kernel on GPU where it supports
    the head size, else the jnp reference. With a mesh, the write and the attention run
    per device over its shard of the heads and the cache (no mesh: plain, one device).
    kernel_config (a jaxmtp.kernels.KernelConfig, for tuning) overrides the Pallas kernel's
    tiling; None lets it choose from the shapes."""
    backend = resolve_backend(backend, head_dim)
    if backend == "reference":
        impl = ragged_paged_attention_reference
    else:
        from jaxmtp.kernels import ragged_paged_attention  # Pallas: imported only where used

        impl = functools.partial(ragged_paged_attention, interpret=backend == "pallas_interpret", config=kernel_config)

    def write_and_attend(q, k, v, k_pages, v_pages, slot_mapping, kv_lens, page_table, query_start, sliding_window=None):
        k_pages, v_pages = write_kv(k_pages, v_pages, slot_mapping, k, v)
        out = impl(q, k_pages, v_pages, kv_lens, page_table, query_start, sliding_window=sliding_window)
        return out, k_pages, v_pages

    return write_and_attend if mesh is None else shard_over_heads(write_and_attend, mesh)


def write_kv(k_pages, v_pages, slot_mapping, k, v):
    """Scatter this step's K/V rows into their page slots (cache.write_slots: padding
    rows' writes are dropped). With the cache donated XLA updates in place."""
    if slot_mapping.shape[0] == 1:
        # XLA rewrites a one-row scatter as a bounds-checked dynamic-update-slice, and
        # the check's select copies the whole layer; a second, dropped row keeps it a
        # scatter, updated in place.
        num_slots = k_pages.shape[0] * k_pages.shape[1]
        slot_mapping = jnp.concatenate([slot_mapping, jnp.full((1,), dropped_index(num_slots, 1), slot_mapping.dtype)])
        k, v = jnp.concatenate([k, k]), jnp.concatenate([v, v])
    return write_slots(k_pages, slot_mapping, k), write_slots(v_pages, slot_mapping, v)
