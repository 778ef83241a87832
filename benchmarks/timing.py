"""Timing helpers shared by the benchmarks: CUDA events, warm-up, median of many runs."""

from __future__ import annotations

import statistics
import time

import torch


def median_ms(fn, *, warmup: int = 3, iters: int = 20, reps: int = 1,
              device: torch.device | None = None) -> float:
    """Median time of one fn() call in milliseconds; CUDA events on a GPU, perf_counter on the CPU.

    Each sample runs fn `reps` times back to back and divides: with reps > 1 the host work of
    one call overlaps the device work of the previous one, which is steady-state throughput.
    """
    if reps > 1:
        single = fn

        def fn():
            for _ in range(reps):
                single()

    for _ in range(warmup):
        fn()
    times = []
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / reps)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3 / reps)
    return statistics.median(times)


def graph_ms(fn, *, iters: int, device: torch.device, reps: int = 1) -> float:
    """Median device time of one fn() call: `reps` calls replayed from one CUDA graph, so host
    overhead (which serving hides the same way) does not count; eager timing on the CPU."""
    if device.type != "cuda":
        return median_ms(fn, iters=iters, device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm up off the default stream, as capture requires
        fn()
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return median_ms(graph.replay, iters=iters, device=device) / reps


def tbps(num_bytes: int, ms: float) -> float:
    return num_bytes / (ms * 1e-3) / 1e12
