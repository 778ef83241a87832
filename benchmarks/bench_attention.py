"""Paged attention against torch SDPA on the same K/V laid out contiguously.

    python benchmarks/bench_attention.py                 # H200-sized run (under ~45 GB of GPU memory)
    python benchmarks/bench_attention.py --small         # quick run, also on the CPU
    python benchmarks/bench_attention.py --json out.json --launch target_waves=4,decode_warps=2

Decode: one query token per row; effective bandwidth = K+V bytes of the attended tokens / time,
for Ponytail's paged kernel (blocks scattered over the pool) and for SDPA on [B, H, L, D] copies.
Prefill: T new tokens per row after `context` cached ones; tokens/s of the path the engine takes
and of SDPA (bottom-right causal mask) on contiguous K/V. With context that is the paged path
(packed gather + flash varlen); without (first chunks) it is chunk_attention on the model's own
K/V as the engine hands them over (query/key [H, N, D], value a transposed view), no cache read.
Every Ponytail result is checked against SDPA's (relative error < 2e-2) before it is timed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

from timing import graph_ms, median_ms, tbps

from ponytail import CacheConfig, PagedKVCache
from ponytail.attention import decode as decode_kernel, prefill_cupy, torch_fallback
from ponytail.attention.paged import paged_attention, paged_attention_varlen
from ponytail.attention.chunks import attention_over_new_tokens, equal_length_runs
from fa3_decode import fa3_decode, fa3_problem

MAX_REL_ERROR = 2e-2
REPS = 5  # decode calls per timed sample


def make_paged(batch, kv_heads, head_dim, context, dtype, device, block_size=16, chunks=8, seed=0):
    """A one-layer cache whose rows own `context` tokens each in randomly scattered blocks."""
    per_row = -(-context // block_size)
    total = batch * per_row
    chunk_blocks = -(-total // chunks)
    config = CacheConfig(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                         max_batch_size=1, max_seq_len=chunk_blocks * chunks * block_size,
                         block_size=block_size, chunk_blocks=chunk_blocks, device=device)
    cache = PagedKVCache(config, initial_chunks=chunks)
    gen = torch.Generator(device=device).manual_seed(seed)
    for chunk in cache.storage.chunks:
        chunk.normal_(generator=gen)
    order = torch.randperm(cache.storage.num_blocks, generator=gen, device=device)[:total]
    tables = order.view(batch, per_row).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return cache, tables, seq_lens


def contiguous_kv(cache, tables, seq_lens):
    """The same K/V as [B, kv_heads, L, D] tensors: exact copies (the gather kernel on a GPU,
    tested bit for bit against the fallback's; the fallback gather on the CPU)."""
    gather = prefill_cupy.gather_padded if cache.storage.device.type == "cuda" else torch_fallback.gather_torch
    return gather(cache.storage, 0, tables, seq_lens)


def rel_error(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def bench_decode(batch, heads, kv_heads, head_dim, context, dtype, device, iters, launch_sets,
                 fa3: bool = False) -> list[dict]:
    """One result per launch set (overrides of attention.decode_kernel.LAUNCH) on the same data;
    fa3: also vLLM's FlashAttention-3 decode call on the same blocks (fa3_ms in every result)."""
    cache, tables, seq_lens = make_paged(batch, kv_heads, head_dim, context, dtype, device)
    k, v = contiguous_kv(cache, tables, seq_lens)
    query = torch.randn(batch, heads, 1, head_dim, device=device, dtype=dtype)
    scale = 1 / math.sqrt(head_dim)
    gqa = {"enable_gqa": True} if kv_heads != heads else {}
    kv_bytes = 2 * batch * context * kv_heads * head_dim * k.element_size()
    name = f"decode B={batch} Hq={heads} Hkv={kv_heads} D={head_dim} ctx={context}"

    def ours():
        return paged_attention(cache.storage, 0, query, tables, seq_lens, None, scale)

    def sdpa():
        return F.scaled_dot_product_attention(query, k, v, scale=scale, **gqa)

    expected = sdpa()
    sdpa_ms = graph_ms(sdpa, iters=iters, device=device, reps=REPS)
    fa3_ms = None
    if fa3:
        call = fa3_decode(cache.storage, tables, seq_lens, query, scale)
        err = rel_error(call(), expected)
        if err > MAX_REL_ERROR:
            raise SystemExit(f"{name} FlashAttention-3: relative error {err:.2e} vs SDPA")
        fa3_ms = graph_ms(call, iters=iters, device=device, reps=REPS)
        print(f"  {name} FlashAttention-3 (vLLM's decode call): {tbps(kv_bytes, fa3_ms):.2f} TB/s", flush=True)
        del call
    results = []
    for launch in launch_sets:
        saved = dict(decode_kernel.LAUNCH)
        decode_kernel.LAUNCH.update(launch)
        try:
            err = rel_error(ours(), expected)
            if err > MAX_REL_ERROR:
                raise SystemExit(f"{name} {launch}: relative error {err:.2e} vs SDPA")
            ours_ms = graph_ms(ours, iters=iters, device=device, reps=REPS)
            eager_ms = median_ms(ours, iters=iters, reps=REPS, device=device)
            plan = None
            if device.type == "cuda":  # the launch layout used, for the table
                p = decode_kernel.decode_plan(cache.storage, batch, heads, tables.shape[1])
                plan = f"{p.kernel_name.rsplit('_', 1)[1]} w{decode_kernel.LAUNCH['decode_warps']} splits={p.splits}"
        finally:
            decode_kernel.LAUNCH.clear()
            decode_kernel.LAUNCH.update(saved)
        results.append({"case": name, "kind": "decode", "launch": launch, "plan": plan, "kv_bytes": kv_bytes,
                        "rel_error": err, "ponytail_ms": ours_ms, "fa3_ms": fa3_ms,
                        "ponytail_eager_ms": eager_ms, "sdpa_ms": sdpa_ms,
                        "ponytail_tbps": tbps(kv_bytes, ours_ms), "sdpa_tbps": tbps(kv_bytes, sdpa_ms),
                        "ratio": sdpa_ms / ours_ms})
        print(f"  {name} {plan}: {results[-1]['ponytail_tbps']:.2f} TB/s vs SDPA "
              f"{results[-1]['sdpa_tbps']:.2f} TB/s ({results[-1]['ratio']:.2f})", flush=True)
    del cache, k, v
    return results


def bench_prefill(batch, heads, kv_heads, head_dim, context, new, dtype, device, iters) -> dict:
    total = context + new
    cache, tables, seq_lens = make_paged(batch, kv_heads, head_dim, total, dtype, device, seed=1)
    k, v = contiguous_kv(cache, tables, seq_lens)
    group = heads // kv_heads
    k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    query = torch.randn(batch, heads, new, head_dim, device=device, dtype=dtype)
    scale = 1 / math.sqrt(head_dim)
    if context == 0:
        causal = {"is_causal": True}
    else:
        from torch.nn.attention.bias import causal_lower_right

        causal = {"attn_mask": causal_lower_right(new, total)}

    if context == 0:  # the engine's first-chunk path, on its layout (views of the model's tensors)
        tokens_q = query.transpose(0, 1).reshape(heads, batch * new, head_dim)
        tokens_k = k.transpose(0, 1).reshape(kv_heads, batch * new, head_dim)
        tokens_v = v.permute(0, 2, 1, 3).reshape(batch * new, kv_heads, head_dim).transpose(0, 1)
        runs = equal_length_runs([new] * batch)
        cu = torch.arange(0, (batch + 1) * new, new, dtype=torch.int32, device=device)

        def ours():
            out = attention_over_new_tokens(tokens_q, tokens_k, tokens_v, runs, cu, new, scale)
            return out.view(batch, new, heads, head_dim)
    else:
        def ours():  # [B, Hq, T, D], a transposed view of [B, T, Hq, D]: the layout is free
            out = paged_attention(cache.storage, 0, query, tables, seq_lens, None, scale)
            return out.transpose(1, 2).contiguous()

    # Both sides hand over what the model's output projection reads, [B, T, Hq, D] contiguous;
    # for SDPA that is transformers' own `attn_output.transpose(1, 2).contiguous()` after the call.
    def sdpa_kernel():
        return F.scaled_dot_product_attention(query, k_rep, v_rep, scale=scale, **causal)

    def sdpa():
        return sdpa_kernel().transpose(1, 2).contiguous()

    err = rel_error(ours(), sdpa())
    if err > MAX_REL_ERROR:
        raise SystemExit(f"prefill B={batch} T={new} ctx={context}: relative error {err:.2e} vs SDPA")
    ours_ms = graph_ms(ours, iters=iters, device=device, reps=REPS)
    sdpa_ms = graph_ms(sdpa, iters=iters, device=device, reps=REPS)
    kernel_ms = graph_ms(sdpa_kernel, iters=iters, device=device, reps=REPS)
    ours_eager_ms = median_ms(ours, iters=iters, device=device)
    sdpa_eager_ms = median_ms(sdpa, iters=iters, device=device)
    del cache, k, v, k_rep, v_rep
    tokens = batch * new
    return {"case": f"prefill B={batch} Hq={heads} Hkv={kv_heads} D={head_dim} T={new} ctx={context}",
            "kind": "prefill", "rel_error": err, "ponytail_ms": ours_ms, "sdpa_ms": sdpa_ms,
            "ponytail_tok_s": tokens / (ours_ms * 1e-3), "sdpa_tok_s": tokens / (sdpa_ms * 1e-3),
            "ratio": sdpa_ms / ours_ms, "sdpa_kernel_only_ms": kernel_ms, "kernel_only_ratio": kernel_ms / ours_ms,
            "ponytail_eager_ms": ours_eager_ms, "sdpa_eager_ms": sdpa_eager_ms,
            "eager_ratio": sdpa_eager_ms / ours_eager_ms}


def parse_launch(text: str) -> dict:
    """"key=value,key=value" -> overrides of attention.decode_kernel.LAUNCH."""
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in decode_kernel.LAUNCH:
            raise SystemExit(f"--launch {item}: unknown key; known: {', '.join(decode_kernel.LAUNCH)}")
        out[key] = int(value)
    return out


def selected(only: str, case: str) -> bool:
    """--only's filter: the case name contains one of the |-separated alternatives."""
    return any(part in case for part in only.split("|"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="small sizes (CPU or quick GPU check)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--launch", action="append", default=[], metavar="K=V,K=V",
                        help="time decode again with these attention.decode_kernel.LAUNCH overrides "
                             "(repeatable: one set each; the defaults always run first)")
    parser.add_argument("--only", default="",
                        help="run only cases whose name contains this (alternatives separated by |)")
    parser.add_argument("--decode-only", action="store_true")
    parser.add_argument("--fa3", action="store_true",
                        help="decode against vLLM's FlashAttention-3 too (vllm.vllm_flash_attn importable, sm90)")
    args = parser.parse_args()
    if args.fa3 and (problem := fa3_problem()) is not None:
        print(f"--fa3: {problem}", file=sys.stderr)
        return 2
    launch_sets = [{}] + [parse_launch(text) for text in args.launch]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.small:
        print("no CUDA device: run with --small for a CPU sanity run", file=sys.stderr)
        return 2
    dtype = torch.bfloat16
    if args.small:
        decode = [(2, 4, 4, 64, 256), (2, 4, 2, 64, 300)]
        prefill = [(2, 4, 2, 64, 0, 16), (2, 4, 2, 64, 32, 16)]
        iters = 3
    else:
        decode = [(64, 32, kv, 128, ctx) for ctx in (1024, 4096, 16384) for kv in (32, 8)]
        decode += [(4, 32, kv, 128, 32768) for kv in (32, 8)]
        decode += [(16, 32, 32, 128, 4096)]  # bench_engine's long decode: 3.4 TB/s in the engine's profile
        # mixed's small decode batches, where the split plan decides (a third of its steps have <= 8 rows)
        decode += [(b, 32, 32, 128, ctx) for b, ctx in ((1, 2048), (1, 8192), (4, 2048), (8, 1024), (32, 2048))]
        prefill = [(4, 32, 8, 128, ctx, new) for new in (512, 2048) for ctx in (0, 4096)]
        iters = args.iters
    results = []
    for b, h, kv, d, ctx in decode:
        if selected(args.only, f"decode B={b} Hq={h} Hkv={kv} D={d} ctx={ctx}"):
            results += bench_decode(b, h, kv, d, ctx, dtype, device, iters, launch_sets, args.fa3)
            torch.cuda.empty_cache() if device.type == "cuda" else None
    if not args.decode_only:
        for b, h, kv, d, ctx, new in prefill:
            if selected(args.only, f"prefill B={b} Hq={h} Hkv={kv} D={d} T={new} ctx={ctx}"):
                results.append(bench_prefill(b, h, kv, d, ctx, new, dtype, device, iters))
                torch.cuda.empty_cache() if device.type == "cuda" else None
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "kernels": os.environ.get("PONYTAIL_KERNELS", "auto"),
           "launch": dict(decode_kernel.LAUNCH)}
    print(f"\n{env}")
    print(f"{'decode case':44s} {'launch':26s} {'ponytail':>10s} {'SDPA':>10s} {'ratio':>6s} {'rel err':>8s} "
          f"{'eager':>10s} {'FA3':>10s} {'vs FA3':>6s}")
    for r in results:
        if r["kind"] == "decode":
            fa3_cols = (f" {tbps(r['kv_bytes'], r['fa3_ms']):7.2f}TB/s {r['fa3_ms'] / r['ponytail_ms']:6.2f}"
                        if r["fa3_ms"] else "")
            print(f"{r['case']:44s} {r['plan'] or '':26s} {r['ponytail_tbps']:7.2f}TB/s "
                  f"{r['sdpa_tbps']:7.2f}TB/s {r['ratio']:6.2f} {r['rel_error']:8.1e} "
                  f"{tbps(r['kv_bytes'], r['ponytail_eager_ms']):7.2f}TB/s{fa3_cols}")
    print(f"{'prefill case':60s} {'ponytail':>10s} {'SDPA':>10s} {'ratio':>6s} {'kernel only':>11s} "
          f"{'rel err':>8s} {'eager: ponytail':>16s} {'SDPA':>8s} {'ratio':>6s}")
    for r in results:
        if r["kind"] == "prefill":
            print(f"{r['case']:60s} {r['ponytail_tok_s'] / 1e3:7.0f}k/s {r['sdpa_tok_s'] / 1e3:7.0f}k/s "
                  f"{r['ratio']:6.2f} {r['kernel_only_ratio']:11.2f} {r['rel_error']:8.1e} "
                  f"{r['ponytail_eager_ms'] * 1e3:13.0f}us "
                  f"{r['sdpa_eager_ms'] * 1e3:6.0f}us {r['eager_ratio']:6.2f}")
    print("decode bandwidth = K+V bytes attended / time, timed as CUDA-graph replays of "
          f"{REPS} calls (device time); 'eager' = {REPS} plain calls back to back, host overhead "
          "included; ratio = ponytail / SDPA speed (SDPA time / ours); vs FA3 = ours / vLLM's "
          "FlashAttention-3 speed. Prefill tokens/s likewise from "
          "graph replays, both sides ending in the [B, T, Hq, D] layout the output projection reads (for "
          "SDPA, transformers' transpose(1, 2).contiguous()); 'kernel only' = against SDPA's call "
          "alone; the eager columns time single calls, host overhead included.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
