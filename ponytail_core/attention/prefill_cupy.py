"""Prefill attention over the paged cache on CUDA: CuPy gathers of each row's K/V, then flash or SDPA.

Two gathers share one kernel shape (one CTA per (row, table entry)): `gather_padded` lays rows out
as a dense [B, kv_heads, max_blocks * block_size, D] batch for masked SDPA (fp32, pre-sm80 GPUs),
`gather_packed` lays them end to end for flash varlen (no padding, no mask tensor).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..kernels import loader as kernel_loader
from ..kernels.launch import vector_width
from ..kv.storage import PagedKVStorage
from .decode import FP8, kernel_dtype
from .flash import flash_varlen
from .torch_fallback import allowed_keys

SOURCE = "paged_attention.cu"
LAUNCH = {"gather_threads": 256}  # threads of one gather CTA


def _launch_gather(name: str, k: torch.Tensor, v: torch.Tensor, storage: PagedKVStorage, layer: int,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_k: torch.Tensor | None) -> None:
    """gather_kv_v<width> (padded) or gather_kv_packed_v<width> (cu_k given): same grid, same tail; an
    FP8 pool's gather_kv[_packed]_fp8_<dtype> take the same arguments and its scales."""
    c = storage.config
    batch, max_blocks = block_tables.shape
    if max_blocks == 0 or batch == 0:
        return
    if storage.scales is None:  # bytes moved as they are, in the widest vectors a row allows
        row_bytes = c.head_dim * c.dtype_size
        width = vector_width(row_bytes)
        kernel = kernel_loader.get_kernel(SOURCE, f"{name}_v{width}", storage.device)
        row, scales = row_bytes // width, ()
    else:  # FP8: dequantized into k and v (gather_kv[_packed]_fp8_<dtype>: a row in elements, the scales last)
        kernel = kernel_loader.get_kernel(SOURCE, f"{name}_{kernel_dtype(storage)}", storage.device, (FP8,))
        row, scales = c.head_dim, (np.uint64(storage.scales.values.data_ptr()),)
    offsets = () if cu_k is None else (np.uint64(cu_k.data_ptr()),)
    with kernel_loader.on_torch_stream(storage.device):
        kernel((max_blocks, batch), (LAUNCH["gather_threads"],), (
            np.uint64(k.data_ptr()), np.uint64(v.data_ptr()), storage.cupy_chunk_ptrs,
            np.uint64(block_tables.data_ptr()), np.int32(block_tables.stride(0)),
            np.uint64(seq_lens.data_ptr()), *offsets, np.int32(c.num_kv_heads), np.int32(row),
            np.int32(c.block_size), np.int32(storage.chunk_blocks), np.int32(storage.address_blocks),
            np.int32(layer), *scales))


def gather_padded(storage: PagedKVStorage, layer: int, block_tables: torch.Tensor, seq_lens: torch.Tensor):
    """K and V of every row, [B, kv_heads, max_blocks * block_size, D] (past seq_lens: undefined)."""
    c = storage.config
    batch, max_blocks = block_tables.shape
    k = torch.empty((batch, c.num_kv_heads, max_blocks * c.block_size, c.head_dim), dtype=c.dtype,
                    device=storage.device)
    v = torch.empty_like(k)
    _launch_gather("gather_kv", k, v, storage, layer, block_tables, seq_lens, None)
    return k, v


def gather_packed(storage: PagedKVStorage, layer: int, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  cu_k: torch.Tensor, capacity: int):
    """Every row's K and V end to end, [capacity, kv_heads, D]; row b at cu_k[b]."""
    c = storage.config
    k = torch.empty((max(capacity, 1), c.num_kv_heads, c.head_dim), dtype=c.dtype, device=storage.device)
    v = torch.empty_like(k)
    _launch_gather("gather_kv_packed", k, v, storage, layer, block_tables, seq_lens, cu_k)
    return k, v


def prefill_sdpa(storage, layer, query, block_tables, seq_lens, query_lens, scale,
                 window: int | None = None) -> torch.Tensor:
    """[B, Hq, T, D] over a padded gather with an explicit mask (where flash cannot run)."""
    batch, heads, positions, head_dim = query.shape
    kv_heads = storage.config.num_kv_heads
    group = heads // kv_heads
    k, v = gather_padded(storage, layer, block_tables, seq_lens)
    num_keys = k.shape[2]
    allowed, has_key = allowed_keys(seq_lens, query_lens, positions, num_keys, window)
    if num_keys == 0:
        return torch.zeros_like(query)
    # A position with nothing to attend gets key 0 (zeroed below) so SDPA never sees an empty row.
    allowed[:, :, 0] |= ~has_key
    # GQA without copying K/V: the G query heads of a KV head become G * T rows of one head.
    q = query.reshape(batch, kv_heads, group * positions, head_dim)
    mask = allowed[:, None, None].expand(batch, 1, group, positions, num_keys)
    mask = mask.reshape(batch, 1, group * positions, num_keys)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out = out.reshape(batch, heads, positions, head_dim)
    return out.masked_fill(~has_key[:, None, :, None], 0)


def flash_over_cache(storage, layer, q, cu_q, max_q, block_tables, seq_lens, scale,
                     varlen: str = "flash", num_keys: int = 0, out: torch.Tensor | None = None,
                     window: int | None = None) -> torch.Tensor:
    """Packed q [N, Hq, D] over the rows' cached K/V: one packed gather, then flash varlen (varlen:
    "flash" or "fa4"). The gather buffer holds num_keys rows (sum(seq_lens), where the caller knows
    it), else as many as the tables can address (an upper bound: the host does not wait for the
    lengths); FlashAttention-2 reads only each row's cu_k range. window: a sliding window, applied by
    the flash kernel (the gather still packs whole rows).

    FlashAttention-4 loads whole tiles of keys: past the last row's keys it reads whatever the
    buffer holds there, and a NaN in V makes NaN of a masked score's zero weight. So for "fa4" the
    buffer ends exactly at the last key (beyond a tensor's end its tile loads read zeros): with no
    num_keys that costs one wait for the lengths. out: where the result goes (see flash_varlen)."""
    bs = storage.config.block_size
    cu_k = F.pad(torch.cumsum(seq_lens, 0, dtype=torch.int32), (1, 0))
    capacity = num_keys or (int(cu_k[-1]) if varlen == "fa4" else block_tables.shape[0] * block_tables.shape[1] * bs)
    k, v = gather_packed(storage, layer, block_tables, seq_lens, cu_k, capacity)
    if q.stride(-1) != 1:
        q = q.contiguous()
    return flash_varlen(q, k, v, cu_q, cu_k, max_q, block_tables.shape[1] * bs, scale, kernel=varlen, out=out,
                        window=window)


def prefill_flash_padded(storage, layer, query, block_tables, seq_lens, query_lens, scale,
                         window: int | None = None) -> torch.Tensor:
    """The [B, Hq, T, D] entry point on the flash path: every row packed as T queries (the
    bottom-right alignment puts padding positions where they belong); padding zeroed afterwards."""
    batch, heads, positions, head_dim = query.shape
    q = query.transpose(1, 2).reshape(batch * positions, heads, head_dim)
    cu_q = torch.arange(0, (batch + 1) * positions, positions, dtype=torch.int32, device=query.device)
    out = flash_over_cache(storage, layer, q, cu_q, positions, block_tables, seq_lens, scale, window=window)
    out = out.view(batch, positions, heads, head_dim).transpose(1, 2)
    if query_lens is None:  # flash already gives zeros where a position has no key
        return out
    j = torch.arange(positions, device=query.device)[None, :]
    padding = j < positions - query_lens.long()[:, None]
    return out.masked_fill(padding[:, None, :, None], 0)

