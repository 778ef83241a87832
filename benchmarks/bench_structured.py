"""Throughput with half the batch grammar-constrained against the same batch unconstrained.

    python benchmarks/bench_structured.py                       # one GPU: 64 requests x 512 tokens
    python benchmarks/bench_structured.py --small               # CPU sanity run (the test suite's)
    python benchmarks/bench_structured.py --json out.json

One ponytail.LLM (the default model unless --model), the same prompts in both runs. Free rows
ignore EOS and generate exactly --output-len tokens. Constrained rows follow a JSON schema (a list
of at least --output-len integers in [0, 999]) that cannot be complete before --output-len tokens,
so they also stop at exactly that length ("length"): both runs compute the same number of tokens
with the same batch shape, and the only difference is the grammar work (compile cached by the
warm-up; mask fill and matcher advance on the host per step, the mask applied in the sampler, and
constrained steps reading the previous step back once its successor's forward pass is queued).
Reports output tokens/s of each run (median of --repeats) and their ratio (target >= 0.9).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import ponytail
from ponytail import SamplingParams, StructuredOutputsParams


def schema(output_len: int) -> dict:
    return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": output_len}


def make_params(n: int, output_len: int, constrained_share: float, seed: int = 0) -> list[SamplingParams]:
    spec = StructuredOutputsParams(json=schema(output_len))
    constrained = int(n * constrained_share)
    return [SamplingParams(max_tokens=output_len, temperature=1.0, seed=seed + i, structured_outputs=spec)
            if i % 2 == 0 and i // 2 < constrained else
            SamplingParams(max_tokens=output_len, temperature=1.0, seed=seed + i, ignore_eos=True)
            for i in range(n)]


def timed_run(llm, prompts, params, device) -> dict:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    lengths = {len(o.token_ids) for o in outputs}
    reasons = {o.finish_reason for o in outputs}
    if lengths != {params[0].max_tokens} or reasons != {"length"}:
        raise AssertionError(f"rows ended early (lengths {sorted(lengths)}, reasons {sorted(reasons)}): "
                             "the runs would not compute the same tokens")
    for out, p in zip(outputs, params):
        if p.structured_outputs is not None and not out.text.startswith("["):
            raise AssertionError(f"a constrained row does not follow its schema: {out.text[:60]!r}")
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="CPU-sized: 4 requests x 16 tokens, 1 repeat")
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--constrained-share", type=float, default=0.5, help="share of rows with a grammar")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.small:
        args.requests, args.output_len, args.repeats = 4, 16, 1
    llm = ponytail.LLM(args.model, device="cpu" if args.small else "auto", max_num_seqs=max(args.requests, 1),
                       max_model_len=1024 if args.small else None)
    device = llm.engine.cache.config.device
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List numbers as a JSON array."}], add_generation_prompt=True, tokenize=False)
    prompts = [prompt] * args.requests
    free = make_params(args.requests, args.output_len, 0.0)
    mixed = make_params(args.requests, args.output_len, args.constrained_share)
    timed_run(llm, prompts, mixed, device)  # warm-up: compiles the grammar, CUDA graphs, allocator
    runs = {"free": [], "mixed": []}
    for _ in range(args.repeats):  # interleaved, so drift hits both alike
        runs["free"].append(timed_run(llm, prompts, free, device))
        runs["mixed"].append(timed_run(llm, prompts, mixed, device))
    rate = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
    result = {"device": str(device), "requests": args.requests, "output_len": args.output_len,
              "constrained": sum(p.structured_outputs is not None for p in mixed),
              "async_scheduling": llm.engine.async_scheduling, "runs": runs,
              "free_tokens_per_s": rate["free"], "mixed_tokens_per_s": rate["mixed"],
              "ratio": rate["mixed"] / rate["free"]}
    print(f"{device}: {args.requests} requests x {args.output_len} tokens, {result['constrained']} constrained; "
          f"async_scheduling={result['async_scheduling']}")
    print(f"  unconstrained {rate['free']:9.0f} tokens/s")
    print(f"  half constr.  {rate['mixed']:9.0f} tokens/s   ratio {result['ratio']:.3f} (target >= 0.9)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
