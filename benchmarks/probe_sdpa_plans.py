"""What a new shape costs torch SDPA on the GPU: first call vs the next, per backend.

    python benchmarks/probe_sdpa_plans.py            # SmolLM2-135M's attention shape, bf16, 12 lengths

cuDNN (SDPA's choice on Hopper for bf16) builds an execution plan for each new shape and caches
it; the flash backend has no plans. A server's prefill chunks come in ever new lengths, so the
first-call cost is what a step pays (chunk_attention.SdpaShapes is the answer to it). Prints the
milliseconds of each call, synchronized, and the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed_ms(q: torch.Tensor) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    F.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--lengths", type=int, default=12, help="random lengths in [100, 2048) per backend")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device: torch.cuda.is_available() is False", file=sys.stderr)
        return 0
    device = torch.device("cuda")
    for name, backend in (("default (cuDNN on Hopper)", None), ("flash", SDPBackend.FLASH_ATTENTION)):
        firsts, seconds = [], []
        for length in random.Random(name).sample(range(100, 2048), args.lengths):
            q = torch.randn(1, args.heads, length, args.head_dim, device=device, dtype=torch.bfloat16)
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                firsts.append(timed_ms(q))
                seconds.append(timed_ms(q))
        print(f"{name}: first call {statistics.median(firsts):.2f} ms median "
              f"({min(firsts):.2f}-{max(firsts):.2f}), second {statistics.median(seconds):.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
