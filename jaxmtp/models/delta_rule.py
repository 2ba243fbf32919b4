"""Which forms of the gated delta rule (jaxmtp/models/gated_delta.py) an attention
backend runs: the jnp reference, the Pallas kernels (kernels/gated_delta.py), or per
call whichever the H200's measured table (kernels/gated_delta_paths.json) says is
faster; and, under tensor parallelism, each form run per device on its value heads."""

from __future__ import annotations

import dataclasses
import functools

import jax

from jaxmtp.models.config import HybridConfig, check_attention_backend
from jaxmtp.models.gated_delta import CHUNK, AcrossChunks, ChunkTerms, OverRows, scan_chunks, scan_rows
from jaxmtp.worker.sharding import (
    CHUNK_ATTN_AXES, CHUNK_KEY_AXES, CHUNK_VALUE_AXES, DELTA_GATE_AXES, DELTA_KEY_AXES, DELTA_STATE_AXES,
    DELTA_TAIL_AXES, DELTA_VALUE_AXES, shard_per_device,
)


@dataclasses.dataclass(frozen=True)
class DeltaRule:
    """What a backend runs of the rule: the rows of the recurrent form (scan_rows'
    contract) and the chunked form's scan over chunks (scan_chunks')."""

    over_rows: OverRows = scan_rows
    across_chunks: AcrossChunks = scan_chunks


def delta_rule_fn(backend: str, cfg: HybridConfig, mesh=None) -> DeltaRule:
    """The rule's forms for an attention backend: "reference" the jnp forms here;
    "pallas" / "pallas_interpret" the kernels (kernels/gated_delta.py); "auto": on one
    GPU, each call takes the kernel where benchmarks/gated_delta.py measured it faster
    than the jnp form (its table, per shape and size, read at trace time), the jnp form
    elsewhere. With a mesh (the engine always has one) the kernels run per device on its
    value heads (shard_over_value_heads); the jnp forms are left to XLA's partitioner."""
    check_attention_backend(backend)
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if backend == "reference" or (backend == "auto" and jax.default_backend() != "gpu"):
        return DeltaRule()
    from jaxmtp.kernels import gated_delta as kernels  # Pallas: imported only where used

    if not kernels.supports(dk, dv, CHUNK):
        if backend == "auto":
            return DeltaRule()
        raise ValueError(f"the Pallas gated delta kernels need linear_key_head_dim and linear_value_head_dim "
                         f"powers of two >= 16, got {dk} and {dv}")
    if backend != "auto":
        interpret = backend == "pallas_interpret"
        rule = DeltaRule(functools.partial(kernels.scan_rows_kernel, interpret=interpret),
                         functools.partial(kernels.scan_chunks_kernel, interpret=interpret))
        return rule if mesh is None else shard_over_value_heads(rule, mesh)

    def over_rows(q, k, v, g, beta, state, query_start, slots, fresh, keep):
        tiling = kernels.measured_tiling("rows", *state.shape[1:], slots.shape[0])
        if tiling is None:
            return scan_rows(q, k, v, g, beta, state, query_start, slots, fresh, keep)
        return kernels.scan_rows_kernel(q, k, v, g, beta, state, query_start, slots, fresh, keep, config=tiling)

    def across_chunks(terms, chunk_start, state, slots, fresh):
        tiling = kernels.measured_tiling("chunks", *state.shape[1:], terms.decay.shape[0])
        if tiling is None:
            return scan_chunks(terms, chunk_start, state, slots, fresh)
        return kernels.scan_chunks_kernel(terms, chunk_start, state, slots, fresh, config=tiling)

    rule = DeltaRule(over_rows, across_chunks)
    return rule if mesh is None else shard_over_value_heads(rule, mesh)


def shard_over_value_heads(rule: DeltaRule, mesh) -> DeltaRule:
    """The rule's forms run per device on its own value heads and their states (as the
    recurrent tables split): a head's rows never read another's, so a kernel sees one
    shard's arrays, exactly as on one device, and needs no collective. The size a
    measured table is looked up with is then the device's (its heads)."""
    rows = shard_per_device(
        lambda *args, keep: rule.over_rows(*args, keep), mesh,
        (DELTA_KEY_AXES, DELTA_KEY_AXES, DELTA_VALUE_AXES, DELTA_GATE_AXES, DELTA_GATE_AXES, DELTA_STATE_AXES,
         (), (), ()),
        (DELTA_VALUE_AXES, DELTA_TAIL_AXES))
    chunks = shard_per_device(
        lambda *args: rule.across_chunks(ChunkTerms(*args[:6]), *args[6:]), mesh,
        (CHUNK_VALUE_AXES, CHUNK_KEY_AXES, CHUNK_KEY_AXES, CHUNK_ATTN_AXES, CHUNK_KEY_AXES, DELTA_GATE_AXES, (),
         DELTA_STATE_AXES, (), ()),
        (CHUNK_VALUE_AXES, DELTA_STATE_AXES))
    return DeltaRule(lambda q, k, v, g, beta, state, query_start, slots, fresh, keep:
                     rows(q, k, v, g, beta, state, query_start, slots, fresh, keep=keep),
                     lambda terms, *args: chunks(*terms, *args))
