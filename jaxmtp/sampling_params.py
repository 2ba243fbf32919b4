"""SamplingParams: what the user asks of one request, validated up front."""

from __future__ import annotations

import dataclasses
import enum

INT32_MAX = 2**31 - 1  # the device arrays that carry a request's numbers are int32


class RequestOutputKind(enum.Enum):
    """What the engine returns for a request each step it progresses (as vLLM's)."""

    CUMULATIVE = "cumulative"  # everything so far: text, tokens and logprobs
    DELTA = "delta"  # only what is new since the last output
    FINAL_ONLY = "final_only"  # one output, when the request finishes


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token's; n: also the top n
    n: int = 1
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def fail(message):
            raise ValueError(message)

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT32_MAX:
            fail(f"max_tokens must be an integer >= 1 and <= {INT32_MAX}, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature < float("inf"):
            fail(f"temperature must be >= 0 and finite, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            fail(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            fail(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer <= {INT32_MAX}, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            fail(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not is_int(self.n) or not 1 <= self.n <= INT32_MAX:
            fail(f"n must be an integer >= 1, got {self.n!r}")
        # choice j of n samples with seed + j
        if self.seed is not None and not (is_int(self.seed) and 0 <= self.seed and self.seed + self.n - 1 < 2**63):
            fail(f"seed must be a non-negative integer with seed + n - 1 < 2**63, got {self.seed!r}")
        if self.logprobs is not None and not (is_int(self.logprobs) and 0 <= self.logprobs <= INT32_MAX):
            fail(f"logprobs must be a non-negative integer, got {self.logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop must be a non-empty string or a list of non-empty strings")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            fail(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            fail(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
