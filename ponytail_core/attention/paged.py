"""Attention of new query tokens over a layer's paged K/V: decode kernel, prefill, fp32 fallback.

`paged_attention` runs one of three paths with the same semantics:
  * one query position per row (decode) on CUDA: the custom split-KV kernel;
  * several positions per row (prefill chunks, prefix reuse) on CUDA: one gather launch packs the
    rows' K/V end to end, then flash attention's varlen kernel (through torch) attends with a
    bottom-right causal mask, no padding and no mask tensor; where flash cannot run (fp32, a GPU
    before sm80, a torch without it) a padded gather and SDPA with an explicit mask instead;
    FlashAttention-4 given the step's page table (kv/page_view.py) reads the blocks in place instead;
  * the torch fallback (CPU, PONYTAIL_KERNELS=torch, a head size without a kernel): the same
    gather with tensor indexing, then attention in fp32 with an explicit softmax; varlen calls
    take torch_varlen.py instead, unpadded (per-row SDPA on views, decode rows in groups).

Semantics. The cache already holds every row's K/V including the new tokens. Row b has
seq_lens[b] tokens; its real new tokens are the last query_lens[b] of the T query positions
(None: all T). Query position j (real when j >= T - query_lens[b]) sits at cache position
seq_lens[b] - T + j and attends positions 0 .. that one. Padding positions, rows with
seq_lens[b] == 0 and positions that would sit before position 0 produce zeros.

`paged_attention_varlen` takes the engine's packed layout: rows' query tokens end to end, with
cumulative lengths, and the same semantics per row.

`sliding_window=W` narrows what a query attends to the last W positions up to its own (cache
positions > p - W), on every path: the decode kernel's `_w` variants (compiled only where a model
has a window), flash's left window, the masks of the SDPA and torch paths.

Lengths and block ids are checked against the cache when they are CPU tensors; on CUDA that
would cost a host sync per call, so there the kernels clamp instead (never reading outside the
pool or the table) and bad values give wrong numbers, not a crash.
"""

from __future__ import annotations

import torch

from ..errors import KernelError
from ..kernels import loader as kernel_loader
from ..kv import cache_ops
from ..kv.page_view import StepPages
from ..kv.storage import PagedKVStorage
from .checks import check_args, check_new_kv, check_query, check_rows, check_values, check_window
from .decode import NewTokenKV, decode_choice, decode_cupy
from .fa4 import fa4_paged
from .flash import flash_varlen_problem
from .prefill_cupy import flash_over_cache, prefill_flash_padded, prefill_sdpa
from .torch_fallback import attention_torch
from .torch_varlen import attention_torch_planned, plan_torch_attention


def paged_attention(storage: PagedKVStorage, layer: int, query: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_lens: torch.Tensor | None, scale: float,
                    sliding_window: int | None = None, new_kv: NewTokenKV | None = None) -> torch.Tensor:
    """Attention of `query` [B, Hq, T, D] over layer `layer` of the cache; returns [B, Hq, T, D].

    block_tables [B, max_blocks] int32 lists each row's block ids in order (entries past the
    row's blocks are ignored); seq_lens [B] int32 counts the row's tokens in the cache, new ones
    included; query_lens [B] int32 or None counts its real (right-aligned) query positions.
    Query heads h use KV head h // (Hq // kv_heads). See the module docstring for the semantics.
    sliding_window: each query attends only the last that many positions up to its own.
    new_kv (one query position per row): the rows' new tokens, written into the cache first; the
    decode kernel does it in its own launch, the other paths with cache_ops.write_slots.
    """
    check_args(storage, layer, query, block_tables, seq_lens, query_lens, scale)
    check_window(sliding_window)
    batch, _, positions, head_dim = query.shape
    if new_kv is not None:
        check_new_kv(storage, new_kv, batch, positions)
    choice = kernel_loader.choose(storage.device)
    op = "paged_attention decode" if positions == 1 else "paged_attention prefill"
    flash = False
    if positions == 1:
        choice = decode_choice(choice, head_dim)
    elif choice.use_custom:
        problem = flash_varlen_problem(storage)
        flash = problem is None
        choice = kernel_loader.KernelChoice(True, "CuPy packed gather + flash varlen" if flash else
                                            f"CuPy gather + masked SDPA: {problem}")
    kernel_loader.log_choice(op, choice)
    if batch == 0:
        return torch.empty_like(query)
    args = (storage, layer, query, block_tables, seq_lens, query_lens, float(scale), sliding_window)
    if choice.use_custom and positions == 1:
        return decode_cupy(*args, new_kv=new_kv)
    if new_kv is not None:
        cache_ops.write_slots(storage, new_kv.keys[None], new_kv.values[None], new_kv.slots, layer)
    if not choice.use_custom:
        return attention_torch(*args)
    if flash:
        return prefill_flash_padded(*args)
    return prefill_sdpa(*args)


def paged_attention_varlen(storage: PagedKVStorage, layer: int, query: torch.Tensor, cu_seq_q: torch.Tensor,
                           max_query_len: int, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, varlen: str = "flash", num_keys: int = 0,
                           out: torch.Tensor | None = None, sliding_window: int | None = None,
                           pages: StepPages | None = None) -> torch.Tensor:
    """Attention of packed query tokens [N, Hq, D] over layer `layer`; returns [N, Hq, D].

    Row b's queries are query[cu_seq_q[b] : cu_seq_q[b + 1]] (cu_seq_q [B + 1] int32, starting at
    0 and ending at N), the last of its seq_lens[b] cached tokens; max_query_len bounds every
    row's count. block_tables and seq_lens as for `paged_attention`. varlen: the varlen kernel
    where flash can run, "flash" or "fa4" (fa4.choose_prefill_attention); num_keys: sum(seq_lens)
    where the caller knows it on the host (sizes the gather exactly; 0: not given). out: a contiguous
    [N, Hq, D] tensor the result is written into and returned (the flash kernels write there; the
    other paths copy). sliding_window as for `paged_attention`. pages: block_tables translated to
    the pool's page view (kv/page_view.py, once a step): FlashAttention-4 ("fa4", no window, not an FP8
    pool) then reads the blocks in place (fa4.fa4_paged) instead of after a packed gather.
    """
    check_window(sliding_window)
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
        return torch.empty_like(query) if out is None else out
    choice = kernel_loader.choose(storage.device)
    problem = flash_varlen_problem(storage) if choice.use_custom else choice.reason
    if problem is None:
        check_query(storage, layer, query, query.shape[1], query.shape[2], scale)
        check_rows(storage, batch, block_tables, seq_lens, None)
        if pages is not None and varlen == "fa4" and sliding_window is None and storage.scales is None:
            kernel_loader.log_choice("paged_attention varlen prefill",
                                     kernel_loader.KernelChoice(True, "fa4 varlen over the pool's pages"))
            k, v = pages.view.layer(layer)
            return fa4_paged(query, k, v, pages.table, cu_seq_q, seq_lens, max_query_len, float(scale),
                             out=query.new_empty(query.shape) if out is None else out)
        kernel_loader.log_choice("paged_attention varlen prefill",
                                 kernel_loader.KernelChoice(True, f"CuPy packed gather + {varlen} varlen"))
        return flash_over_cache(storage, layer, query, cu_seq_q, max_query_len, block_tables, seq_lens, float(scale),
                                varlen, num_keys, out=out, window=sliding_window)
    result = _varlen_elsewhere(storage, layer, query, cu_seq_q, max_query_len, block_tables, seq_lens, scale, choice,
                               sliding_window)
    return result if out is None else out.copy_(result)


def _varlen_elsewhere(storage, layer, query, cu_seq_q, max_query_len, block_tables, seq_lens, scale, choice,
                      window):
    """paged_attention_varlen where flash varlen cannot run: the torch path, or CuPy's padded one."""
    batch = block_tables.shape[0]
    if not choice.use_custom:  # the torch path, unpadded: work grows with each row's tokens x its context
        check_query(storage, layer, query, query.shape[1], query.shape[2], scale)
        check_rows(storage, batch, block_tables, seq_lens, None)
        counts = (cu_seq_q[1:] - cu_seq_q[:-1]).to(torch.int32)
        if seq_lens.device.type == "cpu":
            check_values(storage, block_tables, seq_lens, counts, max_query_len)
        kernel_loader.log_choice("paged_attention varlen", choice)
        plan = plan_torch_attention(storage, counts.tolist(), seq_lens.tolist(), block_tables.tolist(), window)
        return attention_torch_planned(storage, layer, query, plan, float(scale))
    # CuPy without flash varlen: the padded entry point (its checks, its gather, its logging).
    padded, row, col = _varlen_to_padded(query, cu_seq_q, max_query_len)
    query_lens = (cu_seq_q[1:] - cu_seq_q[:-1]).to(torch.int32)
    out = paged_attention(storage, layer, padded.transpose(1, 2), block_tables, seq_lens, query_lens, scale,
                          sliding_window=window)
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

