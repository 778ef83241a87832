"""Ponytail's engine against what users would otherwise run, on the same prompts, in one process.

    python benchmarks/bench_engine.py --small                    # CPU, the embedded default model
    python benchmarks/bench_engine.py --requests 64 --prompt-len 512 --output-len 1024   # H200, 7B-shaped
    python benchmarks/bench_engine.py --requests 32 --prompt-len 2048 --output-len 2048 --peers ponytail
    python benchmarks/bench_engine.py --peers ponytail --capacity 40GiB   # concurrency in a fixed KV budget
    python benchmarks/bench_engine.py --peers plain,generate_batch,ponytail,ponytail_compiled
    # side by side with vLLM (peer_bench.py), both engines with their defaults, one checkpoint dir:
    python benchmarks/bench_engine.py --model /tmp/ponytail-7b-random --workload all \
        --peers ponytail,ponytail_compiled,vllm --vllm-python /usr/bin/python3 \
        --vllm-pythonpath /tmp/vsite:/tmp/vsite/nvidia_cutlass_dsl/dsl_packages --json peers.json

Peers: plain `model.generate` on the whole batch, transformers' continuous batching
(`generate_batch`), and `ponytail.LLM`, eager (`ponytail`) or with compile_model=True
(`ponytail_compiled`: torch.compile of the decoder layers). Greedy outputs are checked first, with
`ponytail bench`'s check (ponytail/bench/output_check.py): each side's tokens judged on its own
prefix by the model in float32, a differing token passing only as a near tie within the dtype's
noise (in fp32 on the CPU: the same tokens).
Then each peer is timed on the same requests with EOS ignored: output tokens/s, time to first
token and time per output token (p50/p99), and peak device memory above the weights. Plain
generate and Ponytail run in --rounds of alternating order (3 with --small) and each reports its
median round; generate_batch runs once, after them.

--capacity BUDGET runs Ponytail alone with that KV budget on more requests than fit at once and
reports the most sequences it ran concurrently, against what a cache preallocated per sequence
at max_seq_len (--capacity-max-len) holds in the same budget.

--small also runs a seeded chat workload through Ponytail's engine (chat_workload: a shared chat
opening, one prompt in six 1-2k tokens long) and reports the time of each engine step.

--peers with vllm, --workload other than fixed, or --model: the side-by-side mode of peer_bench.py
(workloads in peer_workloads.py; vLLM in its own process, vllm_peer.py). There a Ponytail peer may
carry LLM arguments, to compare a setting with the defaults on the same requests in one run:
--peers "ponytail,ponytail:max_num_batched_tokens=16384,vllm"; decode.<key>=<int> sets a decode-kernel
launch tunable and inductor.<option>=<value> a torch._inductor.config option while that peer runs:
--peers "ponytail,ponytail:inductor.triton.enable_pdl=true" (programmatic dependent launch). The vllm
peer may carry vllm.LLM arguments the same way (peer_bench.VLLM_ARGS): FP8 KV against FP8 KV is
--peers "ponytail:kv_cache_dtype=fp8;calculate_kv_scales=true,vllm:kv_cache_dtype=fp8;calculate_kv_scales=true".
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

import ponytail
from ponytail import SamplingParams
from ponytail.bench.output_check import check_outputs
from ponytail.runner.compile import restore_decoder_layers
from ponytail.utils.units import format_bytes, parse_bytes

import peer_bench


def seven_b_model(device) -> torch.nn.Module:
    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)
    with torch.no_grad():  # sharp logits: greedy comparisons are not decided by bf16 rounding of near ties
        model.lm_head.weight.mul_(20)
    return model.eval()


def bench_model(small: bool):
    """(model, tokenizer): the embedded default model on the CPU with --small, else the 7B-shaped
    Llama on CUDA (no tokenizer: token ids only); None, said on stderr, when there is no CUDA."""
    if small:
        return ponytail.load_model()
    if not torch.cuda.is_available():
        print("no CUDA device: use --small on the CPU", file=sys.stderr)
        return None
    return seven_b_model("cuda"), None


def prompts(n, length, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_above(device, weights_bytes):
    return torch.cuda.max_memory_allocated(device) - weights_bytes if device.type == "cuda" else None


def reset_peak(device):
    gc.collect()  # an earlier peer's cache and graphs go before the next one is measured
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run_plain(model, batch, output_len, device, weights):
    model.set_attn_implementation("sdpa")
    ids = torch.tensor(batch, device=device)
    mask = torch.ones_like(ids)
    kwargs = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0)
    reset_peak(device)
    sync(device)
    t0 = time.perf_counter()
    first = model.generate(ids, max_new_tokens=1, **kwargs)
    sync(device)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
    sync(device)
    total = time.perf_counter() - t0
    tpot = (total - ttft) / max(1, output_len - 1)
    del first
    return {"peer": "plain generate", "seconds": total, "tokens_per_s": len(batch) * output_len / total,
            "ttft_p50": ttft, "ttft_p99": ttft, "tpot_p50": tpot, "tpot_p99": tpot,
            "peak_above_weights": peak_above(device, weights)}, out[:, len(batch[0]):].tolist()


def run_generate_batch(model, batch, output_len, device, weights):
    model.set_attn_implementation("sdpa")
    config = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    reset_peak(device)
    sync(device)
    t0 = time.perf_counter()
    results = model.generate_batch(batch, generation_config=config, record_timestamps=True, progress_bar=False)
    sync(device)
    total = time.perf_counter() - t0
    outs, ttfts, tpots = [], [], []
    for key in sorted(results, key=lambda k: int(str(k).split("_")[-1]) if str(k).split("_")[-1].isdigit() else 0):
        result = results[key]
        outs.append(list(result.generated_tokens))
        stamps = getattr(result, "timestamps", None)
        if stamps and len(stamps) > 1:
            created = getattr(result, "created_time", stamps[0])
            ttfts.append(stamps[0] - created)
            tpots.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    return {"peer": "transformers generate_batch", "seconds": total,
            "tokens_per_s": len(batch) * output_len / total,
            "ttft_p50": percentile(ttfts, 0.5), "ttft_p99": percentile(ttfts, 0.99),
            "tpot_p50": percentile(tpots, 0.5), "tpot_p99": percentile(tpots, 0.99),
            "peak_above_weights": peak_above(device, weights)}, outs


def run_ponytail(model, tokenizer, batch, output_len, device, weights, kv_memory, compile_model=False):
    reset_peak(device)
    llm = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory=kv_memory, max_num_seqs=len(batch),
                       max_model_len=len(batch[0]) + output_len, max_num_batched_tokens=8192,
                       compile_model=compile_model)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    if compile_model:  # compile outside the timed run: one short request per shape it will see
        llm.generate([batch[0]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    sync(device)
    t0 = time.perf_counter()
    try:
        outputs = llm.generate(batch, params)
    finally:
        restore_decoder_layers(model)
    sync(device)
    total = time.perf_counter() - t0
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    tpots = [(o.metrics.last_token_time - o.metrics.first_token_time) / max(1, len(o.token_ids) - 1)
             for o in outputs]
    config = llm.engine.cache.config
    live_tokens = len(batch) * (len(batch[0]) + output_len)
    needed = live_tokens * config.bytes_per_token + len(batch) * config.block_bytes
    stats = llm.stats()
    result = {"peer": "ponytail (compiled layers)" if compile_model else "ponytail", "seconds": total,
              "tokens_per_s": len(batch) * output_len / total,
              "ttft_p50": percentile(ttfts, 0.5), "ttft_p99": percentile(ttfts, 0.99),
              "tpot_p50": percentile(tpots, 0.5), "tpot_p99": percentile(tpots, 0.99),
              "peak_above_weights": peak_above(device, weights),
              "kv_pool_peak_bytes": llm.engine.cache.peak_allocated_bytes,
              "kv_live_tokens_need_bytes": needed, "preemptions": stats.num_preemptions}
    return result, [o.token_ids for o in outputs], llm


def median_round(runs: list[dict]) -> dict:
    """The run with the median tokens/s, with every round's tokens/s under "rounds" (in order)."""
    middle = sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2]
    return {**middle, "rounds": [r["tokens_per_s"] for r in runs]}


def check_variant(model, tokenizer, batch, steps, kv_memory, compile_model):
    """The output check `ponytail bench` runs (ponytail.bench.output_check), for one variant."""
    def generate(prompts, params):  # builds, runs and drops its engine, as check_outputs asks
        llm = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory=kv_memory, max_num_seqs=len(prompts),
                           max_model_len=max(len(p) for p in prompts) + steps, compile_model=compile_model)
        try:
            return llm.generate(prompts, params)
        finally:
            restore_decoder_layers(model)  # the reference and the peers run the model as it came

    return check_outputs(model, batch, steps, generate)


def chat_workload(vocab: int, seed: int = 0, requests: int = 12, long_every: int = 6):
    """Seeded chat-shaped requests: (prompt ids, output tokens). Every prompt opens with the same 24
    tokens (a chat template's opening: a cached prefix, so every later prompt has context); one in
    `long_every` is 1-2k tokens long, the rest 16-96; outputs 16-48 tokens."""
    rng = random.Random(seed)
    opening = [rng.randrange(10, vocab) for _ in range(24)]
    out = []
    for i in range(requests):
        length = rng.randint(1024, 2048) if i % long_every == long_every // 2 else rng.randint(16, 96)
        out.append((opening + [rng.randrange(10, vocab) for _ in range(length)], rng.randint(16, 48)))
    return out


def run_chat(model, tokenizer, device, kv_memory, seed: int = 0) -> dict:
    """Ponytail's engine on chat_workload, one step at a time: the time of every step."""
    work = chat_workload(model.config.vocab_size, seed)
    llm = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory=kv_memory, max_num_seqs=len(work),
                       max_model_len=max(len(p) for p, _ in work) + 64)
    engine = llm.engine
    sync(device)
    steps, t0 = [], time.perf_counter()
    for prompt, output_len in work:
        engine.add_request(prompt, SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        sync(device)
        steps.append(time.perf_counter() - start)
    total = time.perf_counter() - t0
    output_tokens = sum(n for _, n in work)
    return {"requests": len(work), "long_prompts": sum(len(p) > 1000 for p, _ in work),
            "prompt_tokens": sum(len(p) for p, _ in work), "output_tokens": output_tokens, "seconds": total,
            "output_tokens_per_s": output_tokens / total, "steps": len(steps),
            "step_p50": percentile(steps, 0.5), "step_p99": percentile(steps, 0.99), "step_max": max(steps),
            "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens}


def run_capacity(model, tokenizer, args, device, budget) -> dict:
    """Most sequences running at once in a fixed KV budget, against per-sequence preallocation."""
    budget_bytes = parse_bytes(budget, "--capacity")
    llm = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory=budget_bytes, max_num_seqs=512,
                       max_model_len=args.capacity_max_len, max_num_batched_tokens=8192)
    per_token = llm.engine.cache.config.bytes_per_token
    preallocated = budget_bytes // (args.capacity_max_len * per_token)
    fit_at_full_length = budget_bytes // ((args.prompt_len + args.output_len) * per_token)
    # More requests than can ever run at once: the count offered must not be what limits the peak.
    n = 3 * fit_at_full_length + 8
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    engine = llm.engine
    for prompt in prompts(n, args.prompt_len, model.config.vocab_size, seed=7):
        engine.add_request(prompt, params)
    peak_running, steady_running, t0 = 0, 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        running = len(engine.scheduler.running)
        peak_running = max(peak_running, running)
        if all(r.num_tokens >= args.prompt_len + args.output_len // 2 for r in engine.scheduler.running):
            # Every running sequence is past half its output: how many the budget carries at length.
            steady_running = max(steady_running, running)
    stats = engine.stats()
    return {"budget_bytes": budget_bytes, "max_seq_len": args.capacity_max_len, "requests": n,
            "peak_running": peak_running, "running_past_half_length": steady_running,
            "preallocated_fit": preallocated, "fit_at_full_length": fit_at_full_length,
            "preemptions": stats.num_preemptions, "seconds": time.perf_counter() - t0,
            "used_blocks_after": stats.used_blocks}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="CPU-sized: the default model, 8 requests")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--peers", default="plain,generate_batch,ponytail",
                        help="comma-separated: plain, generate_batch, ponytail, ponytail_compiled; side by "
                             "side: ponytail (LLM's defaults), ponytail_eager, ponytail_compiled, vllm, and any of "
                             "the three ponytail ones with LLM arguments, e.g. "
                             "'ponytail:max_num_batched_tokens=16384;prefill_delay_factor=0', or with decode "
                             "kernel launch tunables while that peer runs, e.g. 'ponytail:decode.decode_warps=8'")
    parser.add_argument("--kv-memory", default=None, help="Ponytail's KV budget (default: what is free)")
    parser.add_argument("--check-tokens", type=int, default=16, help="greedy tokens compared before timing")
    parser.add_argument("--capacity", metavar="BUDGET", help="also measure concurrency in this KV budget")
    parser.add_argument("--capacity-max-len", type=int, default=4096, help="max_seq_len of the preallocated peer")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed runs per peer, alternating order; the median is reported (default: 3 with "
                             "--small, else 1; side by side with vLLM: 1, each engine's rounds back to back)")
    parser.add_argument("--json")
    peer_bench.add_arguments(parser)
    args = parser.parse_args()
    try:
        peers, args.vllm_engine_args = peer_bench.split_vllm_peer(args.peers.split(","))
        with_args = [p for p in peers if peer_bench.parse_peer(p)[1]]
    except ValueError as exc:
        parser.error(str(exc))
    unknown = sorted(set(peers) - set(with_args) - {"plain", "generate_batch", "ponytail", "ponytail_compiled",
                                                   "ponytail_eager", "vllm"})
    if unknown:
        parser.error(f"--peers: unknown {unknown}; allowed: plain, generate_batch, ponytail, ponytail_compiled, "
                     f"ponytail_eager, vllm")
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: allowed: 1 or more")
    if peer_bench.side_by_side(parser, args, peers):
        return peer_bench.run(args, peers)
    if "ponytail_eager" in peers:
        parser.error("--peers ponytail_eager: only in the side-by-side mode (here ponytail is eager)")
    loaded = bench_model(args.small)
    if loaded is None:
        return 2
    model, tokenizer = loaded
    if args.small:
        args.requests, args.prompt_len, args.output_len = 8, 32, 32
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    batch = prompts(args.requests, args.prompt_len, vocab)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if device.type == "cuda":
        torch.cuda.empty_cache()

    variants = [p for p in ("ponytail", "ponytail_compiled") if p in peers]

    # 1. Correctness first: greedy tokens of both sides, each judged on its own prefix by the model
    # in float32; a differing token passes only as a near tie within the dtype's noise.
    check = batch[: min(4, len(batch))]
    agreement = {}
    for variant in variants:
        verdict = check_variant(model, tokenizer, check, args.check_tokens, args.kv_memory,
                                variant == "ponytail_compiled")
        agreement[variant] = verdict.to_dict()
        print(f"{variant}: {verdict.summary()}")
        if not verdict.passed:
            print(f"{variant} produces wrong tokens: not timed", file=sys.stderr)
            return 1

    # 2. Timing, same requests for every peer, in rounds of alternating order (plain generate and
    # Ponytail are within a few percent of each other on --small, less than one run's noise on a
    # shared machine); each peer's median round is reported. generate_batch runs once, last: it is
    # the slowest, and the peers timed after it in one process ran ~10% slower.
    timed = (["plain"] if "plain" in peers else []) + variants
    rounds = args.rounds or (3 if args.small else 1)
    runs = {peer: [] for peer in timed}
    for round_index in range(rounds):
        for peer in timed if round_index % 2 == 0 else timed[::-1]:
            if peer == "plain":
                runs[peer].append(run_plain(model, batch, args.output_len, device, weights)[0])
            else:
                runs[peer].append(run_ponytail(model, tokenizer, batch, args.output_len, device, weights,
                                               args.kv_memory, peer == "ponytail_compiled")[0])
    results = [median_round(runs[peer]) for peer in timed]
    if "generate_batch" in peers:
        try:
            results.append(run_generate_batch(model, batch, args.output_len, device, weights)[0])
        except Exception as exc:  # report, do not hide: the row says why it is missing
            print(f"generate_batch failed: {type(exc).__name__}: {exc}")

    capacity = run_capacity(model, tokenizer, args, device, args.capacity) if args.capacity else None
    chat = run_chat(model, tokenizer, device, args.kv_memory) if args.small and "ponytail" in peers else None

    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "requests": args.requests, "prompt_len": args.prompt_len,
           "output_len": args.output_len}
    print(f"\n{env}")
    print(f"{'peer':30s} {'tok/s':>9s} {'TTFT p50':>9s} {'p99':>8s} {'TPOT p50':>9s} {'p99':>8s} {'peak>weights':>13s}")
    for r in results:
        peak = r["peak_above_weights"]
        print(f"{r['peer']:30s} {r['tokens_per_s']:9.1f} {r['ttft_p50']:9.3f} {r['ttft_p99']:8.3f} "
              f"{r['tpot_p50'] * 1e3:7.1f}ms {r['tpot_p99'] * 1e3:6.1f}ms "
              f"{'-' if peak is None else f'{peak / 1e9:10.1f} GB':>13s}")
    for mine in (r for r in results if r["peer"].startswith("ponytail")):
        for r in results:
            if not r["peer"].startswith("ponytail"):
                per_round = ""
                if len(mine["rounds"]) > 1 and len(r.get("rounds", [])) == len(mine["rounds"]):
                    per_round = " (median of {} rounds; each round: {})".format(
                        len(mine["rounds"]), ", ".join(f"{a / b:.2f}x" for a, b in zip(mine["rounds"], r["rounds"])))
                print(f"{mine['peer']} / {r['peer']}: {mine['tokens_per_s'] / r['tokens_per_s']:.2f}x tokens/s{per_round}")
        print(f"{mine['peer']}: KV pool peak {mine['kv_pool_peak_bytes'] / 1e9:.2f} GB; live tokens need "
              f"{mine['kv_live_tokens_need_bytes'] / 1e9:.2f} GB (incl. one block per sequence); "
              f"preemptions {mine['preemptions']}")
    if capacity:
        print(f"KV budget {format_bytes(capacity['budget_bytes'])}, {args.prompt_len}+{args.output_len}-token "
              f"requests: ponytail ran up to {capacity['peak_running']} sequences at once, "
              f"{capacity['running_past_half_length']} with every one past half its output "
              f"({capacity['preemptions']} preemptions, {capacity['requests']} requests); a cache preallocated "
              f"at max_seq_len={capacity['max_seq_len']} holds {capacity['preallocated_fit']} "
              f"({capacity['peak_running'] / max(1, capacity['preallocated_fit']):.2f}x); "
              f"{capacity['fit_at_full_length']} fit at full length")
    if chat:
        print(f"chat workload (seed 0: {chat['requests']} requests, {chat['long_prompts']} with 1-2k-token prompts, "
              f"{chat['prompt_tokens']} prompt tokens, max_num_batched_tokens {chat['max_num_batched_tokens']}): "
              f"{chat['output_tokens_per_s']:.1f} output tokens/s; {chat['steps']} steps, step time p50 "
              f"{chat['step_p50'] * 1e3:.0f} ms, p99 {chat['step_p99'] * 1e3:.0f} ms, max {chat['step_max'] * 1e3:.0f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "agreement": agreement, "results": results, "capacity": capacity, "chat": chat},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
