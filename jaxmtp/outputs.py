"""What generate() and the streaming API return, in the shape vLLM users know."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or token that ended it
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: logprob}, chosen first
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
    # with SamplingParams.prompt_logprobs: per prompt token {token id: logprob}, the
    # prompt's token first, then the top n; None for the first token
    prompt_logprobs: list[dict[int, float] | None] | None = None
