"""FlashAttention-4's CuTe kernels (the `flash-attn-4` package) for the engine's packed prefill chunks.

torch ships FlashAttention-2; vLLM runs FlashAttention-3 on Hopper. FlashAttention-4 brings
Hopper's wgmma/TMA design as a pip package (CuTe DSL, compiled on first use). Over mixed prompt
lengths packed as the engine packs them it attends faster than torch's flash varlen at head_dim
128 and no faster at 64 (docs/benchmarks.md). So `prefill_attention=None` ("auto")
takes it where it is installed, the device is sm90/sm100 and head_dim is at least AUTO_MIN_HEAD_DIM.

Its kernels compile at their first call (5-10 s for each kind of step). The engine's start-up
warm-up (ModelRunner.warm_up) makes those calls, so no request waits for a compile; its disk cache
keeps them for later starts (switched on here unless the user set FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED).
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings

import torch

from ..errors import ConfigError

PREFILL_ATTENTION = ("flash", "fa4")  # what prefill_attention takes (None: chosen by choose_prefill_attention)
AUTO_MIN_HEAD_DIM = 128  # measured faster at 128, slower at 64 (see above)


@functools.cache
def _import_problem() -> str | None:
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")  # read once, at its import
    # Printed by the CuTe DSL at every kernel compile (flash-attn-4 4.0.0b36): an argument it passes
    # through as a constant. Nothing a user can act on.
    warnings.filterwarnings("ignore", message=r"Argument aux_data \(position \d+\) cannot be converted",
                            category=UserWarning)
    try:
        import flash_attn.cute.interface  # noqa: F401
    except Exception as error:  # ImportError, or a CUDA/cutlass library it cannot load
        return f"the flash-attn-4 package is not importable ({type(error).__name__}: {error})"
    return None


def fa4_problem(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FlashAttention-4 cannot attend these tensors (None: it can)."""
    if device.type != "cuda":
        return f"device is {device}, not CUDA"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"FlashAttention-4 takes fp16/bf16, got {dtype}"
    major = torch.cuda.get_device_capability(device)[0]
    if major not in (9, 10):
        return f"FlashAttention-4 runs on sm90 and sm100 (Hopper, Blackwell); this device is sm{major}x"
    widest = 256 if major == 9 else 128
    if head_dim % 8 or not 8 <= head_dim <= widest:
        return f"FlashAttention-4 on sm{major}x takes head_dim a multiple of 8 from 8 to {widest}, got {head_dim}"
    return _import_problem()


def choose_prefill_attention(requested: str | None, device: torch.device, dtype: torch.dtype,
                             head_dim: int) -> str:
    """The varlen kernel for packed prefill chunks: "fa4" or "flash" (torch's FlashAttention-2).
    None picks FlashAttention-4 where it can run and head_dim >= AUTO_MIN_HEAD_DIM; "fa4" where it
    cannot run is a ConfigError that says why."""
    if requested is not None and requested not in PREFILL_ATTENTION:
        raise ConfigError(f"prefill_attention={requested!r} is not supported; allowed: "
                          f"{', '.join(map(repr, PREFILL_ATTENTION))} or None (fa4 where installed and faster)")
    if requested == "flash":
        return "flash"
    problem = fa4_problem(device, dtype, head_dim)
    if requested == "fa4":
        if problem is not None:
            raise ConfigError(f"prefill_attention='fa4' cannot run here: {problem} "
                              "(pip install 'ponytail[fa4]' on a Hopper or Blackwell GPU; or use 'flash' or None)")
        return "fa4"
    return "fa4" if problem is None and head_dim >= AUTO_MIN_HEAD_DIM else "flash"


@functools.cache
def _forward_into():
    """FlashAttention-4's forward that writes into a given `out` (what its autograd wrapper calls;
    the public function allocates its own), or None where this version has no such parameter."""
    from flash_attn.cute import interface

    forward = getattr(interface, "_flash_attn_fwd", None)
    return forward if forward is not None and "out" in inspect.signature(forward).parameters else None


def fa4_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, out: torch.Tensor | None = None,
               window: int | None = None) -> torch.Tensor:
    """flash_varlen's contract (causal aligned bottom right, GQA, an optional sliding window)
    through FlashAttention-4. out: a contiguous [tokens, Hq, D] tensor the result is written into
    (no copy where the installed version can write there), returned."""
    forward = _forward_into() if out is not None else None
    if forward is not None:
        windowed = {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}
        forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                softmax_scale=scale, causal=True, out=out, **windowed)
        return out
    from flash_attn.cute.interface import flash_attn_varlen_func

    windowed = {} if window is None else {"window_size": (window - 1, 0)}
    result = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                    max_seqlen_k=max_k, softmax_scale=scale, causal=True, **windowed)[0]
    return result if out is None else out.copy_(result)


def fa4_pages_problem() -> str | None:
    """Why FlashAttention-4 cannot read K/V through a page table here (None: it can)."""
    forward = _forward_into()
    if forward is None:
        return "the installed flash-attn-4 has no forward that writes into a given tensor"
    missing = {"page_table", "seqused_k"} - inspect.signature(forward).parameters.keys()
    return f"the installed flash-attn-4's forward has no {', '.join(sorted(missing))}" if missing else None


def fa4_paged(q, k_pages, v_pages, page_table, cu_q, seq_lens, max_q, scale, out: torch.Tensor) -> torch.Tensor:
    """flash_varlen's contract with K/V read in place through a page table: k_pages/v_pages
    [pages, block_size, Hkv, D], page_table [rows, max pages] int32, seq_lens [rows] int32 keys of
    each row (its queries are the last ones). Pages smaller than a 128-key tile load row by row
    (cp.async) instead of by TMA. out: the contiguous [tokens, Hq, D] result, returned."""
    forward = _forward_into()
    if forward is None:
        raise ConfigError(f"FlashAttention-4 cannot read K/V through a page table here: {fa4_pages_problem()}")
    forward(q, k_pages, v_pages, cu_seqlens_q=cu_q, seqused_k=seq_lens, max_seqlen_q=max_q,
            max_seqlen_k=page_table.shape[1] * k_pages.shape[1], page_table=page_table,
            softmax_scale=scale, causal=True, out=out)
    return out
