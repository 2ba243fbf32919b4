"""The server's Prometheus metrics: engine gauges and counters read at scrape time, and
the histograms observed as steps run and requests progress. Every series carries vLLM's
labels `model_name` and `engine` (always "0": one engine per server). Under
ServerConfig.metrics_names "vllm" the series vLLM also has take vLLM's names
(vllm:num_requests_running, ...), so that dashboards and autoscalers made for vLLM read
them; the others keep jaxmtp's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxmtp.engine.outputs import RequestOutput

# series: (jaxmtp's name, vLLM's or None). Counters are named without "_total", which
# the exposition adds.
NAMES = {
    "running": ("jaxmtp_requests_running", "vllm:num_requests_running"),
    "waiting": ("jaxmtp_requests_waiting", "vllm:num_requests_waiting"),
    "kv_usage": ("jaxmtp_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc"),
    "kv_used": ("jaxmtp_kv_pages_used", None),
    "kv_free": ("jaxmtp_kv_pages_free", None),
    "prompt_tokens": ("jaxmtp_prompt_tokens", "vllm:prompt_tokens"),
    "generation_tokens": ("jaxmtp_generation_tokens", "vllm:generation_tokens"),
    "preemptions": ("jaxmtp_preemptions", "vllm:num_preemptions"),
    "drafts": ("jaxmtp_spec_decode_drafts", "vllm:spec_decode_num_drafts"),
    "draft_tokens": ("jaxmtp_spec_decode_draft_tokens", "vllm:spec_decode_num_draft_tokens"),
    "accepted_tokens": ("jaxmtp_spec_decode_accepted_tokens", "vllm:spec_decode_num_accepted_tokens"),
    "accepted_per_position": (
        "jaxmtp_spec_decode_accepted_tokens_per_position", "vllm:spec_decode_num_accepted_tokens_per_pos"
    ),
    "prefix_cache_queries": ("jaxmtp_prefix_cache_queries", "vllm:prefix_cache_queries"),
    "prefix_cache_hits": ("jaxmtp_prefix_cache_hits", "vllm:prefix_cache_hits"),
    "prefix_cache_hit_rate": ("jaxmtp_prefix_cache_hit_rate", None),
    "prefix_cache_evictions": ("jaxmtp_prefix_cache_evictions", None),
    "finished": ("jaxmtp_requests_finished", "vllm:request_success"),
    "time_to_first_token": ("jaxmtp_time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
    "inter_token_latency": ("jaxmtp_inter_token_latency_seconds", "vllm:inter_token_latency_seconds"),
    "e2e_latency": ("jaxmtp_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds"),
    "queue_time": ("jaxmtp_request_queue_time_seconds", "vllm:request_queue_time_seconds"),
    "prefill_time": ("jaxmtp_request_prefill_time_seconds", "vllm:request_prefill_time_seconds"),
    "decode_time": ("jaxmtp_request_decode_time_seconds", "vllm:request_decode_time_seconds"),
    "inference_time": ("jaxmtp_request_inference_time_seconds", "vllm:request_inference_time_seconds"),
    "time_per_output_token": (
        "jaxmtp_request_time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds"
    ),
    "iteration_tokens": ("jaxmtp_iteration_tokens", "vllm:iteration_tokens_total"),
    "request_prompt_tokens": ("jaxmtp_request_prompt_tokens", "vllm:request_prompt_tokens"),
    "request_generation_tokens": ("jaxmtp_request_generation_tokens", "vllm:request_generation_tokens"),
    "params_n": ("jaxmtp_request_params_n", "vllm:request_params_n"),
    "params_max_tokens": ("jaxmtp_request_params_max_tokens", "vllm:request_params_max_tokens"),
    "cache_config": ("jaxmtp_cache_config_info", "vllm:cache_config_info"),
}
FINISH_REASON_LABEL = {"jaxmtp": "finish_reason", "vllm": "finished_reason"}
METRICS_NAMES = tuple(FINISH_REASON_LABEL)
REQUEST_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 240, 480, 960)
ENGINE = "0"  # vLLM's engine label: its data-parallel engine's index; a server here runs one engine
# vLLM's buckets for these
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
TIME_PER_OUTPUT_TOKEN_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0
)


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's buckets of token counts, to max_model_len)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


def series_name(key: str, names: str) -> str:
    jaxmtp_name, vllm_name = NAMES[key]
    return vllm_name if names == "vllm" and vllm_name else jaxmtp_name


class EngineCollector:
    """Engine gauges and counters, read at scrape time."""

    def __init__(self, engine, model_name: str, names: str):
        self.engine, self.model_name, self.names = engine, model_name, names

    def family(self, cls, key: str, help_text: str, value=None, labels: tuple[str, ...] = ()):
        family = cls(series_name(key, self.names), help_text, labels=["model_name", "engine", *labels])
        if value is not None:
            family.add_metric([self.model_name, ENGINE], value)
        return family

    def cache_config(self) -> GaugeMetricFamily:
        """The KV cache's settings as the labels of a gauge of 1, as vLLM's cache_config_info
        (its CacheConfig's field names: a page is a block; the KV cache has the model's dtype)."""
        engine, config = self.engine, self.engine.config
        info = {
            "block_size": config.page_size, "num_gpu_blocks": engine.allocator.num_pages,
            "num_gpu_blocks_override": config.num_pages, "gpu_memory_utilization": config.gpu_memory_utilization,
            "kv_cache_memory_bytes": config.kv_cache_memory_bytes, "cache_dtype": "auto",
            "enable_prefix_caching": config.enable_prefix_caching,
        }
        family = GaugeMetricFamily(series_name("cache_config", self.names), "The KV cache's settings (as labels).",
                                   labels=["model_name", "engine", *info])
        family.add_metric([self.model_name, ENGINE, *map(str, info.values())], 1)
        return family

    def collect(self):
        engine, stats = self.engine, self.engine.stats
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        pages, free = engine.allocator.num_pages, engine.allocator.num_free
        yield self.family(gauge, "running", "Requests being computed.", engine.num_running)
        yield self.family(gauge, "waiting", "Requests waiting to be admitted.", engine.num_waiting)
        yield self.family(gauge, "kv_usage", "Fraction of the KV cache pages in use (1: all).", (pages - free) / pages)
        yield self.family(gauge, "kv_used", "KV cache pages in use.", pages - free)
        yield self.family(gauge, "kv_free", "KV cache pages free.", free)
        yield self.family(counter, "prompt_tokens", "Prompt tokens of admitted requests.", stats.prompt_tokens)
        yield self.family(counter, "generation_tokens", "Generated tokens.", stats.generation_tokens)
        yield self.family(counter, "preemptions", "Requests preempted (their KV dropped, to recompute).",
                          engine.scheduler.num_preemptions)
        # acceptance length = 1 + accepted / drafts
        yield self.family(counter, "drafts", "Verify steps of a request with drafts.", stats.spec.num_steps)
        yield self.family(counter, "draft_tokens", "Draft tokens proposed.", stats.spec.drafted)
        yield self.family(counter, "accepted_tokens", "Draft tokens accepted.", stats.spec.accepted)
        per_position = self.family(
            counter, "accepted_per_position", "Draft tokens accepted, by draft position (0 is the first draft).",
            labels=("position",),
        )
        for position, count in enumerate(list(stats.spec.accepted_per_position)):
            per_position.add_metric([self.model_name, ENGINE, str(position)], count)
        yield per_position
        cache = stats.prefix_cache
        yield self.family(counter, "prefix_cache_queries", "Tokens looked up in the prefix cache.", cache.queries)
        yield self.family(counter, "prefix_cache_hits", "Looked-up tokens whose KV was reused.", cache.hits)
        yield self.family(gauge, "prefix_cache_hit_rate", "Prefix cache hits / queries so far.", cache.hit_rate)
        yield self.family(counter, "prefix_cache_evictions", "Cached KV pages evicted.", cache.evictions)
        yield self.cache_config()


class Metrics:
    """Prometheus metrics in a registry of their own, for the model served as model_name."""

    def __init__(self, engine, model_name: str, names: str = "jaxmtp"):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name, names))

        def histogram(key: str, help_text: str, buckets: tuple[float, ...]):
            name = series_name(key, names)
            metric = Histogram(name, help_text, ["model_name", "engine"], buckets=buckets, registry=self.registry)
            return metric.labels(model_name, ENGINE)

        self.time_to_first_token = histogram(
            "time_to_first_token", "From arrival to the first generated token of a choice.",
            (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.inter_token_latency = histogram(
            "inter_token_latency", "Between generated tokens of a choice.",
            (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.e2e_latency = histogram("e2e_latency", "From arrival to the end of a choice.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("queue_time", "From arrival to a choice's first step.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram(
            "prefill_time", "From a choice's first step to its first token.", REQUEST_LATENCY_BUCKETS
        )
        self.decode_time = histogram("decode_time", "From a choice's first token to its last.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram(
            "inference_time", "From a choice's first step to its last token.", REQUEST_LATENCY_BUCKETS
        )
        self.time_per_output_token = histogram(
            "time_per_output_token", "A finished choice's decode time per token after its first (0 for one token).",
            TIME_PER_OUTPUT_TOKEN_BUCKETS,
        )
        token_buckets = buckets_1_2_5(engine.max_model_len)
        self.iteration_tokens = histogram(
            "iteration_tokens", "Tokens of an engine step: prompt tokens it admitted, plus tokens it generated.",
            ITERATION_TOKENS_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of a finished choice.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Tokens a finished choice generated.", token_buckets
        )
        self.params_n = histogram("params_n", "The n of each prompt of a request.", PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram("params_max_tokens", "The max_tokens of each choice.", token_buckets)
        self._finished = Counter(
            series_name("finished", names), "Engine requests (one per choice) that finished, by reason.",
            ["model_name", "engine", FINISH_REASON_LABEL[names]], registry=self.registry,
        )
        self.model_name = model_name
        self._stats = engine.stats
        self._step_tokens = self._tokens_so_far()  # the engine may have run before this server

    def _tokens_so_far(self) -> int:
        return self._stats.prompt_tokens + self._stats.generation_tokens

    def observe_step(self) -> None:
        """After an engine step (on the engine's thread): its tokens, as vLLM counts an
        iteration's (the prompt tokens it admitted and the tokens it generated; a step
        that did neither is not one)."""
        total = self._tokens_so_far()
        if total > self._step_tokens:
            self.iteration_tokens.observe(total - self._step_tokens)
        self._step_tokens = total

    def observe_params(self, num_prompts: int, n: int, max_tokens: int) -> None:
        """A request's n (once a prompt) and max_tokens (once a choice), as it is admitted."""
        for _ in range(num_prompts):
            self.params_n.observe(n)
        for _ in range(num_prompts * n):
            self.params_max_tokens.observe(max_tokens)

    def observe_finished(self, out: RequestOutput) -> None:
        """A finished engine request: its finish reasons, token counts and stages' times."""
        generated = sum(len(completion.token_ids) for completion in out.outputs)
        for completion in out.outputs:
            self._finished.labels(self.model_name, ENGINE, completion.finish_reason).inc()
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_generation_tokens.observe(generated)
        timings = out.metrics
        if timings is None:
            return
        prefill, decode = timings.prefill_time, timings.decode_time
        inference = None if prefill is None or decode is None else prefill + decode
        for histogram, seconds in (
            (self.e2e_latency, timings.e2e_latency), (self.queue_time, timings.queue_time),
            (self.prefill_time, prefill), (self.decode_time, decode), (self.inference_time, inference),
        ):
            if seconds is not None:  # a stage it never reached (aborted while waiting, say)
                histogram.observe(seconds)
        # vLLM's: 0 where there is no second token to time
        self.time_per_output_token.observe(decode / (generated - 1) if decode is not None and generated > 1 else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
