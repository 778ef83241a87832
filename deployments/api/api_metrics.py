"""Prometheus metrics on the API port (/metrics), under vLLM's names with a `ponytail:` prefix.

vLLM dashboards read `vllm:<name>{model_name=...}`; these are `ponytail:<name>{model_name=...}`
with the same meaning, so a dashboard maps one to one by its prefix. Request metrics are counted
where every request passes (the API); engine gauges come from the backend's replica reports at
scrape time, one series per replica.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "ponytail:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    """Engine gauges and counters from the latest replica reports, read at each scrape."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.reports: dict = {}  # replica name -> EngineStats, refreshed before each scrape

    def collect(self) -> Iterable:
        labels = ["model_name", "replica"]
        families = {
            "kv_cache_usage_perc": GaugeMetricFamily(PREFIX + "kv_cache_usage_perc",
                                                     "KV-cache usage. 1 means 100 percent usage.", labels=labels),
            "num_requests_running": GaugeMetricFamily(PREFIX + "num_requests_running",
                                                      "Number of requests in model execution batches.", labels=labels),
            "num_requests_waiting": GaugeMetricFamily(PREFIX + "num_requests_waiting",
                                                      "Number of requests waiting to be processed.", labels=labels),
            "num_preemptions": CounterMetricFamily(PREFIX + "num_preemptions",
                                                   "Cumulative number of preemption from the engine.", labels=labels),
            "prefix_cache_queries": CounterMetricFamily(PREFIX + "prefix_cache_queries",
                                                        "Prefix cache queries, in terms of number of queried tokens.",
                                                        labels=labels),
            "prefix_cache_hits": CounterMetricFamily(PREFIX + "prefix_cache_hits",
                                                     "Prefix cache hits, in terms of number of cached tokens.",
                                                     labels=labels),
        }
        for replica, stats in sorted(self.reports.items()):
            values = [self.model_name, replica]
            usage = stats.used_blocks / stats.total_blocks if stats.total_blocks else 0.0
            families["kv_cache_usage_perc"].add_metric(values, usage)
            families["num_requests_running"].add_metric(values, stats.num_running)
            families["num_requests_waiting"].add_metric(values, stats.num_waiting)
            families["num_preemptions"].add_metric(values, stats.num_preemptions)
            families["prefix_cache_queries"].add_metric(values, stats.prefix_cache_queries)
            families["prefix_cache_hits"].add_metric(values, stats.prefix_cache_hits)
        return list(families.values())


class ApiMetrics:
    """One registry per app: request counters and latencies, plus the engine collector."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Number of prefill tokens processed.", labels,
                                     registry=self.registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Number of generation tokens processed.",
                                         labels, registry=self.registry)
        self.request_success = Counter(PREFIX + "request_success", "Count of successfully processed requests.",
                                       labels + ["finished_reason"], registry=self.registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", labels, buckets=_LATENCY_BUCKETS,
                             registry=self.registry)
        self.engine = _EngineCollector(model_name)
        self.registry.register(self.engine)

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def finished(self, prompt_tokens: int, completion_tokens: int, finish_reason: str | None, seconds: float) -> None:
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)
        self.generation_tokens.labels(self.model_name).inc(completion_tokens)
        self.request_success.labels(self.model_name, finish_reason or "unknown").inc()
        self.e2e.labels(self.model_name).observe(seconds)

    def render(self, engine_reports: dict | None = None) -> bytes:
        if engine_reports is not None:
            self.engine.reports = engine_reports
        return generate_latest(self.registry)
