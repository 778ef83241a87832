"""What the scheduler does with a GPU's pool and budgets, counted on the CPU (no timing).

    python benchmarks/count_step_work.py --workload prefix --requests 24 --blocks 813 \
        --settings "prefill_only_batched_tokens=16384|prefill_only_batched_tokens=8192"

Runs one of bench_engine's seeded workloads (peer_workloads.py) through `LLM()` on a 2-layer random
Llama with the vocabulary and context of the 7B-shaped benchmark checkpoint, a KV pool of --blocks
blocks and a GPU's step budgets (8,192 tokens while anything decodes; async scheduling, no prefill
delay), once per --settings entry (LLM arguments, `;`-separated; `|` between entries). For all of a
workload, --blocks is what `ponytail estimate --device-memory` gives the 7B on the card (7,292 on an
80 GB H100); a CPU forward pass over 256 decode rows of 2k-token contexts takes long, so --requests
takes the first N and --blocks scales with what they need (above: 813 blocks, 1.12x the 24 prefix
requests' need, as 7,292 is for all 256). It counts what a device would have to do: steps, prompt
tokens computed against those the prompts hold, preemptions, the pool's peak. The forward pass is a
tiny model's, so only the counts mean anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

import ponytail
from ponytail import SamplingParams
from ponytail.kv.config import CacheConfig

import peer_workloads
from profile_steps import prompt_tokens

VOCAB, MAX_LEN = 49152, 8192  # random_checkpoint.py's 7B shape keeps SmolLM2's vocabulary


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=MAX_LEN)
    return LlamaForCausalLM(config).eval()


def parse_settings(entry: str) -> dict:
    settings = {}
    for item in filter(None, entry.split(";")):
        name, eq, value = (part.strip() for part in item.partition("="))
        if not eq:
            raise ValueError(f"--settings {entry!r}: expected name=value, got {item!r}")
        settings[name] = yaml.safe_load(value)
    return settings


def count(model, workload: peer_workloads.PeerWorkload, blocks: int, settings: dict) -> dict:
    options = dict(max_num_seqs=256, max_num_batched_tokens=8192, context_aware_chunks=False,
                   async_scheduling=True, prefill_delay_factor=0.0, max_model_len=MAX_LEN)
    options.update(settings)
    block_bytes = CacheConfig.from_model(model).block_bytes
    llm = ponytail.LLM(model, kv_cache_memory=blocks * block_bytes, **options)
    runner = llm.engine.runner
    execute, totals = runner.execute, {"steps": 0, "prompt_tokens_computed": 0, "peak_blocks_used": 0}
    allocator = llm.engine.cache.allocator

    def counting(chunks, *args, **kwargs):
        totals["steps"] += 1
        totals["peak_blocks_used"] = max(totals["peak_blocks_used"], allocator.num_used)
        totals["prompt_tokens_computed"] += prompt_tokens(chunks)
        return execute(chunks, *args, **kwargs)

    runner.execute = counting
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in workload.output_lens]
    outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    return {"settings": settings, **totals, "prompt_tokens": workload.prompt_tokens,
            "cached_prompt_tokens": sum(o.num_cached_tokens or 0 for o in outputs),
            "preemptions": llm.engine.scheduler.num_preemptions, "pool_blocks": llm.engine.cache.max_blocks}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="prefix", choices=peer_workloads.WORKLOADS)
    parser.add_argument("--blocks", type=int, default=7292, help="the KV pool's ceiling in blocks of 16 tokens")
    parser.add_argument("--requests", type=int, help="only the workload's first N requests (a CPU run of all "
                        "256 takes long: scale --blocks with them)")
    parser.add_argument("--settings", default="", help="LLM arguments per run: a=1;b=2|a=3 (default: one run)")
    parser.add_argument("--json", help="write the counts here")
    args = parser.parse_args()
    model = tiny_model()
    workload = peer_workloads.build(args.workload, VOCAB, MAX_LEN)
    if args.requests:
        workload = dataclasses.replace(workload, prompts=workload.prompts[:args.requests],
                                       output_lens=workload.output_lens[:args.requests])
    results = [count(model, workload, args.blocks, parse_settings(entry)) for entry in args.settings.split("|")]
    for result in results:
        print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
