"""The KV pool's release delay, engine alone: bursts through AsyncLLM in-process, three pool policies.

    python benchmarks/probe_pool_release.py --model /tmp/ponytail-smollm2-random   # one GPU
    python benchmarks/probe_pool_release.py --small                                # CPU sanity run

One engine replica's share of bench_router.py's placement-bound load (--long-per-burst 4
--long-per-replica 2): bursts of 8 requests, 2 of them 4,000-token prompts at random places and
the rest 64 tokens, 2 s apart, 128 output tokens each (EOS ignored), KV budget of 708 blocks.
Policies, in this order on one engine: spare memory given back at once (kv_release_after_s=0),
after 30 s (the default), never (pool grown to the budget first). Prints TTFT p50/max and the
pool's chunk allocations and releases with their time (grow/shrink wrapped with a timer), engine
steps and mean step time; writes JSON with --json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import sys
import time

import ponytail
from ponytail import SamplingParams
from ponytail.kv.paged_cache import PagedKVCache

TIMED = ("grow", "shrink", "defragment")


def time_pool_operations() -> dict[str, list]:
    """Wraps PagedKVCache's grow/shrink/defragment: {name: [calls, seconds]}, reset by the caller."""
    timers = {name: [0, 0.0] for name in TIMED}
    for name in TIMED:
        original = getattr(PagedKVCache, name)

        def timed(self, *args, _original=original, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                timers[_name][0] += 1
                timers[_name][1] += time.perf_counter() - start
        setattr(PagedKVCache, name, timed)
    return timers


async def bursts(llm, timers, sizes, seed) -> dict:
    engine = ponytail.AsyncLLM(llm)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=sizes["max_tokens"], ignore_eos=True, temperature=0)
    for timer in timers.values():
        timer[0], timer[1] = 0, 0.0
    ttfts: list[tuple[bool, float]] = []

    async def one(prompt, long):
        start, first = time.perf_counter(), None
        async for _ in engine.generate(prompt, params):
            if first is None:
                first = time.perf_counter() - start
        ttfts.append((long, first))

    tasks = []
    for _ in range(sizes["bursts"]):
        longs = set(rng.sample(range(sizes["burst"]), sizes["long_per_burst"]))
        for i in range(sizes["burst"]):
            length = sizes["long_len"] if i in longs else sizes["short_len"]
            prompt = [rng.randrange(1000, 40000) for _ in range(length)]
            tasks.append(asyncio.create_task(one(prompt, i in longs)))
        await asyncio.sleep(sizes["gap_s"])
    await asyncio.gather(*tasks)
    values = sorted(t for _, t in ttfts)
    return {"ttft_p50": statistics.median(values), "ttft_max": values[-1],
            "long_ttft_max": max(t for long, t in ttfts if long), "steps": engine.num_steps,
            "mean_step_ms": 1e3 * engine.step_seconds / max(1, engine.num_steps),
            "chunks_after": llm.engine.cache.num_chunks,
            **{f"{name}_calls": timers[name][0] for name in TIMED},
            **{f"{name}_ms": 1e3 * timers[name][1] for name in TIMED}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local checkpoint directory (default: the embedded default model)")
    parser.add_argument("--small", action="store_true", help="CPU sizes")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.small:
        sizes = dict(bursts=2, burst=4, long_per_burst=1, long_len=100, short_len=8, max_tokens=4, gap_s=0.3,
                     blocks=64, device="cpu")
    else:
        sizes = dict(bursts=6, burst=8, long_per_burst=2, long_len=4000, short_len=64, max_tokens=128, gap_s=2.0,
                     blocks=708, device="cuda")
    timers = time_pool_operations()
    llm = ponytail.LLM(args.model, device=sizes["device"], max_num_seqs=64, max_model_len=4224,
                       kv_cache_memory=f"{sizes['blocks'] * 16 * _bytes_per_token(args.model, sizes['device'])}")
    cache = llm.engine.cache
    asyncio.run(bursts(llm, timers, {**sizes, "bursts": 2}, seed=0))  # warm-up: graphs, cuDNN plans
    results = {}
    for policy, release_after_s in (("release_at_once", 0.0), ("release_after_30s", 30.0), ("never_release", None)):
        if release_after_s is None:
            cache.grow(cache.max_chunks)
            cache.release_after_s = 1e9  # longer than the run
        else:
            cache.release_after_s = release_after_s
        results[policy] = asyncio.run(bursts(llm, timers, sizes, seed=7))
        r = results[policy]
        print(f"{policy:18s} TTFT p50 {r['ttft_p50']:.3f} s, max {r['ttft_max']:.3f} s; chunk allocations "
              f"{r['grow_calls']} ({r['grow_ms']:.1f} ms), releases {r['shrink_calls']} ({r['shrink_ms']:.1f} ms); "
              f"{r['steps']} steps, mean {r['mean_step_ms']:.2f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sizes": sizes, "results": results}, f, indent=2)
    return 0


def _bytes_per_token(model, device) -> int:
    """KV bytes per token of the checkpoint in the engine's dtype there (bf16 on CUDA, fp32 on the CPU)."""
    from transformers import AutoConfig

    path = model or str(ponytail.models.loader.default_checkpoint())
    config = ponytail.CacheConfig.from_model(AutoConfig.from_pretrained(path, local_files_only=True),
                                             max_seq_len=4224, block_size=16, device="cpu")
    return dataclasses.replace(config, dtype="bf16" if device == "cuda" else "fp32").bytes_per_token


if __name__ == "__main__":
    sys.exit(main())
