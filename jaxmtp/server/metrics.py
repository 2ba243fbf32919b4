"""The server's Prometheus metrics: engine gauges and counters read at scrape time, and
the latency histograms the routes observe."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class EngineCollector:
    """Engine gauges and counters, read at scrape time."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        engine, stats = self.engine, self.engine.stats
        free = engine.allocator.num_free
        yield GaugeMetricFamily("jaxmtp_requests_running", "Requests being computed.", value=engine.num_running)
        yield GaugeMetricFamily("jaxmtp_requests_waiting", "Requests waiting to be admitted.", value=engine.num_waiting)
        yield GaugeMetricFamily("jaxmtp_kv_pages_used", "KV cache pages in use.", value=engine.allocator.num_pages - free)
        yield GaugeMetricFamily("jaxmtp_kv_pages_free", "KV cache pages free.", value=free)
        yield CounterMetricFamily("jaxmtp_prompt_tokens", "Prompt tokens of admitted requests.", value=stats.prompt_tokens)
        yield CounterMetricFamily("jaxmtp_generation_tokens", "Generated tokens.", value=stats.generation_tokens)
        yield CounterMetricFamily("jaxmtp_spec_decode_draft_tokens", "Draft tokens proposed.", value=stats.spec.drafted)
        yield CounterMetricFamily("jaxmtp_spec_decode_accepted_tokens", "Draft tokens accepted.", value=stats.spec.accepted)
        per_position = CounterMetricFamily(
            "jaxmtp_spec_decode_accepted_tokens_per_position",
            "Draft tokens accepted, by draft position (0 is the first draft).",
            labels=["position"],
        )
        for position, count in enumerate(list(stats.spec.accepted_per_position)):
            per_position.add_metric([str(position)], count)
        yield per_position
        cache = stats.prefix_cache
        yield CounterMetricFamily("jaxmtp_prefix_cache_queries", "Tokens looked up in the prefix cache.", value=cache.queries)
        yield CounterMetricFamily("jaxmtp_prefix_cache_hits", "Looked-up tokens whose KV was reused.", value=cache.hits)
        yield GaugeMetricFamily("jaxmtp_prefix_cache_hit_rate", "Prefix cache hits / queries so far.", value=cache.hit_rate)
        yield CounterMetricFamily("jaxmtp_prefix_cache_evictions", "Cached KV pages evicted.", value=cache.evictions)


class Metrics:
    """Prometheus metrics in a registry of their own."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self.time_to_first_token = Histogram(
            "jaxmtp_time_to_first_token_seconds", "From arrival to the first generated token of a choice.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "jaxmtp_inter_token_latency_seconds", "Between generated tokens of a choice.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=self.registry,
        )
        self.requests_finished = Counter(
            "jaxmtp_requests_finished", "Engine requests (one per choice) that finished, by reason.",
            ["finish_reason"], registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
