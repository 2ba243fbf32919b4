"""SamplingParams: what the user asks of one request, validated up front."""

from __future__ import annotations

import dataclasses


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

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def fail(message):
            raise ValueError(message)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            fail(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            fail(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            fail(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            fail(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            fail(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            fail(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and self.logprobs >= 0):
            fail(f"logprobs must be a non-negative integer, got {self.logprobs!r}")
        if not isinstance(self.n, int) or self.n < 1:
            fail(f"n must be an integer >= 1, got {self.n!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop must be a non-empty string or a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
