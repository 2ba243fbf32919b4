"""Per-request state the host keeps between steps."""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

from jaxmtp.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxmtp.prefix_cache import CachedPage


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class SpecStats:
    """Speculative decoding counters of one request."""

    num_steps: int = 0  # verify steps that ran with drafts
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.num_steps if self.num_steps else 0.0

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        self.num_steps += 1
        self.drafted += num_drafts
        self.accepted += num_accepted
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    def as_dict(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "accepted_per_position": list(self.accepted_per_position),
            "mean_acceptance_length": self.mean_acceptance_length,
        }


@dataclasses.dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the request's own seed, or one the engine drew for it
    arrival: int  # admission order; the newest running request is preempted first
    stop_token_ids: frozenset[int]
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[dict] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    # prefix-cache entries of the leading full pages (reused or registered), in order
    cached_prefix: list[CachedPage] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is written (and valid)
    drafts: list[int] = dataclasses.field(default_factory=list)  # proposals to verify next step
    # While a dispatched step that emits tokens for this sequence has not been read:
    # (that step's id, the sequence's index in it, the most tokens it can emit).
    # num_computed then assumes none of its drafts is accepted.
    in_flight: tuple[int, int, int] | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    spec_stats: SpecStats = dataclasses.field(default_factory=SpecStats)
    text: str = ""  # detokenised output, cut at a stop string if one matched

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def in_prefill(self) -> bool:
        """True while known tokens (prompt, or prompt plus output after preemption) are
        still to be computed before the next sample."""
        return self.num_computed < self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
