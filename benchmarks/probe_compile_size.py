"""How the size of a compiled function's first call sets inductor's kernels for every later size.

torch.compile(dynamic=True) compiles at the first call and sizes each kernel's launch configuration
(size hints, then autotuning among their configs) by that call's shapes, then keeps it for every
later token count. This times the prefill step's elementwise kernels (SiLU x up on a fused gate/up
output, a residual add, an RMSNorm) at large token counts after a first call of `--first` tokens,
and with `torch._check(tokens <= bound)` (an upper bound on the symbol, which the first guess was
that inductor needed to index in int32; the generated code says which index type each kernel uses).

    python benchmarks/probe_compile_size.py --tokens 8192,16384 --first 2,16,64,512,16384 --json probe.json
"""

from __future__ import annotations

import argparse
import json
import re

import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

INTER, HIDDEN = 11008, 4096


def silu_mul(x):
    gate, up = x.split([INTER, INTER], dim=-1)
    return F.silu(gate) * up


def residual_add(x, y):
    return x + y


def rms_norm(x, weight):
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + 1e-6)).to(x.dtype)


def bounded(fn, bound):
    def wrapped(x, *rest):
        torch._check(x.shape[1] <= bound)
        return fn(x, *rest)
    return wrapped


def inputs(name, tokens):
    bf = dict(dtype=torch.bfloat16, device="cuda")
    if name == "silu_mul":
        return (torch.randn(1, tokens, 2 * INTER, **bf),)
    if name == "residual_add":
        return torch.randn(1, tokens, HIDDEN, **bf), torch.randn(1, tokens, HIDDEN, **bf)
    return torch.randn(1, tokens, HIDDEN, **bf), torch.randn(HIDDEN, **bf)


def time_ms(fn, args, reps=50):
    for _ in range(5):
        fn(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8192,16384")
    parser.add_argument("--bound", type=int, default=65536)
    parser.add_argument("--first", default="1000", help="token counts of the first (autotuning) call, one row each")
    parser.add_argument("--json")
    args = parser.parse_args()
    sizes = [int(t) for t in args.tokens.split(",")]
    # Each variant tunes afresh: no best config read back from an earlier variant's identical kernel.
    torch._inductor.config.fx_graph_cache = False
    torch._inductor.config.autotune_local_cache = False
    results = []
    firsts = [int(t) for t in args.first.split(",")]
    variants = [(f"first call {first}", first, False) for first in firsts] + [("bounded", firsts[0], True)]
    for name, fn in (("silu_mul", silu_mul), ("residual_add", residual_add), ("rms_norm", rms_norm)):
        for variant, first, bound in variants:
            body = bounded(fn, args.bound) if bound else fn
            torch._dynamo.reset()
            compiled = torch.compile(body, dynamic=True)
            _, codes = run_and_get_code(compiled, *inputs(name, first))
            code = "\n".join(codes)
            row = {"kernel": name, "variant": variant,  # an int64 index would name tl.int64 in the kernel
                   "index types named": sorted(set(re.findall(r"tl\.int64|tl\.int32", code)))}
            for tokens in sizes:
                args_t = inputs(name, tokens)
                ms = time_ms(compiled, args_t)
                moved = sum(a.numel() * a.element_size() for a in args_t) + compiled(*args_t).numel() * 2
                row[f"{tokens} tokens ms"] = round(ms, 4)
                row[f"{tokens} tokens TB/s"] = round(moved / ms / 1e9, 3)
            results.append(row)
            print(row, flush=True)
            configs = re.findall(r"triton_heuristics\.pointwise\([^)]*\)|triton_heuristics\.reduction\([^)]*\)", code)
            print("  ", configs[:2], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
