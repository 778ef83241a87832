"""Products of a few rows with a column-major weight (decode steps of few sequences), on CUDA.

Not called by the engine: on an H200 it measured 0.96x cuBLASLt's speed over a 7B's projections
at 1 row and 0.86x at 16 (benchmarks/probe_gemm.py, docs/benchmarks.md, twenty-seventh session).
It is correct there and kept as the base for a version whose weight loads are pipelined (TMA),
which is what cuBLASLt's lead on the large projections points to.

`skinny_linear(x, weight)` is `F.linear(x, weight)` for a 2-D x of at most MAX_ROWS rows and a
column-major weight (runner/gemm_layout.py), through cuda_kernels/skinny_gemm.cu; `unsupported`
says why a call cannot take it (the caller runs F.linear then, which is the exact fallback: the
same sums in another order). The kernel needs a workspace and tile counters per device, made by
`prepare` before any CUDA graph is captured, so that captures only launch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from . import loader

SOURCE = "skinny_gemm.cu"
MAX_ROWS = 16
TILE_N = 64  # output columns per CTA
MAX_SPLITS = 8
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}

# Launch tunables (probe_gemm.py's skinny_s*_u*_c* methods sweep them): weight steps a warp loads ahead,
# and the CTAs per SM the split along K aims the grid at.
LAUNCH = {"unroll": 2, "ctas_per_sm": 2}  # unroll 2 measured 3-4% faster than 4 (H200)


@dataclass(slots=True)
class _Buffers:
    workspace: torch.Tensor  # float32 [MAX_SPLITS, MAX_ROWS, max_n]: partial sums of split CTAs
    counters: torch.Tensor  # int32 [max_n / TILE_N]: CTAs done per column tile, reset by the last


_buffers: dict[int, _Buffers] = {}


def unsupported(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why skinny_linear cannot compute F.linear(x, weight) (None: it can)."""
    if x.device.type != "cuda":
        return f"x is on {x.device}, not CUDA"
    if x.dim() != 2 or weight.dim() != 2:
        return f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must both be 2-D"
    if x.shape[0] > MAX_ROWS or x.shape[0] == 0:
        return f"{x.shape[0]} rows (the kernel takes 1 to {MAX_ROWS})"
    if x.dtype not in _DTYPE_NAMES or weight.dtype != x.dtype:
        return f"dtypes x {x.dtype}, weight {weight.dtype} (the kernel takes bf16 or fp16, the same for both)"
    n, k = weight.shape
    if x.shape[1] != k:
        return f"x has {x.shape[1]} columns, the weight {k}"
    if n % TILE_N or k % 16:
        return f"weight [{n}, {k}]: out_features must divide by {TILE_N} and in_features by 16"
    if weight.stride(0) != 1 or weight.stride(1) % 8 or weight.data_ptr() % 16:
        return "the weight is not column-major with 16-byte aligned columns"
    if x.stride(1) != 1 or x.stride(0) % 4 or x.data_ptr() % 8:
        return "x's rows are not contiguous and 8-byte aligned"
    buffers = _buffers.get(x.device.index)
    if buffers is None or buffers.workspace.shape[2] < n:
        return f"no workspace for {n} columns on {x.device} (prepare was not called for it)"
    return None


def prepare(device: torch.device, max_n: int) -> None:
    """The workspace and counters for products of up to max_n output columns on device (zeroed
    counters; call before capturing graphs that launch the kernel)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    have = _buffers.get(index)
    if have is not None and have.workspace.shape[2] >= max_n:
        return
    max_n = -(-max_n // TILE_N) * TILE_N
    _buffers[index] = _Buffers(
        torch.empty((MAX_SPLITS, MAX_ROWS, max_n), dtype=torch.float32, device=device),
        torch.zeros(max_n // TILE_N, dtype=torch.int32, device=device))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def plan_splits(n: int, k: int, sm_count: int, ctas_per_sm: int) -> int:
    """CTAs along K per column tile: enough CTAs for ctas_per_sm on every SM, while each warp
    keeps at least two 16-k steps of its own."""
    tiles = n // TILE_N
    want = max(1, round(sm_count * ctas_per_sm / tiles))
    most = max(1, k // 16 // (8 * 2))
    return int(min(want, most, MAX_SPLITS))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, splits: int | None = None,
                  unroll: int | None = None) -> torch.Tensor:
    """x @ weight.T for x [rows <= MAX_ROWS, K] and a column-major weight [N, K]; the caller checked
    `unsupported(x, weight)` is None. splits / unroll override the launch plan (the probe's sweep)."""
    rows, k = x.shape
    n = weight.shape[0]
    device = x.device
    unroll = unroll or LAUNCH["unroll"]
    if splits is None:
        splits = plan_splits(n, k, _sm_count(device.index), LAUNCH["ctas_per_sm"])
    name = f"skinny_gemm_{_DTYPE_NAMES[x.dtype]}_r{8 if rows <= 8 else 16}_u{unroll}"
    kernel = loader.get_kernel(SOURCE, name, device)
    buffers = _buffers[device.index]
    out = torch.empty((rows, n), dtype=x.dtype, device=device)
    ptr = lambda t: np.uint64(t.data_ptr())  # noqa: E731
    with loader.on_torch_stream(device):
        kernel((n // TILE_N, splits), (256,), (
            ptr(x), np.int64(x.stride(0)), ptr(weight), np.int64(weight.stride(1)), ptr(out), np.int64(n),
            ptr(buffers.workspace), ptr(buffers.counters), np.int32(rows), np.int32(n), np.int32(k),
            np.int32(splits)))
    return out
