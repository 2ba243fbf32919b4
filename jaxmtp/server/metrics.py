"""The server's Prometheus metrics: engine gauges and counters read at scrape time, and
the latency histograms observed as requests progress. Every series carries a
`model_name` label. Under ServerConfig.metrics_names "vllm" the series vLLM also has take
vLLM's names (vllm:num_requests_running, ...), so that dashboards and autoscalers made
for vLLM read them; the others keep jaxmtp's."""

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
}
FINISH_REASON_LABEL = {"jaxmtp": "finish_reason", "vllm": "finished_reason"}
METRICS_NAMES = tuple(FINISH_REASON_LABEL)
REQUEST_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 240, 480, 960)


def series_name(key: str, names: str) -> str:
    jaxmtp_name, vllm_name = NAMES[key]
    return vllm_name if names == "vllm" and vllm_name else jaxmtp_name


class EngineCollector:
    """Engine gauges and counters, read at scrape time."""

    def __init__(self, engine, model_name: str, names: str):
        self.engine, self.model_name, self.names = engine, model_name, names

    def family(self, cls, key: str, help_text: str, value=None, labels: tuple[str, ...] = ()):
        family = cls(series_name(key, self.names), help_text, labels=["model_name", *labels])
        if value is not None:
            family.add_metric([self.model_name], value)
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
            per_position.add_metric([self.model_name, str(position)], count)
        yield per_position
        cache = stats.prefix_cache
        yield self.family(counter, "prefix_cache_queries", "Tokens looked up in the prefix cache.", cache.queries)
        yield self.family(counter, "prefix_cache_hits", "Looked-up tokens whose KV was reused.", cache.hits)
        yield self.family(gauge, "prefix_cache_hit_rate", "Prefix cache hits / queries so far.", cache.hit_rate)
        yield self.family(counter, "prefix_cache_evictions", "Cached KV pages evicted.", cache.evictions)


class Metrics:
    """Prometheus metrics in a registry of their own, for the model served as model_name."""

    def __init__(self, engine, model_name: str, names: str = "jaxmtp"):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name, names))

        def histogram(key: str, help_text: str, buckets: tuple[float, ...]):
            name = series_name(key, names)
            metric = Histogram(name, help_text, ["model_name"], buckets=buckets, registry=self.registry)
            return metric.labels(model_name)

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
        self._finished = Counter(
            series_name("finished", names), "Engine requests (one per choice) that finished, by reason.",
            ["model_name", FINISH_REASON_LABEL[names]], registry=self.registry,
        )
        self.model_name = model_name

    def observe_finished(self, out: RequestOutput) -> None:
        """A finished engine request: its finish reasons, and its stages' times."""
        for completion in out.outputs:
            self._finished.labels(self.model_name, completion.finish_reason).inc()
        timings = out.metrics
        if timings is None:
            return
        for histogram, seconds in (
            (self.e2e_latency, timings.e2e_latency), (self.queue_time, timings.queue_time),
            (self.prefill_time, timings.prefill_time), (self.decode_time, timings.decode_time),
        ):
            if seconds is not None:  # a stage it never reached (aborted while waiting, say)
                histogram.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
