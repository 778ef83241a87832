"""The KV-block router against Serve's default power-of-two router, same workload, one run.

    python benchmarks/bench_router.py                 # two GPUs: one engine replica per GPU, 4k-token long prompts
    python benchmarks/bench_router.py --small         # CPU sanity run: two CPU replicas, small sizes

Two Serve apps with identical engine replicas differ only in their request router. Each gets the
same skewed workload (a share of long prompts among short ones, arriving in bursts) through the
OpenAI API; the script prints throughput, p50/p99 time to first token, failed requests and the
replicas' preemptions, and writes JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import threading
import time

import openai
import ray
from ray import serve

from deployments.app import build

MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload(n, long_share, long_len, short_len, seed=0):
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    prompts = []
    for _ in range(n):
        length = long_len if rng.random() < long_share else short_len
        prompts.append(" ".join(rng.choice(words) for _ in range(length)))  # ~1 token per word
    return prompts


def run_load(base_url, prompts, max_tokens, burst, gap_s):
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=600, max_retries=0)
    results = [None] * len(prompts)

    def one(index, prompt):
        start = time.perf_counter()
        first = None
        try:
            stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
                                               temperature=0, extra_body={"ignore_eos": True})
            tokens = 0
            for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = time.perf_counter() - start
                tokens += 1
            results[index] = {"ok": True, "ttft": first, "end": time.perf_counter(), "tokens": tokens}
        except Exception as exc:  # counted as a failure, not hidden
            results[index] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:200]}

    threads = []
    t0 = time.perf_counter()
    for index, prompt in enumerate(prompts):
        if index and index % burst == 0:
            time.sleep(gap_s)
        thread = threading.Thread(target=one, args=(index, prompt))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(timeout=900)
    done = [r for r in results if r and r["ok"]]
    elapsed = max((r["end"] for r in done), default=time.perf_counter()) - t0
    ttfts = sorted(r["ttft"] for r in done if r["ttft"] is not None)
    return {"requests": len(prompts), "failed": len(prompts) - len(done),
            "errors": [r["error"] for r in results if r and not r["ok"]][:3],
            "tokens_per_s": sum(r["tokens"] for r in done) / elapsed, "seconds": elapsed,
            "ttft_p50": statistics.median(ttfts) if ttfts else None,
            "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None}


def preemptions(app_name):
    handle = serve.get_deployment_handle("EngineReplica", app_name=app_name)
    seen = {}
    for _ in range(40):
        name, stats = handle.engine_stats.remote().result()
        seen[name] = stats.num_preemptions
        if len(seen) == 2:
            break
    return sum(seen.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--routers", default="kv_blocks,power_of_two",
                        help="order of the runs (run both orders to see warm-up effects)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.small:
        sizes = dict(n=16, long_share=0.25, long_len=300, short_len=20, max_tokens=16, burst=4, gap_s=0.5)
        engine = dict(device="cpu", kv_cache_memory="64MiB", max_num_seqs=8, max_model_len=1024)
    else:
        sizes = dict(n=args.requests, long_share=0.25, long_len=4000, short_len=64, max_tokens=128, burst=16,
                     gap_s=1.0)
        engine = dict(device="cuda", kv_cache_memory="2GiB", max_num_seqs=64, max_model_len=4608)
    port = free_port()
    # Logical CPUs: two engine replicas, the ingress and the proxy must fit even on a 2-core machine.
    ray.init(num_cpus=max(os.cpu_count() or 1, 8), include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    prompts = workload(sizes["n"], sizes["long_share"], sizes["long_len"], sizes["short_len"])
    results = {}
    for router in args.routers.split(","):
        name = f"ponytail-{router}"
        serve.run(build({**engine, "router": router, "min_replicas": 2, "max_replicas": 2}), name=name,
                  route_prefix=f"/{router}")
        base = f"http://127.0.0.1:{port}/{router}/v1"
        run_load(base, prompts[:4], 4, 4, 0)  # warm-up: compile, first allocations
        before = preemptions(name)
        results[router] = run_load(base, prompts, sizes["max_tokens"], sizes["burst"], sizes["gap_s"])
        results[router]["preemptions"] = preemptions(name) - before
        serve.delete(name)
    serve.shutdown()
    ray.shutdown()
    print(f"\n{'router':14s} {'tok/s':>8s} {'TTFT p50':>9s} {'p99':>8s} {'failed':>7s} {'preempt':>8s}")
    for router, r in results.items():
        print(f"{router:14s} {r['tokens_per_s']:8.1f} {r['ttft_p50'] or float('nan'):9.3f} "
              f"{r['ttft_p99'] or float('nan'):8.3f} {r['failed']:7d} {r['preemptions']:8d}")
    kv, p2 = results["kv_blocks"], results["power_of_two"]
    print(f"throughput ratio kv/p2c {kv['tokens_per_s'] / p2['tokens_per_s']:.2f}x; "
          f"p99 TTFT {100 * (1 - kv['ttft_p99'] / p2['ttft_p99']):.0f}% lower" if kv["ttft_p99"] and p2["ttft_p99"]
          else "")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sizes": sizes, "engine": engine, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
