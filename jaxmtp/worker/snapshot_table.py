"""The device's side of a hybrid model's recurrent-state snapshots (which entry holds
which page's state is the host's: jaxmtp/engine/state_snapshots.py): a table of states,
one version per entry, that the runner saves slots' committed states into after a step
and restores them from before one.

A save runs before the next step's device work, once every program of its own step is
queued (a masked step's second program commits the states it reads), and never for a
step that did not run. Device order does the rest: an entry the host hands out again is
read by every restore queued before the save that overwrites it."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from jaxmtp.models.config import ModelConfig
from jaxmtp.worker.cache import copy_arrays
from jaxmtp.worker.recurrent import RecurrentState, allocate_recurrent, recurrent_shardings
from jaxmtp.worker.sharding import put_replicated


def copy_committed(dst: RecurrentState, src: RecurrentState, src_index: jax.Array, dst_index: jax.Array) -> RecurrentState:
    """dst with entry dst_index[i]'s committed state set to src's entry src_index[i]'s
    (padding: a dst_index past the table, dropped)."""
    def copy(to, source):
        return to.at[dst_index, -1].set(source[src_index, -1], mode="drop", unique_indices=True)

    return RecurrentState([copy(t, s) for t, s in zip(dst.conv, src.conv)],
                          [copy(t, s) for t, s in zip(dst.ssm, src.ssm)])


class SnapshotTable:
    def __init__(self, cfg: ModelConfig, num_snapshots: int, num_slots: int, mesh: Mesh):
        self.cfg, self.num_snapshots, self.num_slots, self.mesh = cfg, num_snapshots, num_slots, mesh
        self.table = allocate_recurrent(cfg, num_snapshots, 1, mesh)
        self.due_saves = None  # the last step's saves (copy_arrays), not yet queued
        # either way the tables come out split by heads as they were placed (both have
        # one table per linear-attention layer, so one set of shardings serves both)
        self._copy = jax.jit(copy_committed, donate_argnums=0, out_shardings=recurrent_shardings(self.table, mesh))

    def restore_arrays(self, restores: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """(snapshot, state slot) copies, padded to one per slot."""
        return copy_arrays(restores, self.num_slots, self.num_slots)

    def save_arrays(self, saves: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """(state slot, snapshot) copies, padded to one per slot."""
        return copy_arrays(saves, self.num_slots, self.num_snapshots)

    def restore(self, recurrent: RecurrentState, restores: tuple[np.ndarray, np.ndarray]) -> RecurrentState:
        return self._copy(recurrent, self.table, *put_replicated(restores, self.mesh))

    def run_due_saves(self, recurrent: RecurrentState) -> None:
        if self.due_saves is not None:
            saves, self.due_saves = self.due_saves, None
            self.table = self._copy(self.table, recurrent, *put_replicated(saves, self.mesh))

    def warm(self, recurrent: RecurrentState) -> RecurrentState:
        """Compile both copies, all padding (they change nothing), after any saves due."""
        self.run_due_saves(recurrent)
        self.table = self._copy(self.table, recurrent, *put_replicated(self.save_arrays([]), self.mesh))
        return self.restore(recurrent, self.restore_arrays([]))

    def reset(self) -> None:
        """Fresh and zeroed (what it held is no longer attached to any page)."""
        self.table = self.due_saves = None
        self.table = allocate_recurrent(self.cfg, self.num_snapshots, 1, self.mesh)
