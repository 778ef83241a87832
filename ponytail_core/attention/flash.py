"""torch's flash attention (varlen, bottom-right causal, GQA): where it can run, and the call."""

from __future__ import annotations

import functools
import inspect

import torch

from ..kv.storage import PagedKVStorage
from .fa4 import fa4_varlen


@functools.cache
def _flash_problem(device_index: int) -> str | None:
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch build has no flash attention"
    if torch.cuda.get_device_capability(device_index) < (8, 0):
        return "flash attention needs sm80 or newer"
    return None


def flash_problem(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why torch's flash attention cannot run on these tensors (None: it can)."""
    if device.type != "cuda":
        return f"device is {device}, not CUDA"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash attention takes fp16/bf16, got {dtype}"
    if head_dim % 8 or head_dim > 256:
        return f"flash attention takes head_dim a multiple of 8 up to 256, got {head_dim}"
    return _flash_problem(device.index)


def flash_varlen_problem(storage: PagedKVStorage) -> str | None:
    """Why the flash varlen prefill cannot run on this cache (None: it can)."""
    return flash_problem(storage.device, storage.config.dtype, storage.config.head_dim)


@functools.cache
def _varlen_api():
    """torch's public varlen_attn where it takes GQA and a causal window (torch >= 2.11), else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn if {"enable_gqa", "window_size", "scale"} <= params.keys() else None


def flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, kernel: str = "flash",
                 out: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Causal (bottom-right aligned) attention of packed rows; K/V heads may be fewer (GQA).
    A query with no key to attend (its row has fewer keys than queries) comes out zero.
    kernel: "flash" (torch's FlashAttention-2) or "fa4" (FlashAttention-4, fa4.py; every row must
    have at least as many keys as queries, as the engine's chunks have). out: a contiguous
    [tokens, Hq, D] tensor to write the result into (FlashAttention-4 writes there directly, torch's
    kernel allocates its own and it is copied), returned. window: each query attends only the last
    `window` positions up to its own (flash's left window of window - 1)."""
    if kernel == "fa4":
        return fa4_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, out=out, window=window)
    left = -1 if window is None else window - 1
    api = _varlen_api()
    if api is not None:
        result = api(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(left, 0), enable_gqa=True)
    else:  # older torch: the same flash kernel through its aten op, which has taken GQA all along
        windowed = {} if window is None else {"window_size_left": left, "window_size_right": 0}
        result = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False,
                                                         scale=scale, **windowed)[0]
    return result if out is None else out.copy_(result)

