"""Where the time of many short sequences goes on a small model (host-bound on a GPU).

    python benchmarks/profile_steps.py --model /tmp/ponytail-smollm2-random           # H200
    python benchmarks/profile_steps.py --model /tmp/tiny --requests 32 --profile-steps 20   # CPU

Runs bench_engine's seeded `mixed` requests (peer_workloads.py: chat-like lengths, EOS ignored)
through `LLM(model)` with its defaults three ways: the engine's step loop alone (tokens/s, step
wall time), the same requests streamed through `AsyncLLM` with at most --concurrency in flight
and the stream interval Serve replicas use (what a replica adds before Ray), and the step loop
again under cProfile, printing the functions with the most own time. On a GPU, a step of a
135M model takes a few milliseconds of device time: whatever the loop spends above that is host.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import sys
import time

import ponytail
from ponytail import SamplingParams

import peer_workloads
from peer_bench import sync


# Decode-only steps are grouped by their rows (the batch): up to each bound, then above the last.
BATCH_BUCKETS = (8, 32, 128, 512)


def kind_of_step(decode: int, prompt: int) -> str:
    if prompt:
        return "with prompt tokens"
    low = 1
    for bound in BATCH_BUCKETS:
        if decode <= bound:
            return f"decode, {low}-{bound} rows"
        low = bound + 1
    return f"decode, {low}+ rows"


def prompt_tokens(chunks) -> int:
    """The prompt tokens a step's chunks compute (a chunk past its prompt is a decode row)."""
    return sum(min(c.num_tokens, max(0, len(c.request.prompt_token_ids) - c.start)) for c in chunks)


class Timeline:
    """What each forward pass the runner launches holds, and how long it runs. With async
    scheduling a launch waits for the step before the previous one to be read back, so the time
    from launch k + 1 to launch k + 2 is step k's duration on the device (or the host's, when that
    is longer); without it, the time from launch k to k + 1 is."""

    def __init__(self, runner, async_scheduling: bool):
        self.runner, self.execute, self.lag = runner, runner.execute, int(async_scheduling)
        self.launches: list[tuple[float, int, int]] = []  # (time, decode rows, prompt tokens)
        runner.execute = self._execute

    def _execute(self, chunks, *args, **kwargs):
        prompt = prompt_tokens(chunks)
        decode = sum(1 for c in chunks if c.start >= len(c.request.prompt_token_ids))
        self.launches.append((time.perf_counter(), decode, prompt))
        return self.execute(chunks, *args, **kwargs)

    def close(self, end: float) -> dict:
        """Seconds and steps by kind: steps with prompt tokens, then decode-only steps by rows."""
        del self.runner.execute  # the instance attribute: the class's method again
        times = [t for t, _, _ in self.launches] + [end]
        spans = [after - t for t, after in zip(times, times[1:])]
        if self.lag and spans:  # the first span is host work alone: it goes to the first step
            spans = [spans[0] + spans[1] if len(spans) > 1 else spans[0]] + spans[2:] + [0.0]
        kinds: dict[str, list[float]] = {}
        for (_, decode, prompt), span in sorted(zip(self.launches, spans), key=lambda ls: (-ls[0][2], -ls[0][1])):
            entry = kinds.setdefault(kind_of_step(decode, prompt), [0, 0.0, 0, 0])
            entry[0] += 1
            entry[1] += span
            entry[2] += decode
            entry[3] += prompt
        return {kind: {"steps": n, "seconds": s, "decode_rows": d, "prompt_tokens": p}
                for kind, (n, s, d, p) in kinds.items()}  # prompt steps first, then by rows, most first


def step_loop(llm, work, profile_steps: int = 0) -> dict:
    """Every request added at once, then engine.step() until done; the first profile_steps steps
    under cProfile. The result's "timeline" splits the time by kind of step (Timeline)."""
    engine = llm.engine
    timeline = Timeline(engine.runner, engine.async_scheduling)
    for prompt, n in zip(work.prompts, work.output_lens):
        engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    profiler = cProfile.Profile() if profile_steps else None
    steps, tokens, t0 = [], 0, time.perf_counter()
    while engine.has_unfinished():
        start = time.perf_counter()
        if profiler is not None and len(steps) < profile_steps:
            profiler.enable()
            outputs = engine.step()
            profiler.disable()
        else:
            outputs = engine.step()
        steps.append(time.perf_counter() - start)
        tokens += sum(len(o.new_token_ids) for o in outputs)
    sync()
    end = time.perf_counter()
    seconds = end - t0
    by_kind = timeline.close(end)
    for request_id in list(engine.requests):
        engine.forget(request_id)
    steps.sort()
    result = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "steps": len(steps),
              "step_p50_ms": 1e3 * steps[len(steps) // 2], "step_mean_ms": 1e3 * seconds / len(steps),
              "timeline": by_kind}
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
        result["profile"] = text.getvalue()
    return result


async def streamed(llm, work, concurrency: int, stream_interval_s: float) -> dict:
    """The requests through AsyncLLM, at most `concurrency` in flight, deltas merged as a replica merges them."""
    async_llm = ponytail.AsyncLLM(llm, stream_interval_s=stream_interval_s)
    gate = asyncio.Semaphore(concurrency)
    tokens, deltas = 0, 0

    async def one(prompt, n):
        nonlocal tokens, deltas
        async with gate:
            async for delta in async_llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)):
                tokens += len(delta.new_token_ids)
                deltas += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p, n) for p, n in zip(work.prompts, work.output_lens)))
    seconds = time.perf_counter() - t0
    steps = async_llm.num_steps
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "deltas": deltas,
            "engine_steps": steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory (random_checkpoint.py builds one)")
    parser.add_argument("--requests", type=int, default=peer_workloads.MIXED_REQUESTS)
    parser.add_argument("--concurrency", type=int, default=256,
                        help="AsyncLLM run: requests in flight at most (0: no such run)")
    parser.add_argument("--stream-interval-s", type=float, default=0.05, help="as app.yaml's stream_interval_s")
    parser.add_argument("--profile-steps", type=int, default=200, help="steps profiled (0: no profile)")
    parser.add_argument("--json", help="write the numbers (and the profile's text) here")
    args = parser.parse_args()
    llm = ponytail.LLM(args.model)
    config = llm.engine.model.config.get_text_config()
    work = peer_workloads.build("mixed", config.vocab_size, llm.max_model_len)
    work = peer_workloads.PeerWorkload("mixed", work.prompts[: args.requests], work.output_lens[: args.requests],
                                       "output")
    other = peer_workloads.build("mixed", config.vocab_size, llm.max_model_len, seed=1).prompts[:8]  # not cached
    step_loop(llm, peer_workloads.PeerWorkload("warmup", other, [4] * 8, "output"))  # compile, graphs
    print(f"{len(work.prompts)} mixed requests, {work.prompt_tokens:,} prompt / {work.output_tokens:,} output "
          f"tokens, {llm.device}")
    loop = step_loop(llm, work)
    print(f"engine step loop: {loop['tokens_per_s']:,.0f} output tokens/s, {loop['steps']} steps, "
          f"step p50 {loop['step_p50_ms']:.2f} ms, mean {loop['step_mean_ms']:.2f} ms")
    for kind, t in loop["timeline"].items():
        print(f"  {kind:22s} {t['steps']:6,} steps {t['seconds']:8.3f} s ({1e3 * t['seconds'] / t['steps']:7.2f} ms "
              f"each), {t['decode_rows']:,} decode rows, {t['prompt_tokens']:,} prompt tokens")
    stream = None
    if args.concurrency:
        stream = asyncio.run(streamed(llm, work, args.concurrency, args.stream_interval_s))
        print(f"AsyncLLM, {args.concurrency} in flight, stream interval {args.stream_interval_s} s: "
              f"{stream['tokens_per_s']:,.0f} output tokens/s, {stream['engine_steps']} steps, "
              f"{stream['deltas']} deltas")
    report = {"requests": len(work.prompts), "prompt_tokens": work.prompt_tokens, "output_tokens": work.output_tokens,
              "device": str(llm.device), "step_loop": loop, "async_llm": stream}
    if args.profile_steps:
        profiled = step_loop(llm, work, args.profile_steps)
        print(f"under cProfile (first {args.profile_steps} steps): {profiled['tokens_per_s']:,.0f} tokens/s")
        print(profiled["profile"])
        report["profiled"] = profiled
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
