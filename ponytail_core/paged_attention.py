"""Attention of new query tokens over a layer's paged K/V: decode kernel, prefill, fp32 fallback.

`paged_attention` runs one of three paths with the same semantics:
  * one query position per row (decode) on CUDA: the custom split-KV kernel;
  * several positions per row (prefill chunks, prefix reuse) on CUDA: one gather launch packs the
    rows' K/V end to end, then flash attention's varlen kernel (through torch) attends with a
    bottom-right causal mask, no padding and no mask tensor; where flash cannot run (fp32, a GPU
    before sm80, a torch without it) a padded gather and SDPA with an explicit mask instead;
  * the torch fallback (CPU, PONYTAIL_KERNELS=torch, a head size without a kernel): the same
    gather with tensor indexing, then attention in fp32 with an explicit softmax.

Semantics. The cache already holds every row's K/V including the new tokens. Row b has
seq_lens[b] tokens; its real new tokens are the last query_lens[b] of the T query positions
(None: all T). Query position j (real when j >= T - query_lens[b]) sits at cache position
seq_lens[b] - T + j and attends positions 0 .. that one. Padding positions, rows with
seq_lens[b] == 0 and positions that would sit before position 0 produce zeros.

`paged_attention_varlen` takes the engine's packed layout: rows' query tokens end to end, with
cumulative lengths, and the same semantics per row.

Lengths and block ids are checked against the cache when they are CPU tensors; on CUDA that
would cost a host sync per call, so there the kernels clamp instead (never reading outside the
pool or the table) and bad values give wrong numbers, not a crash.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from . import kernel_loader
from .cache_ops import _vector_width
from .errors import KernelError
from .paged_storage import PagedKVStorage

_SOURCE = "paged_attention.cu"
_DECODE_HEAD_DIMS = (64, 80, 96, 128, 256)  # instantiated in paged_attention.cu
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_LOG2E = 1.4426950408889634

# Launch tunables, read by the launches below and nowhere else.
_LAUNCH = {
    "decode_warps": 4,  # warps per decode CTA; each streams its own steps of tokens
    # The next three are compiled into the kernel names (..._l4s3v1); paged_attention.cu ships
    # l4s3v1 for every group, plus tuning variants for bf16 / head_dim 128 (l4s4v1, l8s3v1, l4s4v2).
    # On an H200, l4s3 (52 KiB of shared memory: 4 CTAs per SM) beat l4s4 (3 CTAs) by 5-20%.
    "decode_loads": 4,  # 16-byte K (and V) vectors per lane per step
    "decode_stages_g1": 3,  # steps in each warp's shared-memory ring (stages - 1 in flight),
    "decode_stages_g2": 3,  # by query heads per CTA
    "decode_stages_g4": 3,
    "decode_stages_g8": 3,
    "decode_row_vectors": 1,  # 16-byte vectors of a K/V row per lane (2: fewer shuffles, more registers)
    "max_heads_per_cta": 8,  # query heads sharing one KV head in one CTA: 1, 2, 4 or 8
    "max_split_blocks": 512,  # block addresses one CTA stages in shared memory (8 bytes each)
    "min_split_tokens": 256,  # never split a sequence into pieces shorter than this
    "split_overhead_tokens": 64,  # fixed cost of one CTA, in tokens' worth of streaming
    "gather_threads": 256,  # prefill gather: one CTA per (row, table entry)
}


# ------------------------------------------------------------------------------------ checks
def _check_args(storage: PagedKVStorage, layer: int, query: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, query_lens: torch.Tensor | None, scale: float) -> None:
    if not isinstance(query, torch.Tensor) or query.dim() != 4:
        shape = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        raise KernelError(f"query must be [batch, query heads, positions, head_dim], got {shape}")
    batch, heads, positions, head_dim = query.shape
    if positions == 0:
        raise KernelError(f"query has 0 positions (shape {tuple(query.shape)}); need at least 1")
    _check_query(storage, layer, query, heads, head_dim, scale)
    _check_rows(storage, batch, block_tables, seq_lens, query_lens)
    if seq_lens.device.type == "cpu":  # values are free to read only on the host
        _check_values(storage, block_tables, seq_lens, query_lens, positions)


def _check_query(storage: PagedKVStorage, layer, query: torch.Tensor, heads: int, head_dim: int, scale) -> None:
    c = storage.config
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < c.num_layers:
        raise KernelError(f"layer={layer!r} is outside the cache's {c.num_layers} layers (0..{c.num_layers - 1})")
    if head_dim != c.head_dim:
        raise KernelError(f"query head_dim {head_dim} does not match the cache's head_dim {c.head_dim}")
    if heads == 0 or heads % c.num_kv_heads:
        raise KernelError(f"query has {heads} heads, not a positive multiple of the cache's "
                          f"{c.num_kv_heads} KV heads")
    if query.dtype != c.dtype:
        raise KernelError(f"query dtype {query.dtype} does not match the cache dtype {c.dtype}")
    if query.device != storage.device:
        raise KernelError(f"query is on {query.device}, the cache on {storage.device}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise KernelError(f"scale={scale!r} is not a finite number")


def _check_rows(storage: PagedKVStorage, batch: int, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                query_lens: torch.Tensor | None) -> None:
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise KernelError(f"block_tables must be [batch={batch}, max_blocks], got {tuple(block_tables.shape)}")
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise KernelError(f"block_tables rows must be contiguous (stride 1), got strides {block_tables.stride()}")
    named = [("block_tables", block_tables), ("seq_lens", seq_lens)]
    if query_lens is not None:
        named.append(("query_lens", query_lens))
    for name, t in named:
        if t.dtype != torch.int32 or t.device != storage.device:
            raise KernelError(f"{name} must be int32 on {storage.device}, got {t.dtype} on {t.device}")
        if name != "block_tables" and tuple(t.shape) != (batch,):
            raise KernelError(f"{name} must be [batch={batch}], got {tuple(t.shape)}")


def _check_values(storage, block_tables, seq_lens, query_lens, positions) -> None:
    block_size = storage.config.block_size
    capacity = block_tables.shape[1] * block_size
    for b, n in enumerate(seq_lens.tolist()):
        if not 0 <= n <= capacity:
            raise KernelError(f"seq_lens[{b}]={n} is outside 0..{capacity} (block_tables has "
                              f"{block_tables.shape[1]} blocks of {block_size} tokens per row)")
        real = positions if query_lens is None else int(query_lens[b])
        if not 0 <= real <= positions:
            raise KernelError(f"query_lens[{b}]={real} is outside 0..{positions} (query positions)")
        if n > 0 and real > n:
            raise KernelError(f"row {b} has {real} real query tokens but seq_lens[{b}]={n}: the cache "
                              "must already hold every new token's K/V (write them first)")
        ids = block_tables[b, : -(-n // block_size)]
        bad = ids[(ids < 0) | (ids >= storage.num_blocks)]
        if bad.numel():
            raise KernelError(f"block_tables[{b}] holds block ids {bad[:8].tolist()} outside the pool's "
                              f"{storage.num_blocks} blocks within its first {n} tokens")


def _decode_choice(choice: kernel_loader.KernelChoice, head_dim: int) -> kernel_loader.KernelChoice:
    if not choice.use_custom or head_dim in _DECODE_HEAD_DIMS:
        return choice
    reason = f"head_dim={head_dim} has no decode kernel (kernels: {', '.join(map(str, _DECODE_HEAD_DIMS))})"
    if kernel_loader.kernel_mode() == "cupy":
        raise KernelError(f"{kernel_loader.KERNELS_ENV}=cupy but {reason}")
    return kernel_loader.KernelChoice(False, reason)


# ------------------------------------------------------------------------------------ entry
def paged_attention(storage: PagedKVStorage, layer: int, query: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_lens: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Attention of `query` [B, Hq, T, D] over layer `layer` of the cache; returns [B, Hq, T, D].

    block_tables [B, max_blocks] int32 lists each row's block ids in order (entries past the
    row's blocks are ignored); seq_lens [B] int32 counts the row's tokens in the cache, new ones
    included; query_lens [B] int32 or None counts its real (right-aligned) query positions.
    Query heads h use KV head h // (Hq // kv_heads). See the module docstring for the semantics.
    """
    _check_args(storage, layer, query, block_tables, seq_lens, query_lens, scale)
    batch, _, positions, head_dim = query.shape
    choice = kernel_loader.choose(storage.device)
    op = "paged_attention decode" if positions == 1 else "paged_attention prefill"
    flash = False
    if positions == 1:
        choice = _decode_choice(choice, head_dim)
    elif choice.use_custom:
        problem = flash_varlen_problem(storage)
        flash = problem is None
        choice = kernel_loader.KernelChoice(True, "CuPy packed gather + flash varlen" if flash else
                                            f"CuPy gather + masked SDPA: {problem}")
    kernel_loader.log_choice(op, choice)
    if batch == 0:
        return torch.empty_like(query)
    if not choice.use_custom:
        return _attention_torch(storage, layer, query, block_tables, seq_lens, query_lens, float(scale))
    if positions == 1:
        return _decode_cupy(storage, layer, query, block_tables, seq_lens, query_lens, float(scale))
    if flash:
        return _prefill_flash_padded(storage, layer, query, block_tables, seq_lens, query_lens, float(scale))
    return _prefill_sdpa(storage, layer, query, block_tables, seq_lens, query_lens, float(scale))


def paged_attention_varlen(storage: PagedKVStorage, layer: int, query: torch.Tensor, cu_seq_q: torch.Tensor,
                           max_query_len: int, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Attention of packed query tokens [N, Hq, D] over layer `layer`; returns [N, Hq, D].

    Row b's queries are query[cu_seq_q[b] : cu_seq_q[b + 1]] (cu_seq_q [B + 1] int32, starting at
    0 and ending at N), the last of its seq_lens[b] cached tokens; max_query_len bounds every
    row's count. block_tables and seq_lens as for `paged_attention`.
    """
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        shape = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        raise KernelError(f"query must be [tokens, query heads, head_dim], got {shape}")
    if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2:
        raise KernelError(f"block_tables must be [batch, max_blocks], got {getattr(block_tables, 'shape', block_tables)}")
    batch = block_tables.shape[0]
    if cu_seq_q.dtype != torch.int32 or cu_seq_q.device != storage.device or tuple(cu_seq_q.shape) != (batch + 1,):
        raise KernelError(f"cu_seq_q must be int32 [batch + 1 = {batch + 1}] on {storage.device}, got "
                          f"{cu_seq_q.dtype} {tuple(cu_seq_q.shape)} on {cu_seq_q.device}")
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 1:
        raise KernelError(f"max_query_len={max_query_len!r} must be a positive int")
    if cu_seq_q.device.type == "cpu":
        counts = (cu_seq_q[1:] - cu_seq_q[:-1]).tolist()
        if int(cu_seq_q[0]) != 0 or int(cu_seq_q[-1]) != query.shape[0] or min(counts, default=0) < 0:
            raise KernelError(f"cu_seq_q={cu_seq_q.tolist()} must rise from 0 to the {query.shape[0]} query tokens")
        if max(counts, default=0) > max_query_len:
            raise KernelError(f"a row has {max(counts)} query tokens, more than max_query_len={max_query_len}")
    if query.shape[0] == 0:
        return torch.empty_like(query)
    choice = kernel_loader.choose(storage.device)
    problem = flash_varlen_problem(storage) if choice.use_custom else choice.reason
    if problem is None:
        _check_query(storage, layer, query, query.shape[1], query.shape[2], scale)
        _check_rows(storage, batch, block_tables, seq_lens, None)
        kernel_loader.log_choice("paged_attention varlen prefill",
                                 kernel_loader.KernelChoice(True, "CuPy packed gather + flash varlen"))
        return _flash_over_cache(storage, layer, query, cu_seq_q, max_query_len, block_tables, seq_lens, float(scale))
    # Everything else goes through the padded entry point (its checks, its fallback, its logging).
    padded, row, col = _varlen_to_padded(query, cu_seq_q, max_query_len)
    query_lens = (cu_seq_q[1:] - cu_seq_q[:-1]).to(torch.int32)
    out = paged_attention(storage, layer, padded.transpose(1, 2), block_tables, seq_lens, query_lens, scale)
    return out.transpose(1, 2)[row, col]


def _varlen_to_padded(query, cu_seq_q, width):
    """[N, Hq, D] packed -> [B, width, Hq, D] right-aligned, and each token's (row, column)."""
    ends = cu_seq_q[1:].long()
    token = torch.arange(query.shape[0], device=query.device)
    row = torch.searchsorted(ends, token, right=True)  # ends[row - 1] <= token < ends[row]
    col = width - (ends[row] - token)
    padded = query.new_zeros((ends.shape[0], width) + tuple(query.shape[1:]))
    padded[row, col] = query
    return padded, row, col


def _allowed_keys(seq_lens, query_lens, positions: int, num_keys: int):
    """allowed [B, T, L]: query position j may attend cache position l; has_key [B, T]: any l."""
    device = seq_lens.device
    j = torch.arange(positions, device=device)[None, :]
    pos = seq_lens.long()[:, None] - positions + j  # cache position of query position j
    is_real = pos >= 0  # a position before the row's first token attends nothing
    if query_lens is not None:
        is_real = is_real & (j >= positions - query_lens.long()[:, None])
    keys = torch.arange(num_keys, device=device)
    allowed = is_real[:, :, None] & (keys[None, None, :] <= pos[:, :, None])
    return allowed, is_real & (num_keys > 0)


# --------------------------------------------------------------------------------- fallback
def _gather_torch(storage: PagedKVStorage, layer: int, block_tables: torch.Tensor, seq_lens: torch.Tensor):
    """K and V of every row, [B, kv_heads, max_blocks * block_size, D], zero past seq_lens."""
    c = storage.config
    batch, max_blocks = block_tables.shape
    bs = c.block_size
    used = torch.arange(max_blocks, device=storage.device)[None, :] * bs < seq_lens.long()[:, None]
    ids = torch.where(used, block_tables.long(), 0).clamp_(0, max(storage.num_blocks - 1, 0))
    chunk_of, within = storage.locate(ids)
    blocks = torch.zeros((batch, max_blocks, 2, bs, c.num_kv_heads, c.head_dim), dtype=c.dtype,
                         device=storage.device)
    for index, chunk in enumerate(storage.chunks):
        sel = used & (chunk_of == index)
        if bool(sel.any()):
            blocks[sel] = chunk[layer][:, within[sel]].transpose(0, 1)  # [n, 2, bs, H, D]
    kv = blocks.permute(2, 0, 4, 1, 3, 5).reshape(2, batch, c.num_kv_heads, max_blocks * bs, c.head_dim)
    live = torch.arange(max_blocks * bs, device=storage.device)[None, :] < seq_lens.long()[:, None]
    kv = kv.masked_fill(~live[None, :, None, :, None], 0)  # the last block's tail may hold anything
    return kv[0], kv[1]


def _attention_torch(storage, layer, query, block_tables, seq_lens, query_lens, scale) -> torch.Tensor:
    batch, heads, positions, head_dim = query.shape
    kv_heads = storage.config.num_kv_heads
    k, v = _gather_torch(storage, layer, block_tables, seq_lens)
    allowed, has_key = _allowed_keys(seq_lens, query_lens, positions, k.shape[2])
    q = query.float().reshape(batch, kv_heads, heads // kv_heads, positions, head_dim)
    scores = (q @ k.float()[:, :, None].transpose(-1, -2)) * scale  # [B, Hkv, G, T, L]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(has_key[:, None, None, :, None], top, torch.zeros_like(top))
    p = torch.exp(scores - top)  # exactly 0 where masked
    out = (p @ v.float()[:, :, None]) / p.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return out.reshape(batch, heads, positions, head_dim).to(query.dtype)


# ---------------------------------------------------------------------------------- prefill
def _gather_cupy(storage: PagedKVStorage, layer: int, block_tables: torch.Tensor, seq_lens: torch.Tensor):
    c = storage.config
    batch, max_blocks = block_tables.shape
    shape = (batch, c.num_kv_heads, max_blocks * c.block_size, c.head_dim)
    k = torch.empty(shape, dtype=c.dtype, device=storage.device)
    v = torch.empty_like(k)
    if max_blocks == 0:
        return k, v
    row_bytes = c.head_dim * c.dtype_size
    width = _vector_width(row_bytes)
    kernel = kernel_loader.get_kernel(_SOURCE, f"gather_kv_v{width}", storage.device)
    with kernel_loader.on_torch_stream(storage.device):
        kernel((max_blocks, batch), (_LAUNCH["gather_threads"],), (
            np.uint64(k.data_ptr()), np.uint64(v.data_ptr()), storage.cupy_chunk_ptrs,
            np.uint64(block_tables.data_ptr()), np.int32(block_tables.stride(0)),
            np.uint64(seq_lens.data_ptr()), np.int32(c.num_kv_heads), np.int32(row_bytes // width),
            np.int32(c.block_size), np.int32(storage.chunk_blocks), np.int32(storage.address_blocks),
            np.int32(layer)))
    return k, v


def _prefill_sdpa(storage, layer, query, block_tables, seq_lens, query_lens, scale) -> torch.Tensor:
    batch, heads, positions, head_dim = query.shape
    kv_heads = storage.config.num_kv_heads
    group = heads // kv_heads
    k, v = _gather_cupy(storage, layer, block_tables, seq_lens)
    num_keys = k.shape[2]
    allowed, has_key = _allowed_keys(seq_lens, query_lens, positions, num_keys)
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


def _flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale) -> torch.Tensor:
    """Causal (bottom-right aligned) attention of packed rows; K/V heads may be fewer (GQA).
    A query with no key to attend (its row has fewer keys than queries) comes out zero."""
    api = _varlen_api()
    if api is not None:
        return api(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0), enable_gqa=True)
    # Older torch: the same flash kernel through its aten op, which has taken GQA all along.
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False,
                                                    scale=scale)[0]


def _gather_packed_cupy(storage: PagedKVStorage, layer: int, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        cu_k: torch.Tensor, capacity: int):
    """Every row's K and V end to end, [capacity, kv_heads, D]; row b at cu_k[b]."""
    c = storage.config
    batch, max_blocks = block_tables.shape
    k = torch.empty((max(capacity, 1), c.num_kv_heads, c.head_dim), dtype=c.dtype, device=storage.device)
    v = torch.empty_like(k)
    if max_blocks == 0 or batch == 0:
        return k, v
    row_bytes = c.head_dim * c.dtype_size
    width = _vector_width(row_bytes)
    kernel = kernel_loader.get_kernel(_SOURCE, f"gather_kv_packed_v{width}", storage.device)
    with kernel_loader.on_torch_stream(storage.device):
        kernel((max_blocks, batch), (_LAUNCH["gather_threads"],), (
            np.uint64(k.data_ptr()), np.uint64(v.data_ptr()), storage.cupy_chunk_ptrs,
            np.uint64(block_tables.data_ptr()), np.int32(block_tables.stride(0)),
            np.uint64(seq_lens.data_ptr()), np.uint64(cu_k.data_ptr()), np.int32(c.num_kv_heads),
            np.int32(row_bytes // width), np.int32(c.block_size), np.int32(storage.chunk_blocks),
            np.int32(storage.address_blocks), np.int32(layer)))
    return k, v


def _flash_over_cache(storage, layer, q, cu_q, max_q, block_tables, seq_lens, scale) -> torch.Tensor:
    """Packed q [N, Hq, D] over the rows' cached K/V: one packed gather, then flash varlen.
    The gather buffer is sized by the tables (an upper bound), so the host never waits for the
    lengths; flash reads only each row's cu_k range."""
    bs = storage.config.block_size
    capacity = block_tables.shape[0] * block_tables.shape[1] * bs
    cu_k = F.pad(torch.cumsum(seq_lens, 0, dtype=torch.int32), (1, 0))
    k, v = _gather_packed_cupy(storage, layer, block_tables, seq_lens, cu_k, capacity)
    if q.stride(-1) != 1:
        q = q.contiguous()
    return _flash_varlen(q, k, v, cu_q, cu_k, max_q, block_tables.shape[1] * bs, scale)


def _prefill_flash_padded(storage, layer, query, block_tables, seq_lens, query_lens, scale) -> torch.Tensor:
    """The [B, Hq, T, D] entry point on the flash path: every row packed as T queries (the
    bottom-right alignment puts padding positions where they belong); padding zeroed afterwards."""
    batch, heads, positions, head_dim = query.shape
    q = query.transpose(1, 2).reshape(batch * positions, heads, head_dim)
    cu_q = torch.arange(0, (batch + 1) * positions, positions, dtype=torch.int32, device=query.device)
    out = _flash_over_cache(storage, layer, q, cu_q, positions, block_tables, seq_lens, scale)
    out = out.view(batch, positions, heads, head_dim).transpose(1, 2)
    if query_lens is None:  # flash already gives zeros where a position has no key
        return out
    j = torch.arange(positions, device=query.device)[None, :]
    padding = j < positions - query_lens.long()[:, None]
    return out.masked_fill(padding[:, None, :, None], 0)


# ----------------------------------------------------------------------------------- decode
@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _decode_smem(split_blocks: int, group: int, head_dim: int, stages: int) -> int:
    """Dynamic shared memory of one decode CTA; the layout is the kernel's."""
    warps = _LAUNCH["decode_warps"]
    table = (split_blocks * 8 + 15) // 16 * 16
    rings = warps * stages * 2 * _LAUNCH["decode_loads"] * 32 * 16
    merge = warps * group * (2 + head_dim) * 4  # reuses the rings after the main loop
    return table + max(rings, merge)


_smem_allowed: dict[tuple[str, int], int] = {}


def _allow_smem(kernel, name: str, device: torch.device, num_bytes: int) -> None:
    """Raise the kernel's dynamic shared-memory limit (48 KiB by default) to num_bytes."""
    key = (name, device.index)
    if _smem_allowed.get(key, 0) >= num_bytes:
        return
    import cupy

    with cupy.cuda.Device(device.index):
        kernel.max_dynamic_shared_size_bytes = num_bytes  # a CuPy RawKernel attribute
    _smem_allowed[key] = num_bytes


@functools.cache
def _resident_ctas_per_sm(kernel, name: str, device_index: int, threads: int, smem: int) -> int:
    """CTAs of this kernel one SM holds at once (the driver's occupancy calculator)."""
    import cupy

    with cupy.cuda.Device(device_index):
        return max(1, cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
            kernel.kernel.ptr, threads, smem))


def plan_splits(base_ctas: int, max_tokens: int, block_size: int, resident_ctas: int) -> tuple[int, int]:
    """(splits, split_tokens) for a decode grid of base_ctas CTAs per split.

    The grid runs in waves of resident_ctas CTAs, each wave as long as one split, so the time
    goes as waves * (split_tokens + split_overhead_tokens): pick the split count minimizing that,
    between the fewest splits whose block table fits shared memory and pieces of
    min_split_tokens. split_tokens is a multiple of block_size.
    """
    return _plan_splits(base_ctas, max_tokens, block_size, resident_ctas, _LAUNCH["max_split_blocks"],
                        _LAUNCH["min_split_tokens"], _LAUNCH["split_overhead_tokens"])


@functools.lru_cache(maxsize=4096)
def _plan_splits(base_ctas, max_tokens, block_size, resident_ctas, max_split_blocks, min_split_tokens,
                 overhead_tokens) -> tuple[int, int]:
    if max_tokens == 0:
        return 1, block_size
    fewest = -(-max_tokens // (max_split_blocks * block_size))
    most = max(fewest, max_tokens // max(min_split_tokens, 1))
    best = None
    for splits in range(fewest, most + 1):
        split_tokens = -(-(-(-max_tokens // splits)) // block_size) * block_size
        used = -(-max_tokens // split_tokens)
        waves = -(-base_ctas * used // resident_ctas)
        cost = waves * (split_tokens + overhead_tokens)
        if best is None or cost < best[0]:
            best = (cost, used, split_tokens)
    return best[1], best[2]


@dataclass(frozen=True, slots=True)
class DecodePlan:
    kernel_name: str  # paged_decode_<dtype>_d<head_dim>_g<group>_l<loads>s<stages>v<row vectors>
    group: int  # query heads per CTA (a power of two; heads past the GQA ratio idle)
    groups: int  # CTAs per KV head along the grid's y axis
    splits: int  # CTAs per row along the sequence (1: the kernel writes the output itself)
    split_tokens: int  # tokens per split, a multiple of block_size
    threads: int
    smem_bytes: int  # dynamic shared memory of one CTA


def decode_plan(storage: PagedKVStorage, batch: int, heads: int, max_blocks: int) -> DecodePlan:
    """How a decode launch is laid out for this cache, batch and block-table width."""
    c = storage.config
    group_size = heads // c.num_kv_heads
    group = min(_LAUNCH["max_heads_per_cta"], 1 << (group_size - 1).bit_length())
    groups = -(-group_size // group)
    stages = _LAUNCH[f"decode_stages_g{group}"]
    name = (f"paged_decode_{_DTYPE_NAMES[c.dtype]}_d{c.head_dim}_g{group}_l{_LAUNCH['decode_loads']}"
            f"s{stages}v{_LAUNCH['decode_row_vectors']}")
    kernel = kernel_loader.get_kernel(_SOURCE, name, storage.device)
    threads = 32 * _LAUNCH["decode_warps"]
    largest = _decode_smem(_LAUNCH["max_split_blocks"], group, c.head_dim, stages)
    _allow_smem(kernel, name, storage.device, largest)
    resident = _sm_count(storage.device.index) * _resident_ctas_per_sm(
        kernel, name, storage.device.index, threads, largest)
    splits, split_tokens = plan_splits(batch * c.num_kv_heads * groups, max_blocks * c.block_size,
                                       c.block_size, resident)
    return DecodePlan(name, group, groups, splits, split_tokens, threads,
                      _decode_smem(split_tokens // c.block_size, group, c.head_dim, stages))


def _decode_cupy(storage, layer, query, block_tables, seq_lens, query_lens, scale) -> torch.Tensor:
    c = storage.config
    batch, heads, _, head_dim = query.shape
    device = storage.device
    if head_dim > 1 and query.stride(-1) != 1:
        query = query.contiguous()
    plan = decode_plan(storage, batch, heads, block_tables.shape[1])
    kernel = kernel_loader.get_kernel(_SOURCE, plan.kernel_name, device)
    max_tokens = block_tables.shape[1] * c.block_size
    out = torch.empty((batch, heads, 1, head_dim), dtype=c.dtype, device=device)
    ws_acc = ws_ml = None
    if plan.splits > 1:
        ws_acc = torch.empty((batch, heads, plan.splits, head_dim), dtype=torch.float32, device=device)
        ws_ml = torch.empty((batch, heads, plan.splits, 2), dtype=torch.float32, device=device)
    ptr = lambda t: np.uint64(0 if t is None else t.data_ptr())  # noqa: E731
    lengths = (ptr(seq_lens), ptr(query_lens))
    with kernel_loader.on_torch_stream(device):
        kernel((plan.splits, c.num_kv_heads * plan.groups, batch), (plan.threads,), (
            ptr(query), np.int64(query.stride(0)), np.int64(query.stride(1)), ptr(out),
            ptr(ws_acc), ptr(ws_ml), storage.cupy_chunk_ptrs, ptr(block_tables),
            np.int32(block_tables.stride(0)), *lengths, np.int32(c.num_kv_heads),
            np.int32(heads // c.num_kv_heads), np.int32(c.block_size.bit_length() - 1),
            np.int32(storage.chunk_blocks), np.int32(storage.address_blocks), np.int32(layer),
            np.int32(max_tokens), np.int32(plan.split_tokens), np.float32(scale * _LOG2E)),
            shared_mem=plan.smem_bytes)
        if plan.splits > 1:
            reduce = kernel_loader.get_kernel(
                _SOURCE, f"paged_decode_reduce_{_DTYPE_NAMES[c.dtype]}_d{head_dim}", device)
            reduce((heads, batch), (-(-head_dim // 32) * 32,), (
                ptr(out), ptr(ws_acc), ptr(ws_ml), *lengths, np.int32(max_tokens),
                np.int32(plan.split_tokens), np.int32(plan.splits)))
    return out
