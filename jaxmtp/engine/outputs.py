"""What generate() and the streaming API return, in the shape vLLM users know, and the
engine's counters (EngineStats) that the server's metrics read."""

from __future__ import annotations

import dataclasses

from jaxmtp.engine.prefix_cache import PrefixCacheStats
from jaxmtp.engine.sequence import SpecStats


@dataclasses.dataclass
class Logprob:
    """One token's log-probability under the model's distribution (before temperature
    and filters), as vLLM's: rank is 1 + the number of tokens the model gave a higher
    logit (so a chosen token's rank may exceed the top n asked for); decoded_token is
    the text the token adds after the tokens before it (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or token that ended it
    # per token: {token id: Logprob}, the chosen token first, then the top n (ranks 1..n)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """When a request passed each stage, in time.monotonic() seconds (None: not yet),
    as vLLM's: arrival (add_request, or the time the caller gives), first scheduled,
    first and last token of any of its samples, finished."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        """Waiting before its first step."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        """From its first step to its first token."""
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        """From its first token to its last."""
        return None if self.first_token_time is None else self.last_token_time - self.first_token_time

    @property
    def e2e_latency(self) -> float | None:
        """From arrival to the end."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    spec_stats: dict | None = None  # drafted / accepted / per position / mean acceptance length
    num_cached_tokens: int = 0  # prompt tokens whose KV the prefix cache held (the first sample's)
    error: str | None = None  # set when finish_reason is "error"
    # with SamplingParams.prompt_logprobs: per prompt token {token id: Logprob}, the
    # prompt's token first, then the top n; None for the first token
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics | None = None  # a copy of the request's timings as of this output


@dataclasses.dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    computed_tokens: int = 0  # rows run through the main model (prefill and verify)
    spec: SpecStats = dataclasses.field(default_factory=SpecStats)  # all requests' drafts together
    prefix_cache: PrefixCacheStats = dataclasses.field(default_factory=PrefixCacheStats)
    requests_finished: int = 0
    failed_steps: int = 0
    generation_tokens: int = 0
