"""The exact torch fallback of paged attention (CPU, PONYTAIL_KERNELS=torch, shapes without a kernel).

Gathers each row's K/V with tensor indexing, then attends in fp32 with an explicit softmax.
"""

from __future__ import annotations

import torch

from ..kv.scales import dequantize
from ..kv.storage import PagedKVStorage


def allowed_keys(seq_lens, query_lens, positions: int, num_keys: int, window: int | None = None):
    """allowed [B, T, L]: query position j may attend cache position l; has_key [B, T]: any l.

    window: a sliding window of that many positions, the query's own included (transformers'
    `kv > q - sliding_window`); None attends the whole row."""
    device = seq_lens.device
    j = torch.arange(positions, device=device)[None, :]
    pos = seq_lens.long()[:, None] - positions + j  # cache position of query position j
    is_real = pos >= 0  # a position before the row's first token attends nothing
    if query_lens is not None:
        is_real = is_real & (j >= positions - query_lens.long()[:, None])
    keys = torch.arange(num_keys, device=device)
    allowed = is_real[:, :, None] & (keys[None, None, :] <= pos[:, :, None])
    if window is not None:
        allowed &= keys[None, None, :] > pos[:, :, None] - window
    return allowed, is_real & (num_keys > 0)


# --------------------------------------------------------------------------------- fallback
def gather_torch(storage: PagedKVStorage, layer: int, block_tables: torch.Tensor, seq_lens: torch.Tensor):
    """K and V of every row, [B, kv_heads, max_blocks * block_size, D], zero past seq_lens."""
    c = storage.config
    batch, max_blocks = block_tables.shape
    bs = c.block_size
    used = torch.arange(max_blocks, device=storage.device)[None, :] * bs < seq_lens.long()[:, None]
    ids = torch.where(used, block_tables.long(), 0).clamp_(0, max(storage.num_blocks - 1, 0))
    chunk_of, within = storage.locate(ids)
    blocks = torch.zeros((batch, max_blocks, 2, bs, c.num_kv_heads, c.head_dim), dtype=c.kv_dtype,
                         device=storage.device)
    for index, chunk in enumerate(storage.chunks):
        sel = used & (chunk_of == index)
        if bool(sel.any()):
            blocks[sel] = chunk[layer][:, within[sel]].transpose(0, 1)  # [n, 2, bs, H, D]
    if storage.scales is not None:
        blocks = dequantize(blocks, storage.scales.values[layer, :, None, None, None], c.dtype)
    kv = blocks.permute(2, 0, 4, 1, 3, 5).reshape(2, batch, c.num_kv_heads, max_blocks * bs, c.head_dim)
    live = torch.arange(max_blocks * bs, device=storage.device)[None, :] < seq_lens.long()[:, None]
    kv = kv.masked_fill(~live[None, :, None, :, None], 0)  # the last block's tail may hold anything
    return kv[0], kv[1]


def attention_torch(storage, layer, query, block_tables, seq_lens, query_lens, scale,
                    window: int | None = None) -> torch.Tensor:
    batch, heads, positions, head_dim = query.shape
    kv_heads = storage.config.num_kv_heads
    k, v = gather_torch(storage, layer, block_tables, seq_lens)
    allowed, has_key = allowed_keys(seq_lens, query_lens, positions, k.shape[2], window)
    q = query.float().reshape(batch, kv_heads, heads // kv_heads, positions, head_dim)
    scores = (q @ k.float()[:, :, None].transpose(-1, -2)) * scale  # [B, Hkv, G, T, L]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(has_key[:, None, None, :, None], top, torch.zeros_like(top))
    p = torch.exp(scores - top)  # exactly 0 where masked
    out = (p @ v.float()[:, :, None]) / p.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return out.reshape(batch, heads, positions, head_dim).to(query.dtype)

