"""SamplingParams: what the user asks of one request, validated up front."""

from __future__ import annotations

import dataclasses
import enum

from jaxmtp.engine.structured_outputs import StructuredOutputsParams

INT32_MAX = 2**31 - 1  # the device arrays that carry a request's numbers are int32
# bad_words' token sequences live in fixed-size device arrays (jaxmtp/worker/logits_processors.py)
MAX_BAD_WORDS = 32  # token sequences per request (a word gives one or two)
MAX_BAD_WORD_TOKENS = 16  # tokens per sequence


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
    # logits processing, applied on the device to every verify row as plain decoding would
    presence_penalty: float = 0.0  # subtracted once from each token generated so far
    frequency_penalty: float = 0.0  # subtracted per occurrence among the generated tokens
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of prompt or generated tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (clamped to [-100, 100])
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings are held back until this many tokens are generated
    bad_words: list[str] | None = None  # words whose token sequences are never completed
    allowed_token_ids: list[int] | None = None  # when set, only these tokens are sampled
    # output text
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # None: none; n: each prompt token's logprob and the top n
    structured_outputs: StructuredOutputsParams | dict | None = None  # a constraint on the output

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as err:
                raise ValueError(f"structured_outputs: {err}") from err
        self.validate()

    @property
    def processes_logits(self) -> bool:
        """Whether the step applies a logits processor (jaxmtp/worker/logits_processors.py)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
            or self.min_tokens or self.bad_words or self.allowed_token_ids is not None
        )

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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and -2.0 <= value <= 2.0):
                fail(f"{name} must be in [-2, 2], got {value!r}")
        if not (isinstance(self.repetition_penalty, (int, float)) and 0.0 < self.repetition_penalty < float("inf")):
            fail(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty!r}")
        if self.logit_bias is not None and not (
            isinstance(self.logit_bias, dict)
            and all(is_int(t) and t >= 0 and isinstance(b, (int, float)) and -100 <= b <= 100
                    for t, b in self.logit_bias.items())
        ):
            fail(f"logit_bias must map non-negative token ids to numbers in [-100, 100], got {self.logit_bias!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            fail(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)
        ):
            fail(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
            or any(not is_int(t) or t < 0 for t in self.allowed_token_ids)
        ):
            fail(f"allowed_token_ids must be a non-empty list of non-negative token ids, got {self.allowed_token_ids!r}")
        if self.prompt_logprobs is not None and not (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= INT32_MAX):
            fail(f"prompt_logprobs must be a non-negative integer, got {self.prompt_logprobs!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            fail(f"structured_outputs must be a StructuredOutputsParams or a dict, got {self.structured_outputs!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            fail(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
