"""The sampler alone: one step's logits [rows, vocab] to tokens, per setting, on this machine's device.

    python benchmarks/bench_sampler.py                          # 8, 64, 256 rows x 49,152 (SmolLM2's vocabulary)
    python benchmarks/bench_sampler.py --rows 256 --vocab 32000 --json sampler.json

Settings: greedy, temperature 1 (the OpenAI API's default), temperature 0.8 with top_p 0.95, and
greedy with logprobs=5. The logits are shaped like a language model's: a token's probability falls
as its rank^-1.5, the ranks shuffled per row (the default model on English text had a 0.95 nucleus
of 10 tokens at the median, and within 1,024 tokens in 92-95% of positions). Each is timed over --iters calls after one warm-up, the logits fixed, in
milliseconds per call (CUDA: synchronized). On the CPU a step of the default model's 8 decode rows
takes ~90 ms, so what the sampler adds there is what a server's streams wait for on top.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from ponytail import SamplingParams
from ponytail.sampling.sampler import SamplingBatch, sample

SETTINGS = {
    "greedy": SamplingParams(temperature=0),
    "temperature 1": SamplingParams(temperature=1.0),
    "temperature 0.8, top_p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "greedy, logprobs 5": SamplingParams(temperature=0, logprobs=5),
}


def zipf_logits(rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    ranks = torch.stack([torch.randperm(vocab, generator=generator) for _ in range(rows)]) + 1
    return -1.5 * ranks.float().log()


def time_setting(logits: torch.Tensor, params: SamplingParams, iters: int) -> float:
    rows = logits.shape[0]
    batch = SamplingBatch.build([params] * rows, [[]] * rows, [[]] * rows, [None] * rows, logits.device)
    sample(logits, batch)
    if logits.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        sample(logits, batch)
    if logits.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="8,64,256", help="comma-separated batch sizes")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if any(r < 1 for r in rows) or args.vocab < 2 or args.iters < 1:
        parser.error(f"--rows {args.rows}, --vocab {args.vocab}, --iters {args.iters}: allowed: rows >= 1, "
                     "vocab >= 2, iters >= 1")
    generator = torch.Generator().manual_seed(0)
    results = []
    print(f"{'rows':>5s}  " + "  ".join(f"{name:>28s}" for name in SETTINGS) + "   (ms per call)")
    for n in rows:
        logits = zipf_logits(n, args.vocab, generator).to(args.device)
        times = {name: time_setting(logits, params, args.iters) for name, params in SETTINGS.items()}
        results.append({"rows": n, "vocab": args.vocab, "device": args.device, "ms": times})
        print(f"{n:5d}  " + "  ".join(f"{times[name]:28.2f}" for name in SETTINGS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
