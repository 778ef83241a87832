"""Where a steady-state decode step's time goes: wall time per step and device time by kernel.

    python benchmarks/profile_engine.py                       # H200: 7B-shaped Llama, 64 x 512 prompt tokens
    python benchmarks/profile_engine.py --no-graphs           # eager steps (every kernel launched from Python)
    python benchmarks/profile_engine.py --compile             # compile_model=True
    python benchmarks/profile_engine.py --small               # CPU: the embedded default model, 4 requests
    python benchmarks/profile_engine.py --prefill --compile --requests 32 --prompt-len 2048   # prompts alone

The engine admits every request and runs until all of them decode; then it times --steps decode
steps, and profiles as many more with torch.profiler. --prefill profiles prompts instead: a first
batch of --requests prompts (one output token each) compiles and warms every shape, then a second,
other batch of the same lengths is timed and a third profiled, every step of them a prefill step.
Kernel time is summed by name and by kind (GEMM, Ponytail's attention and cache kernels, sampling,
the rest); the gap between wall time and device time per step is the device waiting for the host.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import ponytail
from bench_engine import bench_model, prompts, sync  # benchmarks/ is on sys.path when run as a script
import kernel_time
from kernel_time import kind_of
from ponytail import SamplingParams

def run_until_decoding(engine, requests, prompt_len, output_len, vocab):
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for prompt in prompts(requests, prompt_len, vocab):
        engine.add_request(prompt, params)
    steps = 0
    while engine.scheduler.waiting or any(not r.output_token_ids for r in engine.scheduler.running):
        engine.step()
        steps += 1
    return steps


def run_prompts(engine, batch) -> int:
    """Every prompt of batch to its one output token; returns the engine steps it took."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for prompt in batch:
        engine.add_request(prompt, params)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps


def measure_prefill(engine, args, vocab, device, activities):
    """(wall ms per timed step, profiled steps, profile, summary): prompts alone, see the docstring."""
    batches = [prompts(args.requests, args.prompt_len, vocab, seed=seed) for seed in range(3)]
    run_prompts(engine, batches[0])  # compiles and warms every step shape
    t0 = time.perf_counter()
    timed_steps = run_prompts(engine, batches[1])
    sync(device)
    wall_ms = (time.perf_counter() - t0) * 1e3 / timed_steps
    with profile(activities=activities) as prof:
        profiled_steps = run_prompts(engine, batches[2])
        sync(device)
    tokens_per_s = args.requests * args.prompt_len / (wall_ms * timed_steps) * 1e3
    summary = (f"{args.requests} x {args.prompt_len}-token prompts: {timed_steps} prefill steps, {tokens_per_s:,.0f} "
               f"prompt tokens/s, compile={args.compile}\nwall {wall_ms:.2f} ms/step")
    return wall_ms, profiled_steps, prof, summary


def measure_decode(engine, args, vocab, output_len, device, activities):
    """(wall ms per timed step, profiled steps, profile, summary): steady decode steps."""
    prefill_steps = run_until_decoding(engine, args.requests, args.prompt_len, output_len, vocab)
    for _ in range(3):
        engine.step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync(device)
    wall_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        sync(device)
    graphs = "off" if args.no_graphs or device.type != "cuda" else "on"
    summary = (f"{args.requests} requests decoding ({prefill_steps} steps to get there), graphs={graphs}, "
               f"compile={args.compile}\nwall {wall_ms:.2f} ms/step = {args.requests / wall_ms * 1e3:.0f} tok/s")
    return wall_ms, args.steps, prof, summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="CPU-sized: the default model, 4 requests")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed, then as many profiled")
    parser.add_argument("--no-graphs", action="store_true", help="eager decode steps (cuda_graphs=False)")
    parser.add_argument("--compile", action="store_true", help="compile_model=True")
    parser.add_argument("--prefill", action="store_true", help="profile prefill steps of whole prompts, not decode")
    parser.add_argument("--top", type=int, default=25, help="kernels listed")
    parser.add_argument("--json")
    args = parser.parse_args()
    loaded = bench_model(args.small)
    if loaded is None:
        return 2
    model, tokenizer = loaded
    if args.small:
        args.requests, args.prompt_len, args.steps = 4, 32, 4
    device = next(model.parameters()).device
    output_len = 3 * args.steps + 16  # nobody finishes inside the measured steps
    llm = ponytail.LLM(model, tokenizer=tokenizer, max_num_seqs=args.requests,
                       max_model_len=args.prompt_len + output_len, max_num_batched_tokens=8192,
                       cuda_graphs=None if device.type == "cuda" and not args.no_graphs else False,
                       compile_model=args.compile)
    engine = llm.engine
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    vocab = model.config.vocab_size
    if args.prefill:
        wall_ms, steps, prof, summary = measure_prefill(engine, args, vocab, device, activities)
    else:
        wall_ms, steps, prof, summary = measure_decode(engine, args, vocab, output_len, device, activities)
    # microseconds and calls per kernel; on the CPU top-level aten ops stand in for kernels
    per_kernel = {name: [s * 1e6, n] for name, (s, n) in kernel_time.per_kernel(prof, device.type == "cuda").items()}
    device_ms = sum(t for t, _ in per_kernel.values()) / 1e3 / steps
    by_kind: dict[str, float] = defaultdict(float)
    for name, (t, _) in per_kernel.items():
        by_kind[kind_of(name)] += t / 1e3 / steps

    print(f"{summary}; kernels {device_ms:.2f} ms/step; device idle {max(0.0, wall_ms - device_ms):.2f} ms/step")
    for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:52s} {ms:7.3f} ms/step {ms / device_ms:6.1%}")
    print(f"\n{'kernel':90s} {'calls/step':>10s} {'us/step':>9s}")
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])
    for name, (t, n) in ranked[: args.top]:
        print(f"{name[:90]:90s} {n / steps:10.1f} {t / steps:9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"wall_ms_per_step": wall_ms, "device_ms_per_step": device_ms, "by_kind_ms": by_kind,
                       "kernels": {n: {"us_per_step": t / steps, "calls_per_step": c / steps}
                                   for n, (t, c) in ranked}}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
