"""The records a step leaves the runner in: StepInputs (its device work built on the
host, what rank 0 sends the other processes), InFlightStep (dispatched, not read yet)
and StepResult (its output on the host, what postprocessing reads)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from jaxmtp.worker.batch import BatchShape

if TYPE_CHECKING:
    from jaxmtp.engine.scheduler import SchedulerOutput
    from jaxmtp.worker.step import StepOutput


@dataclasses.dataclass
class InFlightStep:
    """A dispatched step whose output has not been read yet."""

    step_id: int
    scheduled: SchedulerOutput
    preemptions: list[int]  # each sequence's num_preemptions at dispatch
    # on the device; None while a masked step waits for its masks (ModelRunner.complete)
    output: StepOutput | None
    args: tuple  # (ints, floats, oracle table, shape) as the step took them, for replays
    token_bitmask: np.ndarray | None = None  # a masked step's masks as its second program took them

    @property
    def awaits_masks(self) -> bool:
        return self.output is None

    @property
    def shape(self) -> BatchShape:
        """The compiled shape the step ran on."""
        return self.args[-1]


@dataclasses.dataclass
class StepInputs:
    """A step's device work as host arrays, run in this order: page copies, recurrent-state
    restores, the LogitsState rows of newly admitted requests, the step (no shape: its
    batch could not be built); its recurrent-state saves run before the next step's
    work, once every program of this step is queued. What rank 0 sends the other
    processes each step."""

    page_copies: list[tuple[np.ndarray, np.ndarray]]  # (src, dst), PAGE_COPY_BATCH each (cache.page_copy_arrays)
    # a hybrid model's snapshots (engine/state_snapshots.py): (snapshot, slot) and
    # (slot, snapshot) [max_num_seqs] each (cache.copy_arrays), or None
    state_restores: tuple[np.ndarray, np.ndarray] | None = None
    state_saves: tuple[np.ndarray, np.ndarray] | None = None
    state_slots: np.ndarray | None = None  # [N]: the rows' slots (N a power of two; padding: past the last)
    state_rows: dict[str, np.ndarray] | None = None  # LogitsState field -> [N, ...]
    ints: np.ndarray | None = None  # the packed batch (batch.pack_batch)
    floats: np.ndarray | None = None
    shape: BatchShape | None = None


@dataclasses.dataclass
class StepResult:
    """A step's output on the host: what postprocessing reads, nothing more."""

    tokens: np.ndarray  # [B, k+1]; request b emitted tokens[b, :num_accepted[b] + 1]
    num_accepted: np.ndarray  # [B]
    drafts: np.ndarray  # [B, k]
    boundary_token: np.ndarray  # [B]
    logprobs: np.ndarray | None  # [B, k+1], when a request asked for logprobs
    ranks: np.ndarray | None  # [B, k+1] each token's rank in the model's distribution (1: its top)
    top_logprobs: np.ndarray | None  # [B, k+1, n]
    top_token_ids: np.ndarray | None
    prompt_logprobs: np.ndarray | None  # [T] per row, the token after it (BatchShape.prompt_logprobs)
    prompt_ranks: np.ndarray | None  # [T]
    prompt_top_logprobs: np.ndarray | None  # [T, n]
    prompt_top_token_ids: np.ndarray | None
