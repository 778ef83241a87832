"""vLLM's FlashAttention-3 decode call on a Ponytail cache's blocks, for bench_attention.py's --fa3.

vLLM attends decode rows with `flash_attn_varlen_func(..., block_table=..., fa_version=3)` on a
per-layer cache [num_blocks, block_size, kv_heads, head_dim], with scheduler metadata and at most
32 splits under its full CUDA graphs (vllm/v1/attention/backends/flash_attn.py). Ponytail's pool is
several chunks, each [layers, 2, chunk_blocks, block_size, kv_heads, head_dim]; copying layer 0's
K and V of every chunk end to end gives FA3 the same block ids, so both kernels read the same
scattered blocks through the same tables.
"""

from __future__ import annotations

import torch

FA3_MAX_SPLITS = 32  # vLLM's flash_attn_max_num_splits_for_cuda_graph default


def fa3_problem() -> str | None:
    """Why vLLM's FlashAttention-3 cannot run here (None: it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability()[0] != 9:
        return "FlashAttention-3 runs on sm90 only"
    try:
        from vllm.vllm_flash_attn import flash_attn_interface
    except Exception as error:  # ImportError, or its CUDA extension failing to load
        return f"vllm.vllm_flash_attn is not importable ({type(error).__name__}: {error})"
    if not flash_attn_interface.FA3_AVAILABLE:
        return f"FA3 unavailable: {flash_attn_interface.FA3_UNAVAILABLE_REASON}"
    return None


def fa3_decode(storage, tables: torch.Tensor, seq_lens: torch.Tensor, query: torch.Tensor, scale: float):
    """A callable attending `query` [B, Hq, 1, D] over layer 0 of `storage` as vLLM's decode does,
    returning [B, Hq, 1, D] like Ponytail's paged_attention."""
    from vllm.vllm_flash_attn.flash_attn_interface import flash_attn_varlen_func, get_scheduler_metadata

    layer0 = [chunk[0] for chunk in storage.chunks]  # each [2, chunk_blocks, block_size, Hkv, D]
    k_cache = torch.cat([kv[0] for kv in layer0])
    v_cache = torch.cat([kv[1] for kv in layer0])
    batch, heads, _, head_dim = query.shape
    q = query.reshape(batch, heads, head_dim).contiguous()
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    max_k = tables.shape[1] * storage.config.block_size
    metadata = get_scheduler_metadata(batch, 1, max_k, heads, k_cache.shape[2], head_dim, seq_lens,
                                      qkv_dtype=q.dtype, cu_seqlens_q=cu_q, page_size=storage.config.block_size,
                                      causal=True, num_splits=FA3_MAX_SPLITS)
    out = torch.empty_like(q)

    def call():
        flash_attn_varlen_func(q, k_cache, v_cache, 1, cu_q, max_k, seqused_k=seq_lens, softmax_scale=scale,
                               causal=True, block_table=tables, out=out, scheduler_metadata=metadata,
                               num_splits=FA3_MAX_SPLITS, fa_version=3)
        return out.view(batch, heads, 1, head_dim)

    return call
