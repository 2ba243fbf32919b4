"""The recurrent state of a hybrid model's linear-attention layers (Qwen3-Next, Qwen3.5):
per sequence a short-convolution window and a recurrent matrix per value head, in a
table of slots beside the paged KV cache, donated through the step as the cache is.

A running sequence owns one slot (Sequence.state_slot: the scheduler hands it out on
admission and takes it back when the sequence is preempted or ends, as it does its
pages). A sequence whose rows start at position 0 starts from zeros, whatever its slot
held: a slot needs no clearing, and a preempted sequence recomputed from its prompt
starts fresh in whichever slot it gets. A prefix-cache hit starts a sequence past 0:
its slot's committed state is first set from a snapshot, the state saved after a page
that an earlier sequence ended a step on (jaxmtp/worker/snapshot_table.py; the host's
side: jaxmtp/engine/state_snapshots.py).

Each slot keeps `keep` = k + 1 versions of its state: [slot, keep - 1] is the committed
one, the state after every token the sequence has accepted. The forward reads it and
writes in its place the states after each of the step's last `keep` rows
(jaxmtp/models/hybrid.py); once verification has counted the accepted drafts, commit
moves the one after the last accepted row to [slot, keep - 1]. So after j of k drafts
are accepted the state is exactly the state after those tokens: no rollback by
recomputation, no approximation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jaxmtp.models.config import ModelConfig
from jaxmtp.models.params import pytree_dataclass
from jaxmtp.worker.sharding import logical_to_spec


@pytree_dataclass
class RecurrentState:
    """Per linear-attention layer, in layer order: conv [N, keep, K-1, C] (the last K-1
    inputs of the conv over q|k|v, oldest first, in the model's dtype) and ssm
    [N, keep, Hv, dk, dv] (float32, as transformers keeps it: mamba_ssm_dtype). A model
    without linear attention has none (empty lists: nothing is passed or donated)."""

    conv: list[jax.Array]
    ssm: list[jax.Array]

    @property
    def keep(self) -> int:
        return self.conv[0].shape[1] if self.conv else 1


# Under tensor parallelism each device holds its linear-attention heads' states: the
# conv's channels (q|k|v of each key head, key-head major) and the value heads (key-head
# major), as in_proj_qkvz and conv1d split (jaxmtp.worker.sharding.PARAM_AXES)
CONV_AXES = ("slots", "versions", "conv_taps", "heads")
SSM_AXES = ("slots", "versions", "heads", "key_dim", "value_dim")


def recurrent_shardings(state: RecurrentState, mesh: Mesh) -> RecurrentState:
    """A NamedSharding per table of state, split over mesh by heads."""
    conv, ssm = (NamedSharding(mesh, logical_to_spec(axes)) for axes in (CONV_AXES, SSM_AXES))
    return RecurrentState([conv] * len(state.conv), [ssm] * len(state.ssm))


def constrain_recurrent(state: RecurrentState, mesh: Mesh | None) -> RecurrentState:
    """Inside the step: the tables as they were placed (XLA would otherwise pick the
    outputs' sharding, and the next step's program takes them as placed)."""
    if mesh is None:
        return state
    return jax.lax.with_sharding_constraint(state, recurrent_shardings(state, mesh))


def allocate_recurrent(cfg: ModelConfig, num_slots: int, keep: int, mesh: Mesh | None = None) -> RecurrentState:
    """Zeroed tables of num_slots slots (one per running sequence: max_num_seqs), keep
    versions each (k + 1 with k speculative tokens); with a mesh, created split by heads."""
    if mesh is not None:
        shapes = jax.eval_shape(lambda: allocate_recurrent(cfg, num_slots, keep))
        return jax.jit(lambda: allocate_recurrent(cfg, num_slots, keep),
                       out_shardings=recurrent_shardings(shapes, mesh))()
    la = cfg.hybrid
    layers = [] if la is None else [i for i in range(cfg.num_layers) if cfg.layer_is_linear(i)]
    if not layers:
        return RecurrentState([], [])
    conv_shape = (num_slots, keep, la.linear_conv_kernel_dim - 1, la.linear_num_key_heads * la.conv_group_width)
    ssm_shape = (num_slots, keep, la.linear_num_value_heads, la.linear_key_head_dim, la.linear_value_head_dim)
    return RecurrentState([jnp.zeros(conv_shape, cfg.jnp_dtype) for _ in layers],
                          [jnp.zeros(ssm_shape, jnp.float32) for _ in layers])


def recurrent_bytes(cfg: ModelConfig, num_slots: int, keep: int) -> int:
    """The tables' bytes (no memory used)."""
    shapes = jax.eval_shape(lambda: allocate_recurrent(cfg, num_slots, keep))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def committed(table: jax.Array) -> jax.Array:
    """The committed states [N, ...] of a table [N, keep, ...]."""
    return table[:, -1]


def write_tails(table: jax.Array, tail: jax.Array, slots: jax.Array, has_rows: jax.Array) -> jax.Array:
    """table with slot slots[b]'s versions set to tail[b] [keep, ...] for each request with
    rows; the others write nothing (their index is past the table and dropped)."""
    index = jnp.where(has_rows, slots, table.shape[0])
    return table.at[index].set(tail.astype(table.dtype), mode="drop")


def commit(state: RecurrentState, slots: jax.Array, num_rejected: jax.Array, has_rows: jax.Array) -> RecurrentState:
    """Each request with rows keeps all but its last num_rejected[b] rows: its slot's
    committed version becomes the state after its last kept row (a prefill chunk, and a
    plain decode row, reject none). With keep 1 every row is kept: nothing to do."""
    keep = state.keep
    if keep == 1:
        return state
    # the chosen version copied within the table: no second copy of the table
    index = jnp.where(has_rows, slots, state.conv[0].shape[0])
    chosen = keep - 1 - num_rejected

    def pick(table):
        return table.at[index, keep - 1].set(table[slots, chosen], mode="drop")

    return RecurrentState([pick(t) for t in state.conv], [pick(t) for t in state.ssm])
