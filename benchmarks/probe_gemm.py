"""How fast the decoder's projections run at the row counts the engine gives them, and whether
another way of calling the same GEMM is faster.

Decode steps of bench_engine's fixed workload multiply 64 rows by every weight of the model: at
64 rows the GEMMs are memory-bound, and the seventeenth session's profile put them at ~3.3 TB/s of
weights (4.1 ms a step on the 7B shape) where the attention kernel streams 4.35. Prefill steps
(8,192 rows) are compute-bound. For each projection of one decoder layer (fused q/k/v, o, fused
gate/up, down) and the LM head, at each row count, this times:

  linear          F.linear(x, weight): weight [out, in] as transformers stores it (what runs now)
  linear_lt       the same with torch's preferred BLAS library set to cuBLASLt
  transposed      x @ weight_t, the weight stored [in, out] contiguously
  transposed_lt   the same with cuBLASLt
  triton          inductor's max-autotune Triton GEMM templates for this exact shape (slow to build:
                  off unless --methods names it)
  lt_best         cuBLASLt on the column-major weight (what the engine runs) by every algorithm its
                  heuristic lists (cublaslt.py): the fastest, with its rank; lt_first is rank 0
                  through the same binding, which should time as transposed_lt
  skinny          ponytail's skinny GEMM kernel (kernels/skinny_gemm.py) on the column-major weight,
                  at most 16 rows; skinny_s4_u2_c3 fixes its launch (splits 4, unroll 2, the
                  split aimed at 3 CTAs per SM); each letter may be left out

Each result is checked against float32 first (relative error < 1e-2), then timed as CUDA-graph
replays (device time). A step's GEMM time = the layer's projections x layers + the LM head.

    python benchmarks/probe_gemm.py                                  # 7B shape, rows 64 and 8192
    python benchmarks/probe_gemm.py --rows 16,64,256 --methods linear,linear_lt,triton
    python benchmarks/probe_gemm.py --small                          # CPU sanity run
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from timing import graph_ms, tbps

from ponytail.runner.gemm_layout import blas_library

METHODS = ("linear", "linear_lt", "transposed", "transposed_lt", "triton", "lt_best", "lt_first", "skinny")
DEFAULT_METHODS = ("linear", "linear_lt", "transposed", "transposed_lt")
MAX_REL_ERROR = 1e-2


@dataclass
class Projection:
    name: str
    in_features: int
    out_features: int
    per_step: int  # calls in one forward pass (layers, or 1 for the LM head)


def projections(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, layers: int,
                vocab: int) -> list[Projection]:
    qkv = (heads + 2 * kv_heads) * head_dim
    return [Projection("qkv", hidden, qkv, layers), Projection("o", heads * head_dim, hidden, layers),
            Projection("gate_up", hidden, 2 * intermediate, layers), Projection("down", intermediate, hidden, layers),
            Projection("lm_head", hidden, vocab, 1)]


def skinny_fn(method: str, x: torch.Tensor, weight: torch.Tensor):
    """The skinny kernel's callable (see the docstring's skinny_s4_u2_c3), or None where it cannot run."""
    from ponytail.kernels import skinny_gemm

    plan = {part[0]: int(part[1:]) for part in method.split("_")[1:]}
    column_major = weight.t().contiguous().t()
    skinny_gemm.prepare(x.device, weight.shape[0])
    if skinny_gemm.unsupported(x, column_major) is not None:
        return None
    splits = plan.get("s")
    if splits is None and "c" in plan:
        sm_count = torch.cuda.get_device_properties(x.device).multi_processor_count
        splits = skinny_gemm.plan_splits(weight.shape[0], weight.shape[1], sm_count, plan["c"])
    return lambda: skinny_gemm.skinny_linear(x, column_major, splits=splits, unroll=plan.get("u"))


def gemm_fn(method: str, x: torch.Tensor, weight: torch.Tensor):
    """A zero-argument callable computing x @ weight.T the way `method` says, and its BLAS library
    (None instead of the callable where the method cannot take this product)."""
    if method.startswith("skinny"):
        return skinny_fn(method, x, weight), None
    if method in ("linear", "linear_lt"):
        return (lambda: F.linear(x, weight)), ("cublaslt" if method == "linear_lt" else None)
    if method in ("transposed", "transposed_lt"):
        weight_t = weight.t().contiguous()
        return (lambda: torch.mm(x, weight_t)), ("cublaslt" if method == "transposed_lt" else None)
    if method == "triton":
        import torch._inductor.config as inductor_config

        with inductor_config.patch(max_autotune=True, max_autotune_gemm_backends="TRITON",
                                   max_autotune_gemm_search_space="EXHAUSTIVE"):
            compiled = torch.compile(lambda a, b: F.linear(a, b), dynamic=False, fullgraph=True)
            compiled(x, weight)  # autotunes and builds here, not inside the timing
        return (lambda: compiled(x, weight)), None
    raise ValueError(f"method {method!r}: choose from {', '.join(METHODS)}")


def measure_lt(method: str, rows: int, proj: Projection, x, weight, expected, device, iters: int) -> dict:
    """lt_best / lt_first: every algorithm cuBLASLt's heuristic lists for this product, checked and timed."""
    from cublaslt import LtLinear

    lt = LtLinear(rows, proj.in_features, proj.out_features, x.dtype, device)
    weight_t = weight.t().contiguous()
    out = torch.empty(rows, proj.out_features, device=device, dtype=x.dtype)
    algos = lt.algorithms()
    if method == "lt_first":
        algos = algos[:1]
    timed = []
    for algo in algos:
        got = lt(algo, x, weight_t, out).float()
        error = ((got - expected).norm() / expected.norm()).item()
        if not error < MAX_REL_ERROR:
            print(f"  {algo.label}: relative error {error:.2e}, skipped", flush=True)
            continue
        ms = graph_ms(lambda: lt(algo, x, weight_t, out), iters=iters, device=device, reps=4)
        timed.append({"algo": algo.label, "index": algo.index, "ms": ms, "rel_error": error})
    if not timed:
        raise SystemExit(f"{method} {proj.name} rows {rows}: no algorithm within {MAX_REL_ERROR} of float32")
    best = min(timed, key=lambda t: t["ms"])
    return {"ms": best["ms"], "rel_error": best["rel_error"], "algo": best["algo"], "algos": timed}


def measure(method: str, rows: int, proj: Projection, device, dtype, iters: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(rows * 7 + proj.out_features)
    x = torch.randn(rows, proj.in_features, device=device, dtype=dtype, generator=gen)
    weight = torch.randn(proj.out_features, proj.in_features, device=device, dtype=dtype, generator=gen)
    weight /= proj.in_features ** 0.5
    expected = x.float() @ weight.float().t()
    if method.startswith("lt_"):
        return result(method, rows, proj, weight, **measure_lt(method, rows, proj, x, weight, expected, device, iters))
    fn, library = gemm_fn(method, x, weight)
    if fn is None:
        return None
    with blas_library(library):
        got = fn()
        error = ((got.float() - expected).norm() / expected.norm()).item()
        if not error < MAX_REL_ERROR:
            raise SystemExit(f"{method} {proj.name} rows {rows}: relative error {error:.2e} against float32")
        ms = graph_ms(fn, iters=iters, device=device, reps=4)
    return result(method, rows, proj, weight, ms=ms, rel_error=error)


def result(method: str, rows: int, proj: Projection, weight: torch.Tensor, *, ms: float, **fields) -> dict:
    """One measurement's row: its time, the weight's streaming rate and the multiply-adds' rate."""
    flops = 2 * rows * proj.in_features * proj.out_features
    return {"method": method, "rows": rows, "projection": proj.name, "ms": ms, **fields,
            "weight_tbps": tbps(weight.numel() * weight.element_size(), ms), "tflops": flops / (ms * 1e-3) / 1e12}


def step_totals(results: list[dict], projs: list[Projection]) -> dict:
    """(method, rows) -> ms of one forward pass's GEMMs (projections x calls per pass)."""
    per_step = {p.name: p.per_step for p in projs}
    totals: dict[tuple[str, int], float] = {}
    for r in results:
        key = (r["method"], r["rows"])
        totals[key] = totals.get(key, 0.0) + r["ms"] * per_step[r["projection"]]
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="64,8192", help="comma-separated row counts (tokens in a step)")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=11008)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--small", action="store_true", help="tiny sizes (CPU sanity run)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if (m.split("_")[0] if m.startswith("skinny") else m) not in METHODS]
    if unknown:
        parser.error(f"--methods {','.join(unknown)}: not a method; choose from {', '.join(METHODS)}")
    try:
        rows_list = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        parser.error(f"--rows {args.rows!r}: expected comma-separated positive integers")
    if not rows_list or min(rows_list) < 1:
        parser.error(f"--rows {args.rows!r}: expected comma-separated positive integers")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.small:
        print("no CUDA device: run with --small for a CPU sanity run", file=sys.stderr)
        return 2
    if device.type == "cpu" and any(m == "triton" or m.startswith("lt_") for m in methods):
        parser.error(f"--methods {','.join(methods)}: triton and lt_* need a CUDA device")
    if args.small:
        projs = projections(64, 160, 4, 2, 16, 2, 300)
        rows_list, iters, dtype = [3, 17], 2, torch.float32
    else:
        projs = projections(args.hidden, args.intermediate, args.heads, args.kv_heads, args.head_dim,
                            args.layers, args.vocab)
        iters, dtype = args.iters, torch.bfloat16
    results = []
    for rows in rows_list:
        for proj in projs:
            line = [f"rows {rows:5d} {proj.name:8s} {proj.in_features:6d}x{proj.out_features:<6d}"]
            for method in methods:
                r = measure(method, rows, proj, device, dtype, iters)
                if r is None:
                    line.append(f"{method} -")
                    continue
                results.append(r)
                line.append(f"{method} {r['ms'] * 1e3:8.1f} us {r['weight_tbps']:5.2f} TB/s {r['tflops']:6.1f} TF"
                            + (f" [{r['algo']} of {len(r['algos'])}]" if "algo" in r else ""))
            print("  |  ".join(line), flush=True)
    totals = step_totals(results, projs)
    for rows in rows_list:
        base = totals.get(("linear", rows))
        print(f"rows {rows}: one forward pass's GEMMs: " + ", ".join(
            f"{m} {totals[(m, rows)]:.3f} ms" + (f" ({base / totals[(m, rows)]:.3f}x)" if base else "")
            for m in methods if (m, rows) in totals))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"projections": [asdict(p) for p in projs], "results": results,
                       "step_ms": [{"method": m, "rows": r, "ms": ms} for (m, r), ms in totals.items()],
                       "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
