"""A Ponytail side: every request into one engine at once, stepped to the end, the pool's state
published to the memory sampler after every step; then, optionally, idle time in which the pool
gives its spare memory back. With --kv-cache-dtype fp8 there are two such sides, one per KV dtype."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..kv.estimate import KVEstimate
from ..llm import LLM
from ..sampling.params import SamplingParams
from ..utils.dtypes import dtype_name
from .memory import MemorySampler, PoolSnapshot
from .speed import RequestTiming, SpeedStats, speed_stats
from .workload import Workload

IDLE_MAINTAIN_EVERY_S = 0.1  # how often the idle tail runs the pool's maintenance, like AsyncLLM idle


@dataclass(slots=True)
class EngineSide:
    """One Ponytail side's KV pool: how it stores K/V, what its budget holds, and what the run used."""

    kv_cache_dtype: str  # the engine's kv_cache_dtype: "auto", "fp8" or "fp8_e4m3"
    kv_dtype: str  # the element type the pool stores, e.g. "bfloat16" or "float8_e4m3fn"
    scales: str | None  # FP8: where the K/V scales came from (checkpoint, calculated, default); else None
    budget_bytes: int  # the most the pool may grow to (the same --kv-cache-memory for every side)
    bytes_per_token: int  # K and V of one token, every layer
    capacity_tokens: int  # tokens the budget holds, in whole blocks
    estimate: KVEstimate | None = None  # `ponytail estimate` for this run's shape and this side's dtype
    pool_peak_bytes: int | None = None  # the most memory the pool held during the run
    peak_running: int | None = None  # the most requests running at once

    @classmethod
    def of(cls, llm: LLM) -> "EngineSide":
        cache = llm.engine.cache
        config = cache.config
        scales = cache.storage.scales
        return cls(kv_cache_dtype=config.kv_cache_dtype, kv_dtype=dtype_name(config.kv_dtype),
                   scales=None if scales is None else scales.source, budget_bytes=config.memory_budget,
                   bytes_per_token=config.bytes_per_token, capacity_tokens=config.max_num_blocks * config.block_size)

    @property
    def label(self) -> str:
        """For reports, as the plot's legend says it: "KV float32", "KV float8_e4m3fn, scales calculated"."""
        return f"KV {self.kv_dtype}" + ("" if self.scales is None else f", scales {self.scales}")


def pool_snapshot(llm: LLM) -> PoolSnapshot:
    engine = llm.engine
    cache = engine.cache
    stats = cache.stats()
    running = engine.scheduler.running
    return PoolSnapshot(pool_bytes=stats.allocated_bytes, used_bytes=stats.used_blocks * cache.config.block_bytes,
                        live_token_bytes=sum(r.num_tokens for r in running) * cache.config.bytes_per_token,
                        running=len(running), waiting=len(engine.scheduler.waiting))


def run_ponytail(llm: LLM, workload: Workload, sampler: MemorySampler, on_done: Callable[[int], None],
                 side: str = "ponytail") -> tuple[SpeedStats, int]:
    """Run the workload; returns its speed and the most requests that ran at once.

    Ctrl-C aborts what is left (blocks go back to the pool) and returns what ran."""
    engine = llm.engine
    device = engine.cache.config.device
    t0 = time.perf_counter()
    mono0 = time.monotonic()  # request metrics are time.monotonic() stamps
    requests = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                for p, n in zip(workload.prompts, workload.output_lens)]
    peak_running, interrupted = 0, False
    try:
        while engine.has_unfinished():
            finished = sum(o.finished for o in engine.step())
            snapshot = pool_snapshot(llm)
            sampler.publish(snapshot)
            peak_running = max(peak_running, snapshot.running)
            if finished:
                on_done(finished)
    except KeyboardInterrupt:
        interrupted = True
        for request in requests:
            engine.abort(request.request_id)
        while engine.has_unfinished():  # read back a step still in flight
            engine.step()
        sampler.publish(pool_snapshot(llm))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    timings = []
    for request in requests:
        m = request.metrics
        tokens = len(request.known_output_token_ids)
        timings.append(RequestTiming(None if m.first_token_time is None else m.first_token_time - mono0,
                                     None if m.last_token_time is None else m.last_token_time - mono0, tokens))
    done = sum(len(r.known_output_token_ids) == n for r, n in zip(requests, workload.output_lens))
    for request in requests:
        engine.forget(request.request_id)
    stats = engine.stats()
    speed = speed_stats(side, timings, seconds, len(requests), done, interrupted,
                        note=f"{stats.num_preemptions} preemptions, prefix hit rate {stats.prefix_hit_rate:.0%}")
    return speed, peak_running


def idle(llm: LLM, sampler: MemorySampler, seconds: float) -> bool:
    """No requests for `seconds`: maintenance runs as it does in an idle server (AsyncLLM), so the
    pool gives back what it no longer needs once kv_release_after_s has passed. True on Ctrl-C."""
    end = time.perf_counter() + seconds
    try:
        while time.perf_counter() < end:
            llm.engine.maintain()
            sampler.publish(pool_snapshot(llm))
            time.sleep(IDLE_MAINTAIN_EVERY_S)
    except KeyboardInterrupt:
        return True
    return False
