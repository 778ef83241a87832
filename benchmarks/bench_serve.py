"""End-to-end load on any OpenAI-compatible server: streaming chat completions, chat-like lengths.

    serve run deployments/app.yaml                       # Ponytail on :8000
    vllm serve /tmp/ponytail-7b-random --port 8001        # vLLM's server, same model
    python benchmarks/bench_serve.py --url http://127.0.0.1:8000/v1 --concurrency 64,256 --requests 512
    python benchmarks/bench_serve.py --compare http://127.0.0.1:8000/v1,http://127.0.0.1:8001/v1 --json serve.json

Requests follow peer_workloads.mixed_lengths (the distribution bench_engine's mixed workload uses,
same seed, same requests for every server): a prompt of that many words (common words, about one
token each, the chat template adds a few) and exactly that many output tokens (`max_tokens`, plus
vLLM's `ignore_eos` and `min_tokens` extras, which Ponytail's API accepts too). At each concurrency,
`--requests` requests go out with at most that many in flight. Reported per server and concurrency:
output tokens/s (completion tokens from the stream's usage over the wall time), TTFT and inter-token
latency p50/p90/p99 (ITL: gaps between content chunks), errors. --compare runs the servers back to
back, one concurrency at a time, and prints A/B ratios.

--workload cpu-chat is issue 14's wave for a CPU server of the default model: prompts log-normal
around 60 words (sigma 0.7) with one in twenty 1,000-3,000 words long (a pasted document), outputs
log-normal around 48 tokens, 8-256; the issue saw 0 of 300 such requests finish in 14 minutes at
concurrency 32 before the CPU attention and chunking work.

    serve run deployments/app.yaml      # on a machine without a GPU
    python benchmarks/bench_serve.py --url http://127.0.0.1:8000/v1 --workload cpu-chat --concurrency 32 --requests 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from pathlib import Path

import openai
from rich.console import Console
from rich.table import Table

from peer_workloads import mixed_lengths

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there one all we their can has more will would so time no if out up said what its "
         "about into than them only other new some could these two may first then do any like my now over such our "
         "man me even most made after also did many before must through back years where much your way well down "
         "should because each just those people how too little state good very make world still own see men work "
         "long get here between both life being under never day same another know while last might us great old").split()
PERCENTILES = (0.5, 0.9, 0.99)


def percentile(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


CPU_CHAT_LONG_SHARE, CPU_CHAT_LONG = 0.05, (1000, 3000)


def cpu_chat_lengths(n: int, seed: int, max_len: int | None) -> list[tuple[int, int]]:
    """(prompt words, output tokens) of the cpu-chat workload (module docstring), seeded."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        long = rng.random() < CPU_CHAT_LONG_SHARE
        prompt = rng.randint(*CPU_CHAT_LONG) if long else max(4, round(rng.lognormvariate(math.log(60), 0.7)))
        output = min(max(round(rng.lognormvariate(math.log(48), 0.6)), 8), 256)
        if max_len is not None:
            prompt = min(prompt, max_len - output)
        pairs.append((prompt, output))
    return pairs


def requests_for(n: int, seed: int, max_len: int | None, scale: int, workload: str = "mixed") -> list[tuple[str, int]]:
    """(prompt text, output tokens) per request; the same for a seed on every server."""
    rng = random.Random(seed)
    lengths = cpu_chat_lengths(n, seed, max_len) if workload == "cpu-chat" else mixed_lengths(n, seed, max_len, scale)
    return [(" ".join(rng.choice(WORDS) for _ in range(prompt)), output) for prompt, output in lengths]


async def one_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    stamps, tokens = [], None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "min_tokens": max_tokens})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.perf_counter())
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as exc:  # counted and shown, never hidden
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    end = time.perf_counter()
    return {"ok": True, "ttft": stamps[0] - start if stamps else None, "end": end,
            "itl": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": tokens if tokens is not None else len(stamps),
            "expected": max_tokens}


async def run_level(url: str, model: str | None, work: list[tuple[str, int]], concurrency: int,
                    timeout: float) -> dict:
    """Every request of `work` against one server, at most `concurrency` in flight."""
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", timeout=timeout, max_retries=0)
    try:
        if model is None:
            model = (await client.models.list()).data[0].id
        gate = asyncio.Semaphore(concurrency)

        async def gated(prompt, n):
            async with gate:
                return await one_request(client, model, prompt, n)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(gated(p, n) for p, n in work))
    finally:
        await client.close()
    done = [r for r in results if r["ok"]]
    seconds = max((r["end"] for r in done), default=time.perf_counter()) - t0
    tokens = sum(r["tokens"] for r in done)
    ttfts = [r["ttft"] for r in done if r["ttft"] is not None]
    itls = [gap for r in done for gap in r["itl"]]
    return {"url": url, "model": model, "concurrency": concurrency, "requests": len(work),
            "errors": len(results) - len(done), "error_examples": [r["error"] for r in results if not r["ok"]][:3],
            "short_outputs": sum(r["tokens"] < r["expected"] for r in done), "output_tokens": tokens,
            "seconds": seconds, "output_tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            **{f"ttft_p{round(q * 100)}": percentile(ttfts, q) for q in PERCENTILES},
            **{f"itl_p{round(q * 100)}": percentile(itls, q) for q in PERCENTILES}}


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:,.0f}"


def print_report(runs: list[dict], urls: list[str]) -> None:
    table = Table(title="streaming chat completions, mixed lengths (TTFT, ITL in ms)")
    for column in ("server", "conc.", "requests", "errors", "short", "out tok/s", "TTFT p50", "p90", "p99",
                   "ITL p50", "p90", "p99"):
        table.add_column(column, justify="left" if column == "server" else "right")
    for r in runs:
        table.add_row(r["server"], str(r["concurrency"]), str(r["requests"]), str(r["errors"]), str(r["short_outputs"]),
                      f"{r['output_tokens_per_s']:,.1f}", ms(r["ttft_p50"]), ms(r["ttft_p90"]), ms(r["ttft_p99"]),
                      ms(r["itl_p50"]), ms(r["itl_p90"]), ms(r["itl_p99"]))
    console = Console(width=max(Console().width, 120))
    console.print(table)
    for side, url in zip("AB", urls):
        console.print(f"{side}: {url} (model {next(r['model'] for r in runs if r['server'] == side)})")
    for r in runs:
        for example in r["error_examples"]:
            console.print(f"error at {r['url']} c={r['concurrency']}: {example}")
    if len(urls) == 2:
        for level in sorted({r["concurrency"] for r in runs}):
            a, b = (next(r for r in runs if r["server"] == side and r["concurrency"] == level) for side in "AB")
            ttft = (f"{a['ttft_p99'] / b['ttft_p99']:.2f}x" if a["ttft_p99"] and b["ttft_p99"] else "-")
            speed = f"{a['output_tokens_per_s'] / b['output_tokens_per_s']:.2f}x" if b["output_tokens_per_s"] else "-"
            console.print(f"concurrency {level}: A/B output tokens/s {speed}, p99 TTFT {ttft} "
                          f"(tokens/s above 1 and TTFT below 1 favour A)")


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"--concurrency {text!r}: expected integers >= 1, comma-separated")
    return levels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="base URL of an OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1")
    target.add_argument("--compare", help="URL_A,URL_B: both servers back to back on the same requests")
    parser.add_argument("--model", help="model name to send (default: the server's first in /v1/models)")
    parser.add_argument("--concurrency", type=parse_levels, default=[64, 256], help="in-flight limits, e.g. 64,256")
    parser.add_argument("--requests", type=int, default=512, help="requests at each concurrency")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-len", type=int, default=7680,
                        help="prompt words + output tokens per request at most (under the servers' max_model_len)")
    parser.add_argument("--small", action="store_true", help="lengths divided by 32 (a CPU server)")
    parser.add_argument("--workload", choices=("mixed", "cpu-chat"), default="mixed",
                        help="mixed: peer_workloads.mixed_lengths; cpu-chat: issue 14's CPU wave (above)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one request may take")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    urls = [args.url] if args.url else args.compare.split(",")
    if len(urls) != (1 if args.url else 2) or not all(u.startswith(("http://", "https://")) for u in urls):
        parser.error(f"--compare {args.compare!r}: expected two http(s) URLs, comma-separated")
    if args.requests < 1 or args.max_len < 16:
        parser.error(f"--requests {args.requests} / --max-len {args.max_len}: expected >= 1 / >= 16")
    work = requests_for(args.requests, args.seed, args.max_len, 32 if args.small else 1, args.workload)
    runs = []
    for level in args.concurrency:
        for side, url in zip("AB", urls):  # back to back at each level: the same requests, the same seed
            runs.append({"server": side, **asyncio.run(run_level(url, args.model, work, level, args.timeout))})
    print_report(runs, urls)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "runs": runs}, indent=2))
    return 1 if any(r["errors"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
