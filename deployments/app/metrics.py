"""Replica metrics through Ray Serve's metrics API, named after vLLM's where they mean the same.

Serve adds the deployment, replica and application tags itself; values are exported by Ray's
Prometheus endpoint.
"""

from __future__ import annotations

from ray.serve import metrics

from ponytail import EngineStats, RequestOutput

_LATENCY_BOUNDARIES = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0]


class ReplicaMetrics:
    def __init__(self, replica: str):
        self.replica = replica
        self.kv_usage = metrics.Gauge("ponytail_kv_cache_usage_perc", "Share of KV blocks held by live requests")
        self.running = metrics.Gauge("ponytail_num_requests_running", "Requests being computed")
        self.waiting = metrics.Gauge("ponytail_num_requests_waiting", "Requests queued for KV blocks")
        self.fragmentation = metrics.Gauge("ponytail_kv_fragmentation",
                                           "Holes below the KV pool's high-water mark / high-water mark")
        self.preemptions = metrics.Counter("ponytail_num_preemptions_total", "Requests preempted for recompute")
        self.prefix_hits = metrics.Counter("ponytail_prefix_cache_hits_total", "Prompt tokens served from cache")
        self.prefix_queries = metrics.Counter("ponytail_prefix_cache_queries_total", "Prompt tokens admitted")
        self.defrag_blocks = metrics.Counter("ponytail_defrag_blocks_moved_total",
                                             "KV blocks moved by pool compaction")
        self.ttft = metrics.Histogram("ponytail_time_to_first_token_seconds", "Time to first token",
                                      boundaries=_LATENCY_BOUNDARIES)
        self.tpot = metrics.Histogram("ponytail_time_per_output_token_seconds", "Time per output token",
                                      boundaries=_LATENCY_BOUNDARIES)
        # vLLM's split of a request's time to first token: waiting in the engine, then its first steps
        self.queue_time = metrics.Histogram("ponytail_request_queue_time_seconds",
                                            "Time from the engine taking a request to its first step",
                                            boundaries=_LATENCY_BOUNDARIES)
        self.prefill_time = metrics.Histogram("ponytail_request_prefill_time_seconds",
                                              "Time from a request's first step to its first token",
                                              boundaries=_LATENCY_BOUNDARIES)
        self.steps = metrics.Counter("ponytail_engine_steps_total", "Engine steps run")
        self.busy = metrics.Counter("ponytail_engine_busy_seconds_total",
                                    "Seconds the engine spent in its steps (rate: the busy share; "
                                    "over the step rate: the mean step time)")
        self._last = None  # the previous EngineStats, to turn totals into counter increments
        self._last_loop = (0, 0.0)  # the previous (steps, busy seconds) of the engine loop

    def on_stats(self, stats: EngineStats) -> None:
        used = stats.used_blocks / stats.total_blocks if stats.total_blocks else 0.0
        self.kv_usage.set(used)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.fragmentation.set(stats.fragmentation)
        last = self._last
        for counter, now, before in (
                (self.preemptions, stats.num_preemptions, last.num_preemptions if last else 0),
                (self.prefix_hits, stats.prefix_cache_hits, last.prefix_cache_hits if last else 0),
                (self.prefix_queries, stats.prefix_cache_queries, last.prefix_cache_queries if last else 0),
                (self.defrag_blocks, stats.num_blocks_moved, last.num_blocks_moved if last else 0)):
            if now > before:
                counter.inc(now - before)
        self._last = stats

    def on_engine_loop(self, num_steps: int, step_seconds: float) -> None:
        """The AsyncLLM loop's totals (steps, seconds in them) as counter increments."""
        steps_before, seconds_before = self._last_loop
        if num_steps > steps_before:
            self.steps.inc(num_steps - steps_before)
        if step_seconds > seconds_before:
            self.busy.inc(step_seconds - seconds_before)
        self._last_loop = (num_steps, step_seconds)

    def on_finished(self, output: RequestOutput) -> None:
        m = output.metrics
        if m.first_token_time is not None:
            self.ttft.observe(m.time_to_first_token)
            self.queue_time.observe(m.queue_time)
            self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
            tokens = len(output.token_ids)
            if tokens > 1 and m.last_token_time is not None:
                self.tpot.observe((m.last_token_time - m.first_token_time) / (tokens - 1))
