"""Per-request state the host keeps between steps."""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, NamedTuple

from jaxmtp.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxmtp.engine.prefix_cache import CachedPage


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

    def record(self, num_drafts: int, num_accepted: int, times: int = 1) -> None:
        """times verify steps, each with num_drafts drafts of which num_accepted were accepted."""
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        self.num_steps += times
        self.drafted += num_drafts * times
        self.accepted += num_accepted * times
        for j in range(num_accepted):
            self.accepted_per_position[j] += times

    def as_dict(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "accepted_per_position": list(self.accepted_per_position),
            "mean_acceptance_length": self.mean_acceptance_length,
        }


class InFlightRows(NamedTuple):  # a tuple: every step makes one per request, cheaply
    """A sequence's rows in a dispatched step that emits tokens and was not read yet."""

    step_id: int
    index: int  # the sequence's request index in that step: its row of the step's carry
    max_tokens: int  # the most tokens the step can emit for it (its drafts + 1)


@dataclasses.dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the request's own seed, or one the engine drew for it
    arrival: int  # admission order; the newest running request is preempted first
    stop_token_ids: frozenset[int]
    cache_salt: int = 0  # prefix-cache salt: the model's, mixed with the request's cache_salt
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # SamplingParams.bad_words as token sequences
    # prompt then output, appended in place (the prefix cache and recomputes read it)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[dict] = dataclasses.field(default_factory=list)
    # with SamplingParams.prompt_logprobs: an entry per prompt token scored so far (the
    # first, which nothing scores, is None)
    prompt_logprobs: list[dict | None] = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0
    pages: list[int] = dataclasses.field(default_factory=list)
    # prefix-cache entries of the leading full pages (reused or registered), in order
    cached_prefix: list[CachedPage] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is written (and valid)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache at admission
    # a hybrid model's recurrent-state snapshots (engine/state_snapshots.py): the one a
    # prefix-cache hit starts from, until its restore is scheduled, and (pages, entry)
    # of those saved after its own pages, until the prefix cache registers the page
    restore_snapshot: int | None = None
    pending_snapshots: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    drafts: list[int] = dataclasses.field(default_factory=list)  # proposals to verify next step
    # While a dispatched step that emits tokens for this sequence has not been read;
    # num_computed then assumes none of its drafts is accepted.
    in_flight: InFlightRows | None = None
    status: Status = Status.WAITING
    # the row of the device's LogitsState this sequence owns while running, and whether
    # that row holds its state yet (written at its first step after each admission)
    state_slot: int | None = None
    state_written: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    spec_stats: SpecStats = dataclasses.field(default_factory=SpecStats)
    text: str = ""  # detokenised output, cut at a stop string if one matched
    # when the model has a tokenizer: jaxmtp.engine.detokenizer.IncrementalDetokenizer and
    # jaxmtp.engine.stop_strings.StopStringMatcher (set by the output processor)
    detokenizer: object | None = None
    stop_matcher: object | None = None
    grammar: object | None = None  # jaxmtp.engine.structured_outputs.GrammarMatcher of a constrained request
    num_reported_tokens: int = 0  # output tokens already sent in a delta output
    num_reported_chars: int = 0

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids) + self.output_token_ids

    def append_token(self, token: int) -> None:
        self.token_ids.append(token)
        self.output_token_ids.append(token)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether prompt tokens are still to be scored (prompt_logprobs asked for)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def in_prefill(self) -> bool:
        """True while known tokens (prompt, or prompt plus output after preemption) are
        still to be computed before the next sample."""
        return self.num_computed < self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
