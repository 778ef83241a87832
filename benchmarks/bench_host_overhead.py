"""Host time of one engine step with the model stubbed out: what the GPU would wait for between steps.

    python benchmarks/bench_host_overhead.py                      # 64 decoding requests, 512-token prompts
    python benchmarks/bench_host_overhead.py --prefill            # bench_engine's prefill workload

A tiny random Llama runs the prefill steps for real; then the runner is replaced by one that
returns fixed logits over a small vocabulary, so a step's time is the scheduler, the sampler's
bookkeeping (its tensor work on a 512-token vocabulary is negligible), stop checks and outputs:
the Python a decode step costs on top of its forward pass. CPU numbers; the GPU's host is faster.

--prefill: bench_engine's prefill workload (256 mixed prompts, 182,044 tokens, one output token
each) from add_request to the last output with the forward pass stubbed out (zero logits): the host
work of checking, allocating, scheduling and packing the prompts. Until the first step is launched
none of it overlaps the device; after, async scheduling hides it behind the steps.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ponytail
from ponytail import SamplingParams

VOCAB = 512


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--async-scheduling", action="store_true",
                        help="the engine's async path (placeholders, fix-ups): its host cost, not its overlap")
    parser.add_argument("--prefill", action="store_true", help="bench_engine's prefill workload instead (see above)")
    args = parser.parse_args()
    if args.prefill:
        return prefill_host_time()
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=4096)
    llm = ponytail.LLM(LlamaForCausalLM(config).eval(), kv_cache_memory="512MiB", max_num_seqs=args.requests,
                       max_model_len=args.prompt_len + args.steps + 16, max_num_batched_tokens=8192,
                       async_scheduling=args.async_scheduling)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0, ignore_eos=True)
    for _ in range(args.requests):
        engine.add_request([rng.randrange(10, VOCAB) for _ in range(args.prompt_len)], params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()  # real prefill, until every request decodes
    logits = torch.randn(args.requests, VOCAB)
    engine.runner.execute = lambda chunks, sampled=None: logits[: sum(c.samples for c in chunks)]
    schedule, scheduled = engine.scheduler.schedule, [0.0]

    def timed_schedule(**kwargs):
        start = time.perf_counter()
        out = schedule(**kwargs)
        scheduled[0] += time.perf_counter() - start
        return out

    engine.scheduler.schedule = timed_schedule
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    per_step = (time.perf_counter() - start) / args.steps
    mode = "async scheduling" if args.async_scheduling else "sync"
    print(f"{args.requests} decoding requests, {mode}: {per_step * 1e3:.2f} ms of host time per step "
          f"(scheduling {scheduled[0] / args.steps * 1e3:.2f} ms)")
    return 0


def prefill_host_time() -> int:
    import peer_workloads

    torch.manual_seed(0)
    vocab, max_len = 32000, 8192
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=max_len)
    llm = ponytail.LLM(LlamaForCausalLM(config).eval(), kv_cache_memory="2GiB", max_num_seqs=256,
                       max_model_len=max_len, max_num_batched_tokens=8192)  # the CUDA step budget
    work = peer_workloads.build("prefill", vocab, max_len)
    llm.engine.runner._forward = lambda ids, positions, sample_at: torch.zeros(len(sample_at), vocab)
    engine, params = llm.engine, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                                  for n in work.output_lens]
    start = time.perf_counter()
    for prompt, p in zip(work.prompts, params):
        engine.add_request(prompt, p)
    added = time.perf_counter()
    engine.step()
    first = time.perf_counter()
    steps = 1
    while engine.has_unfinished():
        engine.step()
        steps += 1
    end = time.perf_counter()
    print(f"prefill workload ({len(work.prompts)} prompts, {work.prompt_tokens:,} tokens), forward stubbed: "
          f"{(end - start) * 1e3:.1f} ms of host time over {steps} steps; adding the requests "
          f"{(added - start) * 1e3:.1f} ms, the first step {(first - added) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
