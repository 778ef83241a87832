"""The card's read bandwidth, the ceiling of bench_engine's fixed workload on it.

Fixed's decode steps read every weight once (64 rows: memory-bound GEMMs) and every row's K/V once
per layer (the attention kernel); together ~49 TB over the run on the 7B shape. The thirty-second
session's profile put ours at 3.02 TB/s for K/V and 2.71 for weights on the H100, vLLM's at 2.94
and 2.53. What could any engine reach there? This probe streams the same byte counts through
kernels that do nothing but read (read_bandwidth.cu: 16-byte non-caching loads, several in flight
per thread) and reports:

  sweep    each read size of a decode step (each projection's weight, one layer's K/V at fixed's mean
           context) through every launch configuration, as CUDA-graph replays over distinct buffers
           (2 GiB or more, so the 50 MB L2 never holds a repeat); copy_ as a reference. K/V also
           as the attention reads it: one CTA per row and KV head, 256-byte pieces of each token
  step     one 7B decode step's reads as the engine orders them (per layer: q/k/v weight, K/V,
           o, gate/up, down; then the LM head), distinct weight buffers as a model has, each read by
           its size's best configuration, at three contexts; the step's time is linear in the
           context, so fixed's whole decode (contexts 513 to 1,536) is the fitted line summed

Before any timing, each configuration's kernel must find a marker planted at the first, last and a
random 16-byte vector of a buffer (the store it makes only then proves that vector was read).

    python benchmarks/probe_bandwidth.py --json bw.json          # needs a CUDA device and CuPy
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch

from timing import graph_ms, median_ms, tbps

MARKER = 0xDEADBEEF
VECTOR = 16  # bytes a thread loads at once
SWEEP_BYTES = 2 << 30  # buffers rotated per timed graph
LAYER_READS = ("qkv", "kv", "o", "gate_up", "down")  # one layer's reads in a decode step, in the engine's order
FIXED_CONTEXTS = (513, 1536)  # the first and last context fixed's decode steps attend (512-token prompts)


@dataclass(frozen=True)
class Shape:
    """A Llama decoder's sizes and a decode step's rows (bench_engine's 7B shape and fixed's 64)."""

    hidden: int = 4096
    intermediate: int = 11008
    heads: int = 32
    kv_heads: int = 32
    head_dim: int = 128
    layers: int = 32
    vocab: int = 32000
    rows: int = 64
    dtype_bytes: int = 2

    def weights(self) -> dict[str, int]:
        """Bytes of each weight one layer reads (and the LM head's, read once a step)."""
        b, h = self.dtype_bytes, self.hidden
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        return {"qkv": h * qkv * b, "o": self.heads * self.head_dim * h * b, "gate_up": h * 2 * self.intermediate * b,
                "down": self.intermediate * h * b, "lm_head": h * self.vocab * b}

    def kv_bytes(self, context: int) -> int:
        """K and V one layer's decode attention reads for all rows at `context` tokens each."""
        return self.rows * context * 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    def step_reads(self, context: int) -> list[tuple[str, int]]:
        sizes = dict(self.weights(), kv=self.kv_bytes(context))
        return [(name, sizes[name]) for name in LAYER_READS] * self.layers + [("lm_head", sizes["lm_head"])]


@dataclass(frozen=True)
class Launch:
    kind: str  # strided (persistent grid), chunked (one CTA a chunk) or heads (one CTA a row's KV head)
    unroll: int
    threads: int
    ctas_per_sm: int = 0  # strided
    chunks: int = 0  # chunked, heads (rows x KV heads)
    heads: int = 0  # heads
    head_vectors: int = 0  # heads: 16-byte vectors in one token's head

    @property
    def label(self) -> str:
        if self.kind == "strided":
            return f"strided u{self.unroll} t{self.threads} c{self.ctas_per_sm}"
        return f"{self.kind} u{self.unroll} t{self.threads} x{self.chunks}"


def launches(shape: Shape) -> list[Launch]:
    strided = [Launch("strided", u, t, c) for u in (2, 4, 8) for t in (256, 512) for c in (1, 2, 4, 8)
               if t * c <= 2048]
    # the attention's grid: one CTA per row and KV head (a split-free decode plan)
    grid = shape.rows * shape.kv_heads
    chunked = [Launch("chunked", u, t, chunks=grid) for u in (2, 4) for t in (128, 256)]
    head_vectors = shape.head_dim * shape.dtype_bytes // VECTOR
    heads = [Launch("heads", u, t, chunks=grid, heads=shape.kv_heads, head_vectors=head_vectors)
             for u in (2, 4) for t in (128, 256)]
    return strided + chunked + heads


def decode_seconds(step_ms: dict[int, float], first: int, last: int) -> float:
    """Seconds for decode steps at contexts first..last, the step time fitted as a line in the context."""
    xs, ys = list(step_ms), list(step_ms.values())
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    steps = last - first + 1
    mean_context = (first + last) / 2
    return steps * (mean_y + slope * (mean_context - mean_x)) / 1e3


class ReadKernels:
    """read_bandwidth.cu's kernels, launched on torch's current stream (CUDA-graph capturable)."""

    def __init__(self, device: torch.device):
        import cupy

        from ponytail.kernels.loader import on_torch_stream

        self.device, self.on_stream = device, on_torch_stream
        names = [f"read_{kind}<{u}>" for kind in ("strided", "chunked", "heads") for u in (2, 4, 8)]
        source = (Path(__file__).parent / "read_bandwidth.cu").read_text()
        with cupy.cuda.Device(device.index):
            self.module = cupy.RawModule(code=source, options=("--std=c++17",), name_expressions=names)
            self.module.compile()
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.sink = torch.zeros(1, dtype=torch.int32, device=device)

    def read(self, launch: Launch, buffer: torch.Tensor) -> None:
        n = buffer.numel() * buffer.element_size() // VECTOR
        src, sink = np.uint64(buffer.data_ptr()), np.uint64(self.sink.data_ptr())
        kernel = self.module.get_function(f"read_{launch.kind}<{launch.unroll}>")
        with self.on_stream(self.device):
            if launch.kind == "strided":
                kernel((self.sms * launch.ctas_per_sm,), (launch.threads,), (src, np.uint64(n), sink))
            elif launch.kind == "chunked":
                chunk = -(-n // launch.chunks)
                kernel((launch.chunks,), (launch.threads,), (src, np.uint64(n), np.uint64(chunk), sink))
            else:
                context, rest = divmod(n, 2 * launch.chunks * launch.head_vectors)
                if rest:
                    raise ValueError(f"{launch.label}: {n} vectors are not K and V of {launch.chunks} row heads")
                kernel((launch.chunks,), (launch.threads,), (src, np.uint32(context), np.uint32(launch.heads),
                       np.uint32(launch.head_vectors), np.uint64(n // 2), sink))

    def check(self, launch: Launch, buffer: torch.Tensor, rng: random.Random) -> None:
        """The kernel must see a marker planted at the first, last and a random vector."""
        words = buffer.view(torch.int32)
        n = words.numel() // 4
        for vector in (0, n - 1, rng.randrange(n)):
            self.sink.zero_()
            words[vector * 4 + rng.randrange(4)] = MARKER - (1 << 32)  # as int32
            self.read(launch, buffer)
            words.zero_()
            found = self.sink.item() & 0xFFFFFFFF
            if found != MARKER:
                raise AssertionError(f"{launch.label} missed the marker at vector {vector} of {n}")


def sweep(kernels: ReadKernels, shape: Shape, pool: torch.Tensor, iters: int) -> list[dict]:
    sizes = dict(shape.weights(), kv=shape.kv_bytes(1024))
    rng = random.Random(0)
    results = []
    for name, size in sizes.items():
        count = max(2, pool.numel() // size)
        buffers = [pool[i * size:(i + 1) * size] for i in range(count)]
        for launch in launches(shape):
            if launch.kind != "strided" and name != "kv":
                continue
            kernels.check(launch, buffers[0], rng)
            ms = graph_ms(lambda: [kernels.read(launch, b) for b in buffers], iters=iters,
                          device=pool.device) / count
            results.append({"read": name, "bytes": size, "launch": launch.label, **asdict(launch), "ms": ms,
                            "tb_per_s": tbps(size, ms)})
        half = pool.numel() // 2
        copy_ms = median_ms(lambda: pool[half:half + size].copy_(pool[:size]), iters=iters, device=pool.device)
        results.append({"read": name, "bytes": size, "launch": "copy_ (read + write)", "kind": "copy", "ms": copy_ms,
                        "tb_per_s": tbps(2 * size, copy_ms)})
    return results


def best_launches(results: list[dict]) -> dict[str, Launch]:
    best: dict[str, dict] = {}
    for r in results:
        if r["kind"] != "copy" and (r["read"] not in best or r["tb_per_s"] > best[r["read"]]["tb_per_s"]):
            best[r["read"]] = r
    return {name: Launch(**{f.name: r[f.name] for f in fields(Launch)}) for name, r in best.items()}


def step(kernels: ReadKernels, shape: Shape, best: dict[str, Launch], contexts: list[int], iters: int) -> dict:
    device = kernels.device
    w = shape.weights()
    weights = {(layer, name): torch.zeros(w[name], dtype=torch.uint8, device=device)
               for layer in range(shape.layers) for name in ("qkv", "o", "gate_up", "down")}
    lm_head = torch.zeros(w["lm_head"], dtype=torch.uint8, device=device)
    kv_pool = torch.zeros(shape.kv_bytes(max(contexts)), dtype=torch.uint8, device=device)
    rows = []
    step_ms = {}
    for context in contexts:
        reads = shape.step_reads(context)
        kv = kv_pool[:shape.kv_bytes(context)]
        buffers = [(best[name], kv if name == "kv" else weights[(layer, name)])
                   for layer in range(shape.layers) for name in LAYER_READS] + [(best["lm_head"], lm_head)]
        ms = graph_ms(lambda: [kernels.read(launch, b) for launch, b in buffers], iters=iters, device=device)
        total = sum(size for _, size in reads)
        kv_total = sum(size for name, size in reads if name == "kv")
        step_ms[context] = ms
        rows.append({"context": context, "ms": ms, "bytes": total, "kv_bytes": kv_total, "tb_per_s": tbps(total, ms)})
    first, last = FIXED_CONTEXTS
    return {"contexts": rows, "fixed_decode_s": decode_seconds(step_ms, first, last),
            "fixed_decode_bytes": sum(sum(size for _, size in shape.step_reads(c)) for c in range(first, last + 1))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--contexts", default="513,1024,1536")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("probe_bandwidth: needs a CUDA device (it times the card's memory), none here", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    shape = Shape()
    kernels = ReadKernels(device)
    pool = torch.zeros(SWEEP_BYTES, dtype=torch.uint8, device=device)
    results = sweep(kernels, shape, pool, args.iters)
    del pool
    best = best_launches(results)
    for r in results:
        print(f"{r['read']:>8} {r['bytes'] / 1e6:9.1f} MB  {r['launch']:<24} {r['ms'] * 1e3:9.1f} us "
              f"{r['tb_per_s']:6.3f} TB/s")
    print("best:", {name: launch.label for name, launch in best.items()})
    decode = step(kernels, shape, best, [int(c) for c in args.contexts.split(",")], args.iters)
    for row in decode["contexts"]:
        print(f"step at context {row['context']}: {row['ms']:.3f} ms, {row['bytes'] / 1e9:.2f} GB, "
              f"{row['tb_per_s']:.3f} TB/s")
    print(f"fixed's decode (contexts 513-1,536), reads only: {decode['fixed_decode_s']:.2f} s for "
          f"{decode['fixed_decode_bytes'] / 1e12:.1f} TB")
    report = {"device": torch.cuda.get_device_name(device), "shape": asdict(shape), "sweep": results,
              "best": {name: launch.label for name, launch in best.items()}, "step": decode}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
