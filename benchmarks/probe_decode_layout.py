"""Why the paged decode kernel reads K/V slower inside the engine than in bench_attention.

bench_attention's decode case (one layer, a pool of just the blocks it needs, blocks scattered at
random, tables exactly as wide as the rows) reads K/V at ~4.3 TB/s on an H200; inside the engine
the profiler saw ~3.4 TB/s for the same kernel (docs/benchmarks.md, twelfth and fifteenth
sessions), and decode steps are half that kernel. This probe starts from bench_attention's setup
and moves one thing at a time toward the engine's, timing the same kernel on each layout:

  base         one layer, the blocks it needs (8 chunks), scattered, exact table width
  wide         base, tables padded to max_model_len's blocks, as the decode CUDA graphs hold them
  layers       every layer, one call per layer in order, as one forward makes them
  pool         layers, in the chunks the engine's budget gives (an eighth of it each), blocks
               scattered over all the chunks the rows need
  engine       layers, the blocks PagedKVCache.allocate/append hand out the way the engine asks:
               every prompt whole, then one token per row per decode step
  engine-wide  engine, tables padded as in `wide`

Each layout is checked against SDPA on the same K/V gathered contiguously (its last layer) before
it is timed as CUDA-graph replays of one call per layer (device time; 32 calls of layer 0 where
there is one layer). Bandwidth = K+V bytes the rows attend / time.

    python benchmarks/probe_decode_layout.py                                      # fixed's decode
    python benchmarks/probe_decode_layout.py --batch 16 --prompt 4096 --context 4352   # long's
    python benchmarks/probe_decode_layout.py --small                               # CPU sanity run
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from timing import graph_ms, tbps

from ponytail import CacheConfig, PagedKVCache
from ponytail.attention import decode as decode_kernel, prefill_cupy, torch_fallback
from ponytail.attention.paged import paged_attention
from ponytail.utils.arith import cdiv

LAYOUTS = ("base", "wide", "layers", "pool", "engine", "engine-wide")
MAX_REL_ERROR = 2e-2
CALLS = 32  # kernel calls per graph replay


@dataclass
class Shape:
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    prompt: int  # tokens each row's prompt allocates at once (engine layouts)
    context: int  # tokens each row attends
    max_model_len: int
    budget_bytes: int
    block_size: int = 16


@dataclass
class Layout:
    cache: PagedKVCache
    tables: torch.Tensor  # [batch, width] int32
    seq_lens: torch.Tensor  # [batch] int32
    layers: int


def _cache(shape: Shape, layers: int, budget_blocks: int, chunk_blocks: int, chunks: int, device, dtype):
    config = CacheConfig(num_layers=layers, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim, dtype=dtype,
                         max_batch_size=1, max_seq_len=budget_blocks * shape.block_size, block_size=shape.block_size,
                         chunk_blocks=chunk_blocks, device=device)
    return PagedKVCache(config, initial_chunks=chunks)


def _fill(cache: PagedKVCache, seed: int) -> None:
    gen = torch.Generator(device=cache.storage.device).manual_seed(seed)
    for chunk in cache.storage.chunks:
        chunk.normal_(generator=gen)


def _padded(rows: list[list[int]], width: int, device) -> torch.Tensor:
    return torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.int32, device=device)


def build(name: str, shape: Shape, device, dtype, seed: int = 0) -> Layout:
    per_row = cdiv(shape.context, shape.block_size)
    needed = shape.batch * per_row
    wide = cdiv(shape.max_model_len, shape.block_size) if name.endswith("wide") else per_row
    layers = 1 if name in ("base", "wide") else shape.layers
    seq_lens = torch.full((shape.batch,), shape.context, dtype=torch.int32, device=device)
    if name in ("base", "wide", "layers"):
        chunk_blocks = cdiv(needed, 8)
        cache = _cache(shape, layers, chunk_blocks * 8, chunk_blocks, 8, device, dtype)
        rows = None
    else:  # the engine's chunking: an eighth of the budget each, grown as the rows need them
        block_bytes = 2 * shape.block_size * shape.kv_heads * shape.head_dim * dtype.itemsize * layers
        budget_blocks = max(needed, shape.budget_bytes // block_bytes)
        chunk_blocks = cdiv(budget_blocks, 8)
        cache = _cache(shape, layers, budget_blocks, chunk_blocks, 1 if name.startswith("engine") else
                       cdiv(needed, chunk_blocks), device, dtype)
        rows = _engine_rows(cache, shape) if name.startswith("engine") else None
    _fill(cache, seed)
    if rows is None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        order = torch.randperm(cache.storage.num_blocks, generator=gen)[:needed].view(shape.batch, per_row)
        rows = order.tolist()
    return Layout(cache, _padded(rows, wide, device), seq_lens, layers)


def _engine_rows(cache: PagedKVCache, shape: Shape) -> list[list[int]]:
    """Block tables as the engine's allocator hands them out: prompts first, then decode tokens
    one per row per step (no prefix is shared: nothing is marked computed)."""
    for row in range(shape.batch):
        if not cache.allocate(row, [row] * min(shape.prompt, shape.context)):
            raise SystemExit(f"the pool cannot hold row {row}'s prompt")
    for _ in range(shape.context - shape.prompt):
        for row in range(shape.batch):
            if not cache.append(row, [0]):
                raise SystemExit("the pool ran out of blocks while rows decoded")
    return [cache.block_table(row) for row in range(shape.batch)]


def measure(layout: Layout, shape: Shape, iters: int, dtype) -> dict:
    storage, device = layout.cache.storage, layout.cache.storage.device
    query = torch.randn(shape.batch, shape.heads, 1, shape.head_dim, device=device, dtype=dtype)
    scale = 1 / math.sqrt(shape.head_dim)
    last = layout.layers - 1
    gather = prefill_cupy.gather_padded if device.type == "cuda" else torch_fallback.gather_torch
    k, v = gather(storage, last, layout.tables, layout.seq_lens)
    k, v = k[:, :, : shape.context], v[:, :, : shape.context]
    expected = F.scaled_dot_product_attention(query, k, v, scale=scale, enable_gqa=shape.heads != shape.kv_heads)
    got = paged_attention(storage, last, query, layout.tables, layout.seq_lens, None, scale)
    error = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
    if not error < MAX_REL_ERROR:
        raise SystemExit(f"relative error {error:.2e} against SDPA on the same K/V")
    layer_of = [i % layout.layers for i in range(CALLS)]

    def step():
        for layer in layer_of:
            paged_attention(storage, layer, query, layout.tables, layout.seq_lens, None, scale)

    ms = graph_ms(step, iters=iters, device=device) / CALLS
    kv_bytes = 2 * shape.batch * shape.context * shape.kv_heads * shape.head_dim * dtype.itemsize
    plan = None
    if device.type == "cuda":
        p = decode_kernel.decode_plan(storage, shape.batch, shape.heads, layout.tables.shape[1])
        plan = f"splits={p.splits} split_tokens={p.split_tokens}"
    return {"ms_per_call": ms, "tbps": tbps(kv_bytes, ms), "rel_error": error, "plan": plan,
            "table_width": layout.tables.shape[1], "chunks": len(storage.chunks),
            "pool_bytes": storage.allocated_bytes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512, help="tokens each row allocates at once")
    parser.add_argument("--context", type=int, default=1024, help="tokens each row attends (>= --prompt)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=8192, help="the width `wide` pads tables to")
    parser.add_argument("--budget-gib", type=float, default=110.0,
                        help="the engine's KV budget: its chunks are an eighth of it")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--small", action="store_true", help="tiny sizes (CPU sanity run)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"--layouts {','.join(unknown)}: not a layout; choose from {', '.join(LAYOUTS)}")
    if args.context < args.prompt:
        parser.error(f"--context {args.context} must be at least --prompt {args.prompt}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.small:
        print("no CUDA device: run with --small for a CPU sanity run", file=sys.stderr)
        return 2
    dtype = torch.bfloat16
    if args.small:
        shape = Shape(batch=3, heads=4, kv_heads=2, head_dim=64, layers=3, prompt=20, context=45,
                      max_model_len=128, budget_bytes=4 << 20)
        iters = 2
    else:
        shape = Shape(args.batch, args.heads, args.kv_heads, args.head_dim, args.layers, args.prompt, args.context,
                      args.max_model_len, int(args.budget_gib * (1 << 30)))
        iters = args.iters
    print(f"{shape}")
    results = []
    for name in layouts:
        layout = build(name, shape, device, dtype)
        result = {"layout": name, **measure(layout, shape, iters, dtype)}
        results.append(result)
        print(f"{name:12s} {result['tbps']:6.2f} TB/s  {result['ms_per_call'] * 1e3:8.1f} us/call  "
              f"width {result['table_width']:4d}  chunks {result['chunks']}  pool {result['pool_bytes'] / 1e9:.1f} GB  "
              f"{result['plan'] or ''}  err {result['rel_error']:.1e}", flush=True)
        del layout
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": asdict(shape), "results": results,
                       "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
