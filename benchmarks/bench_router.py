"""Ponytail's routers against Serve's default power-of-two router, same workload, one run.

    python benchmarks/bench_router.py --model /tmp/ponytail-smollm2-random   # two GPUs, one replica each
    python benchmarks/bench_router.py --model /tmp/ponytail-smollm2-random --rounds 2 --gaps 1.0,1.5,2.0
    python benchmarks/bench_router.py --small                                # CPU sanity run, default model
    python benchmarks/bench_router.py --model /tmp/ponytail-smollm2-random --workload chat   # prefix affinity
    python benchmarks/bench_router.py --model /tmp/ponytail-smollm2-random --workload chat --replicas-per-gpu 2

Serve apps with identical engine replicas behind the separate OpenAI ingress differ only in their
request router (app_default: the app's default shape instead, the API on the engine replicas and
the free-block router in Serve's proxy). Each gets the same skewed workload through the OpenAI
API: long prompts (4k tokens on GPUs) among short ones, arriving in bursts, ignore_eos so every
request decodes max_tokens. Each replica's KV pool is
sized from the model's shape to hold only --long-per-replica long requests plus one burst of short
ones, so where the long prompts land decides who waits. Prompts are sent as token ids cut to an
exact length with the model's own tokenizer: both routers see their true size (for text the
KV-block router estimates ~3 characters per token).

--gaps sets the seconds between bursts, one load per value (new prompts for each, the same for
both routers), all on the same deployment: short gaps offer more than two replicas can serve
(both routers then only work through a backlog), longer ones less, where placement decides.
Rounds repeat everything with the routers' order reversed. --loads repeats each gap's load with
new prompts (or sessions) on the same deployment: an app's start costs ~40 s on an H200 and a load
12-40 s, so more loads are the cheaper way to more requests per router.

--workload chat runs multi-turn chat sessions instead (chat_workload.py: shared system prompts,
each turn extending the previous prompt and answer, through the chat API), with each replica's
pool holding --pool-share of all sessions' final contexts, and compares prefix, kv_blocks and
power_of_two by default. --chat-shape documents makes placement decide (the default shape's 4
system prompts end up cached on both replicas whatever the router does, and its turns are
decode-bound): 16 system prompts of 1,200 words (pasted documents), 200-word turns and 32-token
answers, so most of a turn's time is its prefill, and a turn that lands where its session's last
one ran prefills ~400 new tokens instead of up to ~2,000 of history; with --pool-share 0.25 the
documents alone (~38k tokens) fill most of a pool, so they too are cached where they were sent.
Every run reports its prefix hit rate: prompt tokens the engines found
cached over prompt tokens admitted, from the replicas' own counters.

Prints the KV budget, then per router, load and round: throughput (completion tokens/s), p50/p99
time to first token, failed requests, preemptions, and requests and prompt tokens taken by each
replica; then each router's rounds pooled per load (total tokens over total time, percentiles
over every request: one ~10 s round's p99 is a single request), and each router against power of
two with a bootstrap interval of its p99 ratio (how much the slowest requests alone decide it);
writes JSON with --json, every request's TTFT included, and every request the ingress router held
for want of room ([replica, blocks, seconds held], from OpenAIIngress.take_router_holds). --model:
a local checkpoint (random_checkpoint.py builds one for the GPU machine); default: the embedded
SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import socket
import statistics
import sys
import threading
import time

import openai
import ray
import yaml
from ray import serve
from transformers import AutoConfig, AutoTokenizer

import ponytail
from deployments.app.builder import build
from deployments.app.args import AppArgs
from serve_args import engine_names, known, nested
from deployments.app.reports import replica_reports

from chat_workload import ChatShape, run_chat, sessions as chat_sessions

MODEL = "SmolLM2-135M-Instruct"  # the model_id both apps serve, whatever the checkpoint
# --routers names -> the app's args that select them. Every one runs the same deployment: the
# separate OpenAI ingress in front of the engine replicas, which the prefix router needs (it reads
# the prompt; Serve's proxy shows a router none), so only the router differs.
_SAME_SHAPE = {"api_in_engines": False}
# App args every run sets from the command line (the model, the pool, the replica count): not
# overridable per router.
_SET_BY_BENCH = {"model", "model_id", "kv_cache_memory", "max_model_len", "min_replicas", "max_replicas", "device",
                 "num_gpus", "router", "api_in_engines"}
ROUTER_ARGS = {
    "kv_blocks": {"router": "kv_blocks", **_SAME_SHAPE},
    "prefix": {"router": "prefix", **_SAME_SHAPE},  # kv_blocks plus prefix-cache affinity (deployments/prefix_router.py)
    "power_of_two": {"router": "power_of_two", **_SAME_SHAPE},  # Serve's default
    "kv_blocks_nohold": {"router": "kv_blocks", "max_hold_s": 0, **_SAME_SHAPE},  # never waits in the router
    "kv_blocks_per_token": {"router": "kv_blocks", "stream_interval_s": 0, **_SAME_SHAPE},  # a Ray message per token
    # The app's default shape instead: the engine replicas serve the API, the proxy places requests
    # by free blocks alone (it cannot see the prompt). What a user gets without choosing a router.
    "app_default": {"router": "kv_blocks", "api_in_engines": True},
}
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
BLOCK = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt_ids(tokenizer, length, rng) -> list[int]:
    """`length` token ids of random words: every word is at least one token, so `length` words suffice."""
    ids = tokenizer(" ".join(rng.choice(WORDS) for _ in range(length)), add_special_tokens=False).input_ids
    assert len(ids) >= length, (len(ids), length)
    return ids[:length]


def workload(tokenizer, n, long_share, long_len, short_len, seed, burst=None, long_per_burst=None):
    """n prompts: each long with probability long_share, or, with long_per_burst, exactly that many
    long ones in every burst of `burst`, at random places."""
    rng = random.Random(seed)
    if long_per_burst is None:
        lengths = [long_len if rng.random() < long_share else short_len for _ in range(n)]
    else:
        lengths = []
        for start in range(0, n, burst):
            size = min(burst, n - start)
            longs = set(rng.sample(range(size), min(long_per_burst, size)))
            lengths += [long_len if i in longs else short_len for i in range(size)]
    return [prompt_ids(tokenizer, length, rng) for length in lengths]


def kv_budget(model_dir, device, long_per_replica, sizes) -> dict:
    """Bytes per replica for `long_per_replica` long requests plus one burst of short ones, whole blocks."""
    tokens = (long_per_replica * (sizes["long_len"] + sizes["max_tokens"])
              + sizes["burst"] * (sizes["short_len"] + sizes["max_tokens"]))
    return budget_for_tokens(model_dir, device, tokens, sizes["max_model_len"])


def budget_for_tokens(model_dir, device, tokens, max_model_len) -> dict:
    """Bytes per replica for a pool of `tokens` (whole blocks) in the engine's dtype."""
    dtype = "bf16" if device == "cuda" else "fp32"  # what ponytail.LLM loads the model in there
    config = ponytail.CacheConfig.from_model(AutoConfig.from_pretrained(model_dir, local_files_only=True),
                                             max_seq_len=max_model_len, block_size=BLOCK, device="cpu")
    config = dataclasses.replace(config, dtype=dtype)  # the shape from the checkpoint, the dtype of the engine
    blocks = -(-tokens // BLOCK)
    return {"bytes": blocks * config.block_bytes, "tokens": blocks * BLOCK, "blocks": blocks,
            "bytes_per_token": config.bytes_per_token, "dtype": dtype}


def run_load(base_url, prompts, max_tokens, burst, gap_s, long_len=None):
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=600, max_retries=0)
    results = [None] * len(prompts)

    def one(index, prompt):
        start = time.perf_counter()
        first, tokens = None, 0
        try:
            stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
                                               temperature=0, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True})
            for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = time.perf_counter() - start
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            results[index] = {"ok": True, "ttft": first, "end": time.perf_counter(), "tokens": tokens,
                              "long": len(prompt) == long_len}
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
    timed = [r for r in done if r["ttft"] is not None]
    ttfts = sorted(r["ttft"] for r in timed)
    return {"requests": len(prompts), "failed": len(prompts) - len(done),
            "errors": [r["error"] for r in results if r and not r["ok"]][:3],
            "tokens": sum(r["tokens"] for r in done), "tokens_per_s": sum(r["tokens"] for r in done) / elapsed,
            "seconds": elapsed, "ttfts": ttfts, "ttfts_long": [r["ttft"] for r in timed if r["long"]],
            **ttft_percentiles(ttfts)}


def percentile(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def ratio_interval(values: list[float], baseline: list[float], q: float, draws: int = 2000, seed: int = 0,
                   level: float = 0.9) -> tuple[float, float] | None:
    """A bootstrap interval for percentile(values, q) / percentile(baseline, q): each side's requests
    resampled with replacement, `level` of the draws' ratios inside. One round's p99 is its slowest
    request or two, so a p99 ratio means little without it."""
    if not values or not baseline:
        return None
    import numpy as np

    rng = np.random.default_rng(seed)

    def draws_of(samples: list[float]) -> np.ndarray:
        picked = np.sort(rng.choice(np.asarray(samples, dtype=float), size=(draws, len(samples))), axis=1)
        return picked[:, min(len(samples) - 1, int(q * len(samples)))]  # percentile()'s index

    ratios = draws_of(values) / draws_of(baseline)
    tail = (1 - level) / 2
    return float(np.quantile(ratios, tail)), float(np.quantile(ratios, 1 - tail))


def ttft_percentiles(ttfts: list[float], prefix: str = "ttft") -> dict:
    return {f"{prefix}_p50": statistics.median(ttfts) if ttfts else None,
            f"{prefix}_p90": percentile(ttfts, 0.90), f"{prefix}_p99": percentile(ttfts, 0.99)}


def pooled(runs: list[dict]) -> dict:
    """One router's rounds together: total tokens over total time, percentiles of every request
    and of the long-prompt requests alone (where placement shows first)."""
    ttfts = [t for r in runs for t in r["ttfts"]]
    longs = [t for r in runs for t in r["ttfts_long"]]
    queries = sum(sum(r["replica_prompt_tokens"]) for r in runs)
    engine = [r["engine_ttft_s"] for r in runs if r.get("engine_ttft_s") is not None]
    queue = [r["engine_queue_s"] for r in runs if r.get("engine_queue_s") is not None]
    admit = [r["admit_s"] for r in runs if r.get("admit_s") is not None]
    waits = [seconds for r in runs for _, _, seconds in (r.get("held") or [])]
    return {"rounds": len(runs), "requests": sum(r["requests"] for r in runs),
            "held": len(waits), "held_mean_s": statistics.fmean(waits) if waits else None,
            "held_max_s": max(waits, default=None),
            "engine_ttft_mean": statistics.fmean(engine) if engine else None,
            "engine_queue_mean": statistics.fmean(queue) if queue else None,
            "admit_mean": statistics.fmean(admit) if admit else None,
            "prefix_hit_rate": sum(sum(r["replica_prefix_hits"]) for r in runs) / queries if queries else 0.0,
            "ttft_mean": statistics.fmean(ttfts) if ttfts else None,
            "failed": sum(r["failed"] for r in runs), "preemptions": sum(r["preemptions"] for r in runs),
            "tokens_per_s": sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs),
            **ttft_percentiles(ttfts), **ttft_percentiles(longs, "long_ttft")}


def over_capacity_bursts(prompts: list[list[int]], burst: int, long_len: int, long_per_replica: int) -> list[int]:
    """Long prompts per burst, for the bursts with more than both replicas' pools hold together:
    those wait for a long request to finish whatever the router does."""
    counts = [sum(len(p) == long_len for p in prompts[i : i + burst]) for i in range(0, len(prompts), burst)]
    return [c for c in counts if c > 2 * long_per_replica]


def router_holds(app_name) -> list[list] | None:
    """[replica, blocks, seconds] of each request the app's ingress router held for want of room
    since the last call (OpenAIIngress.take_router_holds); None where the ingress has no such call."""
    try:
        held = serve.get_app_handle(app_name).take_router_holds.remote().result(timeout_s=30)
    except Exception:  # noqa: BLE001 - the API on the engine replicas: no ingress router to ask
        return None
    return [[h.replica, h.blocks, round(h.seconds, 4)] for h in held]


def replica_counters(app_name) -> dict[str, tuple]:
    """{replica: (requests taken, prompt tokens admitted, preemptions, engine steps, their seconds,
    prompt tokens found in the prefix cache, seconds from generate calls to the engine taking them,
    seconds from the engine taking requests to their first tokens, requests in those, and the part
    of those seconds before their first steps)} so far."""
    return {name: (r.num_requests, r.stats.prefix_cache_queries, r.stats.num_preemptions, r.num_steps,
                   r.step_seconds, r.stats.prefix_cache_hits, r.admit_seconds, r.ttft_seconds, r.num_ttft,
                   r.queue_seconds)
            for name, r in replica_reports(app_name, replicas=2).items()}


def router_args(name: str) -> dict | None:
    """The app args of a --routers name: one of ROUTER_ARGS, or prefix@W (the prefix router with
    prefix_weight W), either optionally followed by app args (`prefix:prefill_delay_factor=0;
    compile_model=true`, YAML values); None when the name is none of these. Raises ValueError,
    naming it, for an app arg AppArgs does not take or one the benchmark sets itself."""
    name, sep, rest = name.partition(":")
    if name in ROUTER_ARGS:
        base = ROUTER_ARGS[name]
    else:
        router, _, weight = name.partition("@")
        try:
            base = {**ROUTER_ARGS[router], "prefix_weight": float(weight)} if router == "prefix" and weight else None
        except ValueError:
            base = None
    if base is None or not sep:
        return base
    extra = {}
    for item in filter(None, rest.split(";")):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not known(key, AppArgs.model_fields) or key in _SET_BY_BENCH:
            allowed = sorted((set(AppArgs.model_fields) | engine_names()) - _SET_BY_BENCH - {"engine"})
            raise ValueError(f"--routers {name + sep + rest!r}: expected key=value with an app arg the benchmark "
                             f"does not set itself; got {item!r} (allowed: {', '.join(allowed)})")
        extra[key] = yaml.safe_load(value)
    return {**base, **extra}


def gap_list(text: str) -> list[float]:
    try:
        gaps = [float(g) for g in text.split(",")]
    except ValueError:
        gaps = []
    if not gaps or any(not g >= 0 for g in gaps):
        raise argparse.ArgumentTypeError(f"--gaps {text!r}: expected seconds >= 0, comma-separated")
    return gaps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="CPU sizes")
    parser.add_argument("--model", help="local checkpoint directory (default: the embedded default model)")
    parser.add_argument("--requests", type=int, default=96, help="requests per load")
    parser.add_argument("--long-per-replica", type=int, default=3,
                        help="long requests (prompt + max_tokens) one replica's KV pool holds at once (default 3: "
                        "no burst of the default loads brings more than both pools hold, so placement decides)")
    parser.add_argument("--long-per-burst", type=int,
                        help="exactly this many long prompts in every burst, at random places (default: each "
                        "prompt long with probability 1/4)")
    parser.add_argument("--gaps", type=gap_list, help="seconds between bursts, one load each "
                        "(default: 1.0 on GPUs, 0.5 --small)")
    parser.add_argument("--routers", help=f"order of the runs in the first round (later rounds reverse it); "
                        f"from {', '.join(ROUTER_ARGS)}, prefix@W (the prefix router at prefix_weight W), each "
                        "optionally with app args after a colon (prefix:prefill_delay_factor=0;compile_model=true) "
                        "(default: kv_blocks,power_of_two; --workload chat: prefix,kv_blocks,power_of_two)")
    parser.add_argument("--loads", type=int, default=1,
                        help="loads per gap, each with its own prompts or sessions, one after another on the same "
                        "deployment; pooled with the gap's other loads")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of every router, the order reversed every round; results pooled")
    parser.add_argument("--workload", choices=("mix", "chat"), default="mix",
                        help="mix: long and short prompts in bursts (the default); chat: multi-turn sessions "
                        "sharing system prompts (chat_workload.py), --gaps then being seconds between session starts")
    parser.add_argument("--sessions", type=int, help="chat: sessions per load (default 48, 4 --small)")
    parser.add_argument("--chat-shape", choices=("turns", "documents"), default="turns",
                        help="chat on GPUs: turns (4 system prompts of 700 words, 128-token answers) or documents "
                        "(16 of 1,200 words, 32-token answers: prefill-heavy, placement decides; see above)")
    parser.add_argument("--pool-share", type=float, default=0.5,
                        help="chat: each replica's KV pool holds this share of all sessions' final contexts "
                        "(default 0.5: the two pools hold them all only if no prefix is cached twice)")
    parser.add_argument("--replicas-per-gpu", type=int, default=1, choices=(1, 2),
                        help="2: both replicas on one GPU (num_gpus 0.5 each, each with the KV budget below)")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="run nothing: pool the runs of earlier --json files of one workload (each file's "
                        "rounds renumbered after the previous file's) and report them as one run")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.merge:
        try:
            return report_merged(args.merge, args.json)
        except (OSError, ValueError, KeyError) as error:
            parser.error(f"--merge: {error}")
    if args.loads < 1:
        parser.error(f"--loads {args.loads}: expected at least 1 load per gap")
    if args.long_per_burst is not None and args.long_per_burst < 0:
        parser.error(f"--long-per-burst {args.long_per_burst}: expected 0 or more")
    if args.sessions is not None and args.sessions < 1:
        parser.error(f"--sessions {args.sessions}: expected 1 or more")
    if not 0 < args.pool_share <= 4:
        parser.error(f"--pool-share {args.pool_share}: expected more than 0 and at most 4")
    chat = args.workload == "chat"
    routers = (args.routers or ("prefix,kv_blocks,power_of_two" if chat else "kv_blocks,power_of_two")).split(",")
    try:
        unknown = [r for r in routers if router_args(r) is None]
    except ValueError as error:
        parser.error(str(error))
    if unknown:
        parser.error(f"--routers: unknown {unknown}; allowed: {', '.join(ROUTER_ARGS)}, prefix@W (prefix_weight W), "
                     "each optionally with app args (name:key=value;key=value)")
    if args.small:
        sizes = dict(n=16, long_share=0.25, long_len=300, short_len=20, max_tokens=16, burst=4, max_model_len=1024)
        shape = ChatShape(sessions=args.sessions or 4, turns=3, system_prompts=2, system_words=60, user_words=10,
                          max_tokens=8, session_gap_s=0.3, think_s=0.2)
        engine = dict(device="cpu", max_num_seqs=8)
        gaps = args.gaps or [shape.session_gap_s if chat else 0.5]
    else:
        sizes = dict(n=args.requests, long_share=0.25, long_len=4000, short_len=64, max_tokens=128, burst=16,
                     max_model_len=4224)
        shape = (ChatShape(sessions=args.sessions or 48, turns=4, system_prompts=16, system_words=1200,
                           user_words=200, max_tokens=32, session_gap_s=0.1, think_s=0.5)
                 if args.chat_shape == "documents" else
                 ChatShape(sessions=args.sessions or 48, turns=4, system_prompts=4, system_words=700, user_words=100,
                           max_tokens=128, session_gap_s=0.1, think_s=0.5))
        # compile_model off: it speeds every router's engines alike and would add a compile to each app's start.
        engine = dict(device="cuda", max_num_seqs=64, num_gpus=1 / args.replicas_per_gpu, compile_model=False)
        gaps = args.gaps or [shape.session_gap_s if chat else 1.0]
    assert sizes["long_len"] + sizes["max_tokens"] <= sizes["max_model_len"]
    assert shape.context_tokens <= sizes["max_model_len"]
    model_dir = args.model or str(ponytail.models.loader.default_checkpoint())
    if chat:
        pool = max(int(args.pool_share * shape.sessions * shape.context_tokens), 2 * shape.context_tokens)
        budget = budget_for_tokens(model_dir, engine["device"], pool, sizes["max_model_len"])
        what = (f"{args.pool_share} x {shape.sessions} sessions x ~{shape.context_tokens} tokens (system prompt + "
                f"{shape.turns} turns of ~{2 * shape.user_words} + {shape.max_tokens} tokens)")
    else:
        budget = kv_budget(model_dir, engine["device"], args.long_per_replica, sizes)
        what = (f"{args.long_per_replica} x ({sizes['long_len']} + {sizes['max_tokens']}) long + "
                f"{sizes['burst']} x ({sizes['short_len']} + {sizes['max_tokens']}) short")
    engine.update(model=args.model, model_id=MODEL, kv_cache_memory=budget["bytes"],
                  max_model_len=sizes["max_model_len"])
    print(f"KV cache per replica: {budget['bytes'] / 2**20:.1f} MiB = {budget['blocks']} blocks = "
          f"{budget['tokens']} tokens at {budget['bytes_per_token']} bytes/token ({budget['dtype']}): {what}")

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    gaps = list(dict.fromkeys(gaps))
    schedule = [gap for gap in gaps for _ in range(args.loads)]  # each load's gap, in order
    if chat:
        loads = [(gap, chat_sessions(shape, seed=index)) for index, gap in enumerate(schedule)]
        for gap, conversations in loads:
            print(f"load: {len(conversations)} chat sessions {gap} s apart, {shape.turns} turns each "
                  f"({shape.think_s} s between a session's turns), {shape.system_prompts} system prompts of "
                  f"{shape.system_words} words shared round-robin, {shape.max_tokens} tokens per answer")
    else:
        loads = [(gap, workload(tokenizer, sizes["n"], sizes["long_share"], sizes["long_len"], sizes["short_len"],
                                seed=index, burst=sizes["burst"], long_per_burst=args.long_per_burst))
                 for index, gap in enumerate(schedule)]  # other prompts per load: no prefix hits
        for gap, prompts in loads:
            over = over_capacity_bursts(prompts, sizes["burst"], sizes["long_len"], args.long_per_replica)
            print(f"load gap {gap} s: {len(prompts)} prompts in bursts of {sizes['burst']}, "
                  f"{sum(len(p) == sizes['long_len'] for p in prompts)} long ({sizes['long_len']} tokens, the rest "
                  f"{sizes['short_len']}), + max_tokens {sizes['max_tokens']}; {len(over)} of "
                  f"{-(-len(prompts) // sizes['burst'])} bursts bring more long prompts {over} than the two pools "
                  f"hold ({2 * args.long_per_replica})")
    warmup = [prompt_ids(tokenizer, n, random.Random(1000 + i))
              for i, n in enumerate([sizes["long_len"], sizes["short_len"]] * 2)]

    # Logical CPUs: two engine replicas, the ingress and the proxy must fit even on a 2-core machine.
    ray.init(num_cpus=max(os.cpu_count() or 1, 8), include_dashboard=False, log_to_driver=False)
    port = free_port()  # after Ray's own processes took their ports (one of them took a port picked before)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    runs: dict[str, list[dict]] = {}
    try:
        for round_index in range(args.rounds):
            for router in routers if round_index % 2 == 0 else routers[::-1]:
                path = re.sub(r"[^A-Za-z0-9_.-]+", "-", router.replace("@", "-w")).strip("-")
                name = f"ponytail-{path}"
                serve.run(build(nested({**engine, **router_args(router), "min_replicas": 2, "max_replicas": 2})), name=name,
                          route_prefix=f"/{path}")
                base = f"http://127.0.0.1:{port}/{path}/v1"
                run_load(base, warmup, 4, len(warmup), 0)  # compile, first pool growth
                for load_index, (gap, prompts) in enumerate(loads):
                    router_holds(name)  # what the warm-up or the previous load left
                    before = replica_counters(name)
                    if chat:
                        result = run_chat(base, MODEL, prompts, dataclasses.replace(shape, session_gap_s=gap))
                        result.update(ttft_percentiles(result["ttfts"]))
                    else:
                        result = run_load(base, prompts, sizes["max_tokens"], sizes["burst"], gap, sizes["long_len"])
                    after = replica_counters(name)
                    held = router_holds(name)
                    deltas = [[a - b for a, b in zip(after[replica], before[replica])] for replica in sorted(after)]
                    queries, hits = sum(d[1] for d in deltas), sum(d[5] for d in deltas)
                    taken, first_tokens = sum(d[0] for d in deltas), sum(d[8] for d in deltas)
                    result.update(round=round_index, load=load_index, gap=gap, held=held,
                                  replica_requests=[d[0] for d in deltas],
                                  replica_prompt_tokens=[d[1] for d in deltas],
                                  replica_prefix_hits=[d[5] for d in deltas],
                                  prefix_hit_rate=hits / queries if queries else 0.0,
                                  preemptions=sum(d[2] for d in deltas), replica_steps=[d[3] for d in deltas],
                                  replica_step_ms=[round(1e3 * d[4] / d[3], 2) if d[3] else None for d in deltas],
                                  replica_busy=[round(d[4] / result["seconds"], 3) for d in deltas],
                                  # the client's TTFT split: the replica's tokenizing, then the engine
                                  admit_s=sum(d[6] for d in deltas) / taken if taken else None,
                                  engine_ttft_s=sum(d[7] for d in deltas) / first_tokens if first_tokens else None,
                                  engine_queue_s=sum(d[9] for d in deltas) / first_tokens if first_tokens else None)
                    runs.setdefault(router, []).append(result)
                serve.delete(name)
    finally:
        serve.shutdown()
        ray.shutdown()
    results = {router: {str(gap): pooled([r for r in router_runs if r["gap"] == gap]) for gap in gaps}
               for router, router_runs in runs.items()}
    report(runs, results, gaps, args.rounds, chat)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": args.workload, "sizes": sizes, "chat": dataclasses.asdict(shape) if chat else None,
                       "gaps": gaps, "engine": engine, "kv_budget": budget, "pooled": results, "runs": runs},
                      f, indent=2)
    return 1 if any(r["failed"] for per_gap in results.values() for r in per_gap.values()) else 0


def report_merged(paths: list[str], out: str | None) -> int:
    """--merge: earlier runs of one workload pooled and reported as one (the comparisons pair each
    file's own rounds and loads)."""
    runs: dict[str, list[dict]] = {}
    gaps: list[float] = []
    rounds, first = 0, None
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if first is None:
            first = data
        elif (data["workload"], data["sizes"]) != (first["workload"], first["sizes"]):
            raise ValueError(f"{path} ran another workload or other sizes than {paths[0]}")
        file_rounds = 1 + max((r["round"] for router_runs in data["runs"].values() for r in router_runs), default=-1)
        for router, router_runs in data["runs"].items():
            runs.setdefault(router, []).extend({**r, "round": r["round"] + rounds} for r in router_runs)
        rounds += file_rounds
        gaps += [gap for gap in data["gaps"] if gap not in gaps]
    results = {router: {str(gap): pooled([r for r in router_runs if r["gap"] == gap]) for gap in gaps
                        if any(r["gap"] == gap for r in router_runs)} for router, router_runs in runs.items()}
    print(f"merged {len(paths)} files: {', '.join(paths)}")
    report(runs, results, gaps, rounds, first["workload"] == "chat")
    if out:
        with open(out, "w") as f:
            json.dump({**first, "merged": paths, "gaps": gaps, "pooled": results, "runs": runs}, f, indent=2)
    return 0


def report(runs: dict[str, list[dict]], results: dict[str, dict[str, dict]], gaps: list[float], rounds: int,
           chat: bool) -> None:
    """Per run, then pooled per router and load, then each router against power of two."""
    print(f"\n{'gap':>4s} {'round':>5s} {'router':14s} {'tok/s':>8s} {'TTFT p50':>9s} {'p99':>8s} {'hits':>6s} "
          f"{'failed':>7s} {'preempt':>8s}  per replica: requests, prompt tokens")
    for gap in gaps:
        for router, router_runs in runs.items():
            for r in (r for r in router_runs if r["gap"] == gap):
                print(f"{gap:4.1f} {r['round']:3d}.{r['load']:<1d} {router:14s} {r['tokens_per_s']:8.1f} "
                      f"{r['ttft_p50'] or float('nan'):9.3f} {r['ttft_p99'] or float('nan'):8.3f} "
                      f"{r['prefix_hit_rate']:6.1%} {r['failed']:7d} "
                      f"{r['preemptions']:8d}  {r['replica_requests']}, {r['replica_prompt_tokens']}")
                print(f"{'':26s}engine steps {r['replica_steps']}, mean step ms {r['replica_step_ms']}, "
                      f"busy {r['replica_busy']} of the load's time")
                if r.get("held"):
                    waits = [seconds for _, _, seconds in r["held"]]
                    print(f"{'':26s}held in the router: {len(waits)} requests, mean {statistics.fmean(waits):.3f} s, "
                          f"max {max(waits):.3f} s")
                if r.get("engine_ttft_s") is not None and r["ttfts"]:
                    print(f"{'':26s}mean TTFT {statistics.fmean(r['ttfts']):.3f} s at the client: replica admission "
                          f"(tokenizing) {r['admit_s']:.3f} s, engine {r['engine_ttft_s']:.3f} s (waiting for a first "
                          f"step {r['engine_queue_s']:.3f} s, then prefill to first token)")
                for error in r["errors"]:
                    print(f"  error: {error}")
    nan = float("nan")
    print(f"\npooled over {rounds} round(s):")
    for gap in gaps:
        for router, per_gap in results.items():
            r = per_gap[str(gap)]
            print(f"  gap {gap:.1f} s {router:16s} {r['tokens_per_s']:8.1f} tok/s, "
                  f"TTFT mean {r['ttft_mean'] or nan:.3f} "
                  f"p50/p90/p99 {r['ttft_p50'] or nan:.3f}/{r['ttft_p90'] or nan:.3f}/{r['ttft_p99'] or nan:.3f} s"
                  + ("" if chat else f" (long prompts {r['long_ttft_p50'] or nan:.3f}/{r['long_ttft_p90'] or nan:.3f}/"
                                     f"{r['long_ttft_p99'] or nan:.3f} s)")
                  + f", prefix hits {r['prefix_hit_rate']:.1%} of prompt tokens, {r['failed']} failed, "
                  f"{r['preemptions']} preemptions"
                  + ("" if r["engine_ttft_mean"] is None else
                     f"; of the mean TTFT: replica admission {r['admit_mean']:.3f} s, "
                     f"engine {r['engine_ttft_mean']:.3f} s (waiting for a first step "
                     f"{r['engine_queue_mean']:.3f} s)"))
        p2 = results.get("power_of_two", {}).get(str(gap))
        for router, per_gap in results.items():
            r = per_gap[str(gap)]
            if router == "power_of_two" or not p2 or not (r["ttft_p99"] and p2["ttft_p99"] and r["ttft_mean"]):
                continue
            p99 = 100 * (1 - r["ttft_p99"] / p2["ttft_p99"])
            mean = 100 * (1 - r["ttft_mean"] / p2["ttft_mean"])
            speed = r["tokens_per_s"] / p2["tokens_per_s"]
            interval = ratio_interval(*(pooled_ttfts(runs.get(name, []), gap) for name in (router, "power_of_two")),
                                      q=0.99)
            r["p99_vs_power_of_two"] = {"ratio": r["ttft_p99"] / p2["ttft_p99"], "interval_90": interval}
            spread = "" if interval is None else f" (90% bootstrap interval of the ratio {interval[0]:.2f}-{interval[1]:.2f})"
            print(f"  gap {gap:.1f} s: {router} against power_of_two: throughput {speed:.2f}x, "
                  f"mean TTFT {abs(mean):.0f}% {'lower' if mean >= 0 else 'higher'}, "
                  f"p99 TTFT {abs(p99):.0f}% {'lower' if p99 >= 0 else 'higher'}{spread}")
            changes = mean_ttft_changes(runs.get(router, []), runs.get("power_of_two", []), gap)
            if len(changes) > 1:  # how far single rounds stray from the pooled figure
                print("    mean TTFT against power_of_two's same round and load, one by one: "
                      + ", ".join(f"{c:+.0%}" for c in changes))


def pooled_ttfts(router_runs: list[dict], gap: float) -> list[float]:
    return [t for r in router_runs if r["gap"] == gap for t in r["ttfts"]]


def mean_ttft_changes(router_runs: list[dict], baseline_runs: list[dict], gap: float) -> list[float]:
    """Per round and load at this gap: the router's mean TTFT over the baseline's on the same load
    in the same round, minus 1."""
    base = {(r["round"], r["load"]): statistics.fmean(r["ttfts"])
            for r in baseline_runs if r["gap"] == gap and r["ttfts"]}
    return [statistics.fmean(r["ttfts"]) / base[r["round"], r["load"]] - 1
            for r in router_runs if r["gap"] == gap and r["ttfts"] and (r["round"], r["load"]) in base]


if __name__ == "__main__":
    sys.exit(main())
