"""Argument checks shared by the paged attention entry points: shapes, dtypes, devices, lengths.

Values (lengths, block ids) are checked only when they are CPU tensors: on CUDA reading them
would cost a host sync per call, so there the kernels clamp instead.
"""

from __future__ import annotations

import math

import torch

from ..errors import KernelError
from ..kv.storage import PagedKVStorage
from ..utils.arith import cdiv


def check_args(storage: PagedKVStorage, layer: int, query: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, query_lens: torch.Tensor | None, scale: float) -> None:
    if not isinstance(query, torch.Tensor) or query.dim() != 4:
        shape = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        raise KernelError(f"query must be [batch, query heads, positions, head_dim], got {shape}")
    batch, heads, positions, head_dim = query.shape
    if positions == 0:
        raise KernelError(f"query has 0 positions (shape {tuple(query.shape)}); need at least 1")
    check_query(storage, layer, query, heads, head_dim, scale)
    check_rows(storage, batch, block_tables, seq_lens, query_lens)
    if seq_lens.device.type == "cpu":  # values are free to read only on the host
        check_values(storage, block_tables, seq_lens, query_lens, positions)


def check_query(storage: PagedKVStorage, layer, query: torch.Tensor, heads: int, head_dim: int, scale) -> None:
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


def check_rows(storage: PagedKVStorage, batch: int, block_tables: torch.Tensor, seq_lens: torch.Tensor,
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


def check_values(storage, block_tables, seq_lens, query_lens, positions) -> None:
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
        ids = block_tables[b, : cdiv(n, block_size)]
        bad = ids[(ids < 0) | (ids >= storage.num_blocks)]
        if bad.numel():
            raise KernelError(f"block_tables[{b}] holds block ids {bad[:8].tolist()} outside the pool's "
                              f"{storage.num_blocks} blocks within its first {n} tokens")



def check_window(window) -> None:
    """A sliding window is None (every position up to the query's own) or a positive int."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise KernelError(f"sliding_window={window!r} must be None or a positive int (the positions a query "
                          "attends, its own included)")


def check_new_kv(storage: PagedKVStorage, new_kv, batch: int, positions: int) -> None:
    """new_kv (decode.NewTokenKV): one token per row, shaped and placed as the cache stores it."""
    c = storage.config
    if positions != 1:
        raise KernelError(f"new_kv takes one query position per row (decode), got {positions}")
    for name, t in (("keys", new_kv.keys), ("values", new_kv.values)):
        if tuple(t.shape) != (batch, c.num_kv_heads, c.head_dim):
            raise KernelError(f"new_kv.{name} must be [{batch} rows, {c.num_kv_heads} kv heads, "
                              f"{c.head_dim} head_dim], got {tuple(t.shape)}")
        if t.dtype != c.dtype or t.device != storage.device:
            raise KernelError(f"new_kv.{name} must be {c.dtype} on {storage.device}, got {t.dtype} on {t.device}")
        if c.head_dim > 1 and t.stride(-1) != 1:
            raise KernelError(f"new_kv.{name} must have a contiguous head_dim (stride 1), got strides {t.stride()}")
    slots = new_kv.slots
    if slots.dtype != torch.int64 or slots.device != storage.device or tuple(slots.shape) != (batch,):
        raise KernelError(f"new_kv.slots must be int64 [{batch}] on {storage.device}, got "
                          f"{slots.dtype} {tuple(slots.shape)} on {slots.device}")
