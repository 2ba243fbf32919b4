"""Multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache.

An MLA layer's cache layer holds, per token, the compressed latent c (kv_lora_rank
values, after kv_a_layernorm) in KVCache.k and the shared rope key (qk_rope_head_dim
values, after RoPE) in KVCache.v: the same pages and slots as every other layer, so
the page table, prefix caching, copy-on-write and preemption carry it unchanged.

Decode and verify rows attend in the absorbed form (W_UK folded into the query, W_UV
applied after attention), prefill rows in the expanded form (per-head keys and values
rebuilt from the latent) on the reference backend: both through `mla_attention_fn`, the
one entry point. On GPUs (and pallas_interpret) both kinds of rows run the absorbed
form as the Pallas kernel (kernels/mla_attention.py), one call for each kind: the jnp
expanded form materializes every context token's keys and values for every prefill
row, which no long prompt fits. Where its measured table names the shape, prefill rows
run the split form instead (kernels/mla_prefill.py: the step's own rows expanded, 3.4x
fewer FLOPs on them at DeepSeek-V3's dims, the cached prefix absorbed or expanded a
window of tokens at a time).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxmtp.kernels.mla_attention import measured_decode_path, mla_absorbed_attention, supports
from jaxmtp.kernels.mla_prefill import measured_prefill_path, mla_split_prefill
from jaxmtp.kernels.mla_reference import mla_absorbed_attention_reference, mla_expanded_attention_reference
from jaxmtp.kernels.reference import row_ownership
from jaxmtp.models.attention import write_kv
from jaxmtp.models.config import ModelConfig, check_attention_backend
from jaxmtp.models.layers import rms_norm, rope_tables, rotate
from jaxmtp.models.linear import linear
from jaxmtp.models.params import LayerParams
from jaxmtp.worker.batch import Batch
from jaxmtp.worker.sharding import shard_mla_over_heads

# transformers and DeepSeek's own code build q_a_layernorm and kv_a_layernorm with the
# RMSNorm default, not the config's rms_norm_eps
LORA_NORM_EPS = 1e-6

MLAAttentionFn = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


def resolve_mla_backend(name: str, kv_lora_rank: int, rope_dim: int) -> str:
    """The MLA backend: "auto" is the Pallas kernel on GPUs where it tiles
    the latent and rope sizes, else the jnp reference."""
    check_attention_backend(name)
    if name == "auto":
        return "pallas" if jax.default_backend() == "gpu" and supports(kv_lora_rank, rope_dim) else "reference"
    if name.startswith("pallas") and not supports(kv_lora_rank, rope_dim):
        raise ValueError(f"the Pallas MLA kernel needs kv_lora_rank and qk_rope_head_dim powers of two "
                         f">= 16, got {kv_lora_rank} and {rope_dim}")
    return name


def mla_attention_fn(backend: str, decode_rows: int, mesh: Mesh | None = None, prefill_rows: bool = True) -> MLAAttentionFn:
    """(q, rope_cos, rope_sin, latent, rope_key, latent_pages, rope_pages, slot_mapping,
    kv_lens, page_table, query_start, w_uk, w_uv, *, sm_scale, rope_interleave) -> (out
    [T, Hq, Dv], latent_pages, rope_pages): writes this step's latent and rope key rows
    into their slots, then attends. q [T, Hq, Dn + Dr] is the projection as it comes, its
    rope part unrotated: the kernel rotates it with the tables (layers.rope_tables) as it
    loads it, the other paths first (layers.rotate). Rows of a sequence with at most
    decode_rows rows this step (decode, verify, draft rows) are decode rows, longer runs
    (prefill chunks) prefill rows; the reference takes the absorbed form for the first
    and the expanded one for the second, the kernel the absorbed form for both, in one
    call each. Without prefill_rows (a batch of decode rows alone,
    BatchShape.decode_only) only the decode call runs; with them both run,
    unconditionally, and each row takes its kind's (the kernel computes its kind's rows
    alone, the references all rows): a lax.cond would have XLA:GPU read its predicate on
    the host, twice a layer. "auto" on a GPU takes the kernel's decode call at its
    measured tiling, or XLA's absorbed form where kernels/mla_paths.json measured that
    faster (per shape, batch and context bucket, read at trace time). With a mesh, each
    device runs it on its own q heads and a whole copy of the latent cache
    (sharding.shard_mla_over_heads)."""
    check_attention_backend(backend)

    def write_and_attend(q, rope_cos, rope_sin, latent, rope_key, latent_pages, rope_pages, slot_mapping, kv_lens,
                         page_table, query_start, w_uk, w_uv, *, sm_scale, rope_interleave):
        latent_pages, rope_pages = write_kv(latent_pages, rope_pages, slot_mapping, latent[:, None], rope_key[:, None])
        cache_args = (latent_pages, rope_pages, kv_lens, page_table, query_start)
        kind = resolve_mla_backend(backend, latent.shape[-1], rope_key.shape[-1])
        # q whole, once: the kernel reads its rope part and W_UK's product slices its nope
        # part inside the GEMM (XLA otherwise merges the slices and copies q_nope apart)
        q = jax.lax.optimization_barrier(q)
        q_nope, q_pe = jnp.split(q, [q.shape[-1] - rope_key.shape[-1]], axis=-1)
        q_rope = rotate(q_pe, rope_cos, rope_sin, rope_interleave)  # for the paths other than the kernel

        def absorbed(prefill: bool):
            q_latent = jnp.einsum("thd,rhd->thr", q_nope, w_uk)
            path = None
            if backend == "auto" and kind == "pallas" and not prefill:
                path = measured_decode_path(q_nope.shape[1], latent.shape[-1], rope_key.shape[-1], decode_rows,
                                            page_table.shape[0], page_table.shape[1] * latent_pages.shape[1])
            if kind == "reference" or path == "xla":
                out = mla_absorbed_attention_reference(q_latent, q_rope, *cache_args, sm_scale=sm_scale)
            else:
                out = mla_absorbed_attention(q_latent, q, *cache_args, sm_scale=sm_scale, decode_rows=decode_rows,
                                             prefill=prefill, interpret=kind == "pallas_interpret", config=path,
                                             rope_tables=(rope_cos, rope_sin), rope_interleave=rope_interleave)
            return jnp.einsum("thr,rhv->thv", out, w_uv)

        def prefill_form():
            if kind == "reference":
                return mla_expanded_attention_reference(q_nope, q_rope, *cache_args, w_uk, w_uv, sm_scale=sm_scale)
            split = measured_prefill_path(q_nope.shape[1], latent.shape[-1], rope_key.shape[-1], q_nope.shape[-1],
                                          w_uv.shape[-1], q_nope.shape[0], page_table.shape[1] * latent_pages.shape[1])
            if split is None:
                return absorbed(prefill=True)
            return mla_split_prefill(q_nope, q_rope, latent, rope_key, *cache_args, w_uk, w_uv, sm_scale=sm_scale,
                                     decode_rows=decode_rows, interpret=kind == "pallas_interpret", config=split,
                                     rope_tables=(rope_cos, rope_sin), rope_interleave=rope_interleave, q_whole=q)

        decode_out = absorbed(prefill=False)
        if not prefill_rows:
            return decode_out, latent_pages, rope_pages
        seq, _ = row_ownership(query_start, q_nope.shape[0])
        is_decode_row = (query_start[1:] - query_start[:-1])[seq] <= decode_rows
        return jnp.where(is_decode_row[:, None, None], decode_out, prefill_form()), latent_pages, rope_pages

    return write_and_attend if mesh is None else shard_mla_over_heads(write_and_attend, mesh)


def mla_attention(
    p: LayerParams, cfg: ModelConfig, h: jax.Array, batch: Batch, latent_pages: jax.Array, rope_pages: jax.Array,
    attention: MLAAttentionFn,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's attention over normed rows h [T, H]: returns the o_proj output
    [T, H] and the cache layer with this step's latent rows written."""
    m, heads, t = cfg.mla, cfg.num_heads, h.shape[0]
    if p.mla.q_proj is not None:
        q = linear(h, p.mla.q_proj)
    else:
        q = linear(rms_norm(linear(h, p.mla.q_a_proj), p.mla.q_a_norm, LORA_NORM_EPS), p.mla.q_b_proj)
    q = q.reshape(t, heads, m.qk_head_dim)
    kv = linear(h, p.mla.kv_a_proj)
    latent = rms_norm(kv[:, : m.kv_lora_rank], p.mla.kv_a_norm, LORA_NORM_EPS)
    rope_cos, rope_sin = rope_tables(batch.positions, cfg, q.dtype)
    rope_key = rotate(kv[:, None, m.kv_lora_rank :], rope_cos, rope_sin, cfg.rope_interleave)[:, 0]
    # W_UK and W_UV [R, Hq, D] as views of kv_b_proj's halves: XLA folds the slice and
    # the transpose into the products that read them
    w_uk, w_uv = (jnp.transpose(half, (2, 1, 0)) for half in jnp.split(p.mla.kv_b_proj, [m.qk_nope_head_dim]))
    out, latent_pages, rope_pages = attention(
        q, rope_cos, rope_sin, latent, rope_key, latent_pages, rope_pages, batch.slot_mapping, batch.kv_len,
        batch.page_table, batch.query_start, w_uk, w_uv, sm_scale=cfg.mla_softmax_scale(),
        rope_interleave=cfg.rope_interleave,
    )
    return linear(out.reshape(t, heads * m.v_head_dim), p.o_proj), latent_pages, rope_pages
