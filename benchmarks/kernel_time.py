"""Device time by kernel and by kind of kernel, for any engine's run in this process.

Used by profile_engine.py and by bench_engine's `--profile` (for Ponytail here and for vLLM in
vllm_peer.py's worker, which imports this file from its own interpreter: torch is imported only
inside the functions). On CUDA every kernel counts, those replayed from CUDA graphs included; on
the CPU the top-level aten ops stand in for kernels.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

# Kernel name fragments -> kind; first match wins (FlashAttention-4's CuTe kernels also name cutlass).
KINDS = [
    ("attention (ponytail decode)", ("paged_decode", "decode_reduce")),
    ("attention (flash: prompts, vLLM's everything)", ("flash", "fmha", "attn")),
    ("cache write / gather", ("write_slots", "write_kv", "reshape_and_cache", "gather", "copy_blocks")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "splitkreduce")),
    ("sampling", ("topk", "sort", "softmax", "argmax", "multinomial", "cumsum", "sampl")),
]
OTHER = "other (norms, rotary, adds, activations, copies)"


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, fragments in KINDS:
        if any(f in lowered for f in fragments):
            return kind
    return OTHER


@contextlib.contextmanager
def recorded(device_type: str):
    """Profiles the block; yields a dict that holds, after it, the summary of `summarize`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device_type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    summary: dict = {}
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        yield summary
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    summary.update(summarize(prof, cuda, wall))


def _kernels(prof, cuda: bool):
    """(name, microseconds) per kernel; kineto's raw events where this torch has them (fast for the
    hundreds of thousands of kernels a workload launches), else the parsed event tree."""
    raw = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if cuda and raw is not None:
        for event in raw.events():
            if event.device_type().name == "CUDA":
                yield event.name(), event.duration_ns() / 1e3
        return
    for event in prof.events():
        if cuda and event.device_type.name != "CUDA":
            continue
        if not cuda and (event.cpu_parent is not None or not event.name.startswith("aten::")):
            continue
        yield event.name, (event.device_time if cuda else event.cpu_time)


def per_kernel(prof, cuda: bool) -> dict[str, list]:
    """[seconds, calls] of each kernel (on the CPU: top-level aten op) by name."""
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for name, us in _kernels(prof, cuda):
        totals[name][0] += us / 1e6
        totals[name][1] += 1
    return totals


def summarize(prof, cuda: bool, wall_s: float, top: int = 30) -> dict:
    """wall_s, kernel_s (summed kernel time), by_kind_s, and the `top` kernels by time
    ({name, calls, seconds}). kernel_s above wall_s means kernels overlapped (several streams)."""
    totals = per_kernel(prof, cuda)
    by_kind: dict[str, float] = defaultdict(float)
    for name, (seconds, _) in totals.items():
        by_kind[kind_of(name)] += seconds
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    return {"wall_s": wall_s, "kernel_s": sum(s for s, _ in totals.values()),
            "kernels": sum(int(n) for _, n in totals.values()),
            "by_kind_s": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "top": [{"name": name, "calls": int(n), "seconds": s} for name, (s, n) in ranked[:top]]}
