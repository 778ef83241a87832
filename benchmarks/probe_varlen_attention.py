"""Prefill attention of packed prompts of varied lengths on the GPU: flash varlen against cuDNN's ragged kernel
and, where the `flash-attn-4` package is installed, FlashAttention-4's CuTe kernels (Hopper's wgmma/TMA design).

    python benchmarks/probe_varlen_attention.py                 # 7B shape: 32 heads, D 128, bf16
    python benchmarks/probe_varlen_attention.py --kv-heads 8    # the same with GQA (4 query heads per KV head)
    python benchmarks/probe_varlen_attention.py --methods flash_varlen,fa4_varlen --packed-qkv

The engine's prefill steps pack whole prompts of different lengths end to end; with more distinct
lengths than a few SDPA calls take, `chunks.attention_over_new_tokens` runs torch's flash varlen
(FlashAttention-2). torch also reaches cuDNN's attention with ragged offsets
(`aten._cudnn_attention_forward` with cumulative lengths, the path of its jagged nested tensors).
This probe packs bench_engine's mixed prompt lengths into steps of at most --step-tokens tokens, checks
every path against float32 attention row by row, then times each over all the steps (CUDA events,
median of --reps passes after two warm passes). cuDNN builds a plan per new shape; the first call
of each step is timed apart, and `cudnn_bucketed` pads the row count and the longest row up to
powers of two (empty rows, a larger bound) so that few shapes recur.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import peer_workloads
from ponytail.attention.flash import flash_varlen


def steps_of(lengths: list[int], step_tokens: int) -> list[list[int]]:
    """Whole prompts in arrival order, a new step when the next would pass step_tokens."""
    steps, current, tokens = [], [], 0
    for n in lengths:
        if current and tokens + n > step_tokens:
            steps.append(current)
            current, tokens = [], 0
        current.append(n)
        tokens += n
    return steps + ([current] if current else [])


def pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << (n - 1).bit_length())


def cu_of(lengths: list[int], device) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def flash(q, k, v, lengths, scale, key_lengths=None):
    key_lengths = key_lengths or lengths
    return flash_varlen(q, k, v, cu_of(lengths, q.device), cu_of(key_lengths, q.device), max(lengths),
                        max(key_lengths), scale)


def fa4(q, k, v, lengths, scale, key_lengths=None):
    from flash_attn.cute.interface import flash_attn_varlen_func

    key_lengths = key_lengths or lengths
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_of(lengths, q.device),
                                  cu_seqlens_k=cu_of(key_lengths, q.device), max_seqlen_q=max(lengths),
                                  max_seqlen_k=max(key_lengths), softmax_scale=scale, causal=True)[0]


def cudnn(q, k, v, lengths, scale, bucketed: bool = False):
    rows, longest = list(lengths), max(lengths)
    if bucketed:
        rows += [0] * (pow2(len(rows)) - len(rows))
        longest = pow2(longest, 128)
    cu = cu_of(rows, q.device)
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, longest, longest, False, 0.0, True, False,
                                                   scale=scale)[0]


def sdpa_rows(q, k, v, lengths, scale):
    out, start = torch.empty_like(q), 0
    for n in lengths:
        view = lambda t: t[start:start + n].transpose(0, 1)[None]  # noqa: E731
        o = F.scaled_dot_product_attention(view(q), view(k), view(v), is_causal=True, scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[1])
        out[start:start + n] = o[0].transpose(0, 1)
        start += n
    return out


def reference(q, k, v, lengths, scale, key_lengths=None):
    """float32, row by row, GQA by repeating K/V heads; causal aligned bottom right (a row's queries
    are the last of its keys, as a chunk after its context)."""
    group = q.shape[1] // k.shape[1]
    out, start, key_start = torch.empty(q.shape, dtype=torch.float32, device=q.device), 0, 0
    for n, m in zip(lengths, key_lengths or lengths):
        qq = q[start:start + n].float().transpose(0, 1)
        kk = k[key_start:key_start + m].float().transpose(0, 1).repeat_interleave(group, 0)
        vv = v[key_start:key_start + m].float().transpose(0, 1).repeat_interleave(group, 0)
        scores = (qq @ kk.transpose(1, 2)) * scale
        scores.masked_fill_(torch.ones(n, m, dtype=torch.bool, device=q.device).triu(m - n + 1), float("-inf"))
        out[start:start + n] = (scores.softmax(-1) @ vv).transpose(0, 1)
        start, key_start = start + n, key_start + m
    return out


def context_error(fn, heads: int, kv_heads: int, head_dim: int, scale: float, gen) -> float:
    """Largest |error| against float32 for chunks after a context (more keys than queries)."""
    lengths, key_lengths = [1, 7, 300, 64, 1000], [1, 520, 300, 2048, 1100]
    q = torch.randn((sum(lengths), heads, head_dim), generator=gen, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn((sum(key_lengths), kv_heads, head_dim), generator=gen, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    got = fn(q, k, v, lengths, scale, key_lengths)
    return (got.float() - reference(q, k, v, lengths, scale, key_lengths)).abs().max().item()


TAKES_CONTEXT = {"flash_varlen", "fa4_varlen"}
METHODS = {"flash_varlen": flash, "fa4_varlen": fa4, "cudnn_ragged": cudnn,
           "cudnn_bucketed": lambda *a: cudnn(*a, bucketed=True), "sdpa_per_row": sdpa_rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--step-tokens", type=int, default=8192)
    parser.add_argument("--requests", type=int, default=peer_workloads.MIXED_REQUESTS)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--packed-qkv", action="store_true",
                        help="q, k and v as column slices of one [tokens, Hq + 2 Hkv, D] tensor, as the engine's "
                             "fused projection leaves them (strided rows), instead of three contiguous tensors")
    parser.add_argument("--json")
    args = parser.parse_args()
    unknown = set(args.methods.split(",")) - METHODS.keys()
    if unknown:
        parser.error(f"--methods: {', '.join(sorted(unknown))} unknown; choose from {', '.join(METHODS)}")
    if not torch.cuda.is_available():
        print("needs a CUDA device: torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    device, dtype = torch.device("cuda"), torch.bfloat16
    lengths = [p for p, _ in peer_workloads.mixed_lengths(args.requests, seed=0, max_len=8192)]
    steps = steps_of(lengths, args.step_tokens)
    scale = args.head_dim ** -0.5
    gen = torch.Generator(device=device).manual_seed(0)
    data = []
    for step in steps:
        t = sum(step)
        if args.packed_qkv:
            qkv = torch.randn((t, args.heads + 2 * args.kv_heads, args.head_dim), generator=gen, device=device,
                              dtype=dtype)
            q, k, v = qkv.split([args.heads, args.kv_heads, args.kv_heads], dim=1)
        else:
            q = torch.randn((t, args.heads, args.head_dim), generator=gen, device=device, dtype=dtype)
            k = torch.randn((t, args.kv_heads, args.head_dim), generator=gen, device=device, dtype=dtype)
            v = torch.randn((t, args.kv_heads, args.head_dim), generator=gen, device=device, dtype=dtype)
        data.append((q, k, v, step))
    flops = sum(4 * args.heads * args.head_dim * n * (n + 1) / 2 for n in lengths)
    print(f"{len(lengths)} prompts ({sum(lengths):,} tokens, {len(set(lengths))} distinct lengths) in {len(steps)} "
          f"steps of <= {args.step_tokens} tokens; Hq {args.heads}, Hkv {args.kv_heads}, D {args.head_dim}, bf16; "
          f"causal attention {flops / 1e12:.2f} TFLOP")
    results = {}
    check = data[:3]
    refs = [reference(q, k, v, step, scale) for q, k, v, step in check]
    for name in args.methods.split(","):
        fn = METHODS[name]
        try:
            t0 = time.perf_counter()  # the first calls: FlashAttention-4 compiles its kernels here
            errors = [(fn(q, k, v, step, scale).float() - ref).abs().max().item()
                      for (q, k, v, step), ref in zip(check, refs)]
            check_s = time.perf_counter() - t0
            if name in TAKES_CONTEXT:
                errors.append(context_error(fn, args.heads, args.kv_heads, args.head_dim, scale, gen))
            firsts = []
            for q, k, v, step in data:  # first call of each step's shape: cuDNN builds its plans here
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(q, k, v, step, scale)
                torch.cuda.synchronize()
                firsts.append((time.perf_counter() - t0) * 1e3)
            for q, k, v, step in data:
                fn(q, k, v, step, scale)
            passes = []
            for _ in range(args.reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for q, k, v, step in data:
                    fn(q, k, v, step, scale)
                end.record()
                end.synchronize()
                passes.append(start.elapsed_time(end))
            ms = statistics.median(passes)
            results[name] = {"max_abs_error": max(errors), "ms_all_steps": ms, "tflops": flops / ms / 1e9,
                             "first_call_ms_total": sum(firsts), "first_call_ms_max": max(firsts),
                             "check_s": check_s}
            print(f"{name:15s} max |err| {max(errors):.2e}  all steps {ms:8.2f} ms  {flops / ms / 1e9:6.1f} TFLOP/s  "
                  f"first calls {sum(firsts):8.1f} ms (worst {max(firsts):.1f}); check {check_s:.1f} s")
        except Exception as error:  # a path this torch or GPU refuses: say so, go on with the others
            results[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
            print(f"{name:15s} FAILED: {results[name]['error']}")
    base = results.get("flash_varlen", {}).get("ms_all_steps")
    if base:
        for name, r in results.items():
            if "ms_all_steps" in r:
                print(f"{name:15s} {base / r['ms_all_steps']:.2f}x flash varlen's speed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "steps": steps, "tflop": flops / 1e12, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
