"""How many KV pages the pool gets: from the device memory left after the weights and
the largest step's activations (accelerators, gpu_memory_utilization), or from a byte
budget (kv_cache_memory_bytes; the CPU default), never more than max_num_seqs requests
of max_model_len need."""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxmtp.models.config import ModelConfig
from jaxmtp.worker.cache import allocate_cache
from jaxmtp.worker.sharding import HIDDEN_PAGE_AXES, cache_axes, shards_of

log = logging.getLogger("jaxmtp.worker.memory")

GiB = 1 << 30
CPU_KV_CACHE_BYTES = 2 * GiB  # the CPU default: memory is the host's, shared with everything else


@dataclasses.dataclass(frozen=True)
class KVPool:
    num_pages: int
    page_bytes: int  # every layer's KV (main and MTP) and hidden pages of one page
    budget_bytes: int | None  # what the pool could take (None: num_pages was given)

    @property
    def gib(self) -> float:
        return self.num_pages * self.page_bytes / GiB


def page_bytes(cfg: ModelConfig, page_size: int, num_draft_modules: int, tensor_parallel_size: int = 1) -> int:
    """Bytes of one page across the whole cache, whatever its layout (no memory used),
    that one of tensor_parallel_size devices holds: its share of the K and V pages
    (split by kv head; MLA's latent pages whole on every device), and the hidden pages
    (whole on every device)."""
    shapes = jax.eval_shape(lambda: allocate_cache(cfg, 1, page_size, num_draft_modules))

    def nbytes(arrays, axes):
        return sum(x.size * x.dtype.itemsize for x in arrays) // shards_of(axes, tensor_parallel_size)

    return nbytes(shapes.k + shapes.v, cache_axes(cfg)) + nbytes(shapes.hidden, HIDDEN_PAGE_AXES)


def activation_bytes(cfg: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, k: int) -> int:
    """A generous estimate of the largest step's live activations: a few float32 copies
    of the residual stream and the MLP's hidden layer per row, and of the logits of
    every sampled row (filtering sorts them)."""
    rows = max_num_batched_tokens * (8 * cfg.hidden_size + 3 * cfg.intermediate_size) * 4
    logits = max_num_seqs * (k + 1) * cfg.vocab_size * 4 * 4
    return rows + logits


def plan_kv_pool(
    cfg: ModelConfig, *, page_size: int, num_draft_modules: int, max_pages_per_seq: int, max_num_seqs: int,
    max_num_batched_tokens: int, num_speculative_tokens: int, num_pages: int | None,
    gpu_memory_utilization: float, kv_cache_memory_bytes: int | None, devices: list, state_bytes: int = 0,
) -> KVPool:
    """devices: the mesh's; each holds its share of a page (page_bytes; the budget is
    one device's memory: this process's first). state_bytes: what a hybrid model's
    recurrent state tables take (jaxmtp/worker/recurrent.py), placed already: a byte
    budget gives them their share, and an accelerator's memory in use counts them."""
    per_page = page_bytes(cfg, page_size, num_draft_modules)
    device = next(d for d in devices if d.process_index == jax.process_index())
    if num_pages is not None:
        return KVPool(num_pages, per_page, None)
    stats = device.memory_stats() if device.platform != "cpu" else None
    if kv_cache_memory_bytes is not None or not stats:
        budget = (CPU_KV_CACHE_BYTES if kv_cache_memory_bytes is None else kv_cache_memory_bytes) - state_bytes
        what = "kv_cache_memory_bytes"
    else:
        # bytes_limit: what JAX's allocator may hold (by default 75% of the device's
        # memory, XLA_PYTHON_CLIENT_MEM_FRACTION sets it); the weights are in use already
        limit = stats.get("bytes_limit") or stats.get("bytes_reservable_limit")
        active = activation_bytes(cfg, max_num_batched_tokens, max_num_seqs, num_speculative_tokens)
        budget = int(gpu_memory_utilization * limit) - stats.get("bytes_in_use", 0) - active
        what = "gpu_memory_utilization"
    fit = max(budget, 0) // page_bytes(cfg, page_size, num_draft_modules, len(devices))
    if jax.process_count() > 1:  # every process allocates the same pool: the one that fits them all
        fit = int(np.min(multihost_utils.process_allgather(np.int32(min(fit, 2**31 - 1)))))
    if fit < max_pages_per_seq:
        raise ValueError(
            f"the KV cache has room for {fit} pages of {page_size} tokens ({budget / GiB:.2f} GiB by {what}), "
            f"but one request of max_model_len needs {max_pages_per_seq}: lower max_model_len or raise {what}"
        )
    pool = KVPool(min(fit, max_num_seqs * max_pages_per_seq), per_page, budget)
    log.info("KV cache: %d pages of %d tokens = %d tokens, %.2f GiB (%s)", pool.num_pages, page_size,
             pool.num_pages * page_size, pool.gib, what)
    return pool
