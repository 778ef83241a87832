"""Block copy and slot write throughput against a plain torch device-to-device copy of the same bytes.

    python benchmarks/bench_cache_ops.py                 # H200-sized run (needs ~60 GB of GPU memory)
    python benchmarks/bench_cache_ops.py --small         # quick run, also on the CPU
    python benchmarks/bench_cache_ops.py --json out.json

Bandwidth counts bytes read plus bytes written. Every kernel's result is checked against the
torch fallback (bit for bit) before it is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch

from timing import median_ms, tbps

from ponytail import CacheConfig, PagedKVCache
from ponytail.kv import cache_ops

REPS = 10  # calls per timed sample: steady-state throughput


def make_cache(layers, kv_heads, head_dim, dtype, blocks, chunks, device) -> PagedKVCache:
    config = CacheConfig(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                         max_batch_size=1, max_seq_len=blocks * 16, block_size=16,
                         chunk_blocks=-(-blocks // chunks), device=device)
    return PagedKVCache(config, initial_chunks=chunks)


def fill_random(cache: PagedKVCache) -> None:
    for chunk in cache.storage.chunks:
        chunk.copy_(torch.randn(chunk.shape, device=chunk.device, dtype=torch.float32).to(chunk.dtype)
                    if chunk.device.type == "cpu" else torch.randn_like(chunk))


def plain_copy_ms(num_bytes: int, device, iters) -> float:
    src = torch.randn(num_bytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters=iters, reps=REPS, device=device)
    del src, dst
    return ms


def bench_block_copy(name, layers, kv_heads, head_dim, num_pairs, device, iters) -> dict:
    blocks = 2 * num_pairs
    cache = make_cache(layers, kv_heads, head_dim, torch.bfloat16, blocks, chunks=4, device=device)
    fill_random(cache)
    ids = list(range(blocks))
    random.Random(0).shuffle(ids)
    pairs = list(zip(ids[:num_pairs], ids[num_pairs:]))
    storage = cache.storage
    copied = num_pairs * cache.config.block_bytes

    # Check: the kernel result equals the fallback's, bit for bit.
    before = [storage.block_data(s).clone() for s, _ in pairs[:8]]
    cache_ops.copy_blocks(storage, pairs)
    for (s, d), ref in zip(pairs[:8], before):
        assert torch.equal(storage.block_data(d).view(torch.int16), ref.view(torch.int16)), "copy mismatch"

    kernel_ms = median_ms(lambda: cache_ops.copy_blocks(storage, pairs), iters=iters, reps=REPS, device=device)
    single_ms = median_ms(lambda: cache_ops.copy_blocks(storage, pairs), iters=iters, device=device)
    launch_only = {}
    if device.type == "cuda":  # the launch alone, pairs already on the device
        pair_tensor = torch.tensor(pairs, dtype=torch.int64, device=device)
        ms = median_ms(lambda: cache_ops.launch_copy_blocks(storage, pair_tensor), iters=iters, reps=REPS,
                       device=device)
        launch_only["launch_only_tbps"] = tbps(2 * copied, ms)
    del cache, storage, before
    base_ms = plain_copy_ms(copied, device, iters)
    return {**row(f"copy_blocks {name}", copied, kernel_ms, base_ms, single_ms), **launch_only}


def bench_slot_write(name, layers, kv_heads, head_dim, tokens, device, iters, per_layer=False) -> dict:
    num_blocks = tokens // 16
    cache = make_cache(layers, kv_heads, head_dim, torch.bfloat16, num_blocks, chunks=8, device=device)
    block_ids = list(range(num_blocks))
    random.Random(1).shuffle(block_ids)  # a long sequence's blocks are scattered over the pool
    positions = torch.arange(tokens)
    slots = (torch.tensor(block_ids)[positions // 16] * 16 + positions % 16).to(device)
    keys = torch.randn(layers, tokens, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    written = 2 * keys.numel() * keys.element_size()

    def write_all():
        if per_layer:
            for layer in range(layers):
                cache.write(keys[layer : layer + 1], values[layer : layer + 1], slots, layer_start=layer)
        else:
            cache.write(keys, values, slots)

    write_all()
    sample = torch.randint(0, tokens, (256,)).tolist()
    for t in sample:
        b, off = divmod(int(slots[t]), 16)
        block = cache.storage.block_data(b)
        assert torch.equal(block[:, 0, off], keys[:, t]) and torch.equal(block[:, 1, off], values[:, t]), \
            "slot write mismatch"
    kernel_ms = median_ms(write_all, iters=iters, reps=REPS, device=device)
    single_ms = median_ms(write_all, iters=iters, device=device)
    del cache, keys, values
    base_ms = plain_copy_ms(written, device, iters)
    label = "write_slots per layer" if per_layer else "write_slots all layers"
    return row(f"{label} {name}", written, kernel_ms, base_ms, single_ms)


def row(name, payload_bytes, kernel_ms, base_ms, single_ms) -> dict:
    moved = 2 * payload_bytes  # read + write
    return {"case": name, "payload_bytes": payload_bytes, "kernel_ms": kernel_ms, "torch_copy_ms": base_ms,
            "single_call_ms": single_ms, "single_call_tbps": tbps(moved, single_ms),
            "kernel_tbps": tbps(moved, kernel_ms), "torch_copy_tbps": tbps(moved, base_ms),
            "ratio": base_ms / kernel_ms}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="small sizes (CPU or quick GPU check)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.small:
        print("no CUDA device: run with --small for a CPU sanity run", file=sys.stderr)
        return 2
    if args.small:
        cases = [("copy", "7B-GQA8", 4, 8, 128, 16), ("write", "7B", 4, 8, 128, 1024)]
    else:
        cases = [
            ("copy", "7B-MHA (32x32x128)", 32, 32, 128, 64),  # 64 x 8.4 MB = 537 MB
            ("copy", "7B-GQA8 (32x8x128)", 32, 8, 128, 256),  # 256 x 2.1 MB = 537 MB
            ("write", "7B 32k prefill", 32, 32, 128, 32768),  # 17.2 GB of K+V
            ("write_layer", "7B 32k prefill", 32, 32, 128, 32768),
        ]
    results = []
    for kind, name, layers, heads, dim, n in cases:
        if kind == "copy":
            results.append(bench_block_copy(name, layers, heads, dim, n, device, args.iters))
        else:
            results.append(bench_slot_write(name, layers, heads, dim, n, device, args.iters,
                                            per_layer=kind == "write_layer"))
        torch.cuda.empty_cache() if device.type == "cuda" else None
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "kernels": os.environ.get("PONYTAIL_KERNELS", "auto")}
    print(f"\n{env}")
    print(f"{'case':44s} {'payload':>10s} {'ponytail':>10s} {'torch copy':>11s} {'ratio':>6s} {'1 call':>10s}")
    for r in results:
        print(f"{r['case']:44s} {r['payload_bytes'] / 1e6:8.0f}MB {r['kernel_tbps']:7.2f}TB/s "
              f"{r['torch_copy_tbps']:8.2f}TB/s {r['ratio']:6.2f} {r['single_call_tbps']:7.2f}TB/s")
    for r in results:
        if "launch_only_tbps" in r:
            print(f"  {r['case']}: launch alone {r['launch_only_tbps']:.2f} TB/s")
    print("bandwidth = (bytes read + bytes written) / time; ratio = ponytail / torch copy, both "
          f"timed {REPS} calls back to back; '1 call' = one isolated call, host overhead included")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
