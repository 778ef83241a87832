"""Paged decode on CUDA: one query position per row, the split-KV CuPy kernel and its launch plan.

The grid is (splits, kv_heads * groups, batch): each CTA streams one piece of a row's sequence for
up to `max_heads_per_cta` query heads sharing a KV head; with several splits a reduce kernel
merges the pieces' partial softmaxes. `plan_splits` picks the split count from the device's
resident CTAs (the driver's occupancy calculator).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import KernelError
from ..kernels import loader as kernel_loader
from ..kv.storage import PagedKVStorage
from ..utils.arith import cdiv

SOURCE = "paged_attention.cu"
DECODE_HEAD_DIMS = (64, 80, 96, 128, 256)  # instantiated in paged_attention.cu
WINDOWED = "PONYTAIL_WINDOWED"  # the define that compiles paged_attention.cu's windowed kernels (_w)
FP8 = "PONYTAIL_FP8"  # the define that compiles its kernels for FP8 pools
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_LOG2E = 1.4426950408889634

# Launch tunables, read in this module and nowhere else.
LAUNCH = {
    "decode_warps": 4,  # warps per decode CTA; each streams its own steps of tokens
    # The next three are compiled into the kernel names (..._l4s3v1): paged_attention.cu instantiates
    # this one configuration (52 KiB of shared memory a CTA: 4 CTAs share an SM).
    "decode_loads": 4,  # 16-byte K (and V) vectors per lane per step
    "decode_stages": 3,  # steps in each warp's shared-memory ring (stages - 1 in flight)
    "decode_row_vectors": 1,  # 16-byte vectors of a K/V row per lane
    "max_heads_per_cta": 8,  # query heads sharing one KV head in one CTA: 1, 2, 4 or 8
    "max_heads_per_cta_fp8": 4,  # the same for FP8 pools (paged_attention.cu instantiates 1, 2 and 4)
    "max_split_blocks": 512,  # block addresses one CTA stages in shared memory (8 bytes each)
    "min_split_tokens": 256,  # never split a sequence into pieces shorter than this
    "split_overhead_tokens": 64,  # fixed cost of one CTA, in tokens' worth of streaming
}


def decode_choice(choice: kernel_loader.KernelChoice, head_dim: int) -> kernel_loader.KernelChoice:
    if not choice.use_custom or head_dim in DECODE_HEAD_DIMS:
        return choice
    reason = f"head_dim={head_dim} has no decode kernel (kernels: {', '.join(map(str, DECODE_HEAD_DIMS))})"
    if kernel_loader.kernel_mode() == "cupy":
        raise KernelError(f"{kernel_loader.KERNELS_ENV}=cupy but {reason}")
    return kernel_loader.KernelChoice(False, reason)



def module_defines(storage: PagedKVStorage, window: int | None) -> tuple[str, ...]:
    """The defines of the paged_attention.cu module holding this pool's kernels (FP8 or not) for a
    layer with or without a sliding window."""
    return (FP8,) * (storage.scales is not None) + (WINDOWED,) * (window is not None)


def kernel_dtype(storage: PagedKVStorage) -> str:
    """The name part of this pool's kernels: the model's dtype, prefixed fp8_ for FP8 pools."""
    name = _DTYPE_NAMES[storage.config.dtype]
    return name if storage.scales is None else f"fp8_{name}"


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _decode_smem(split_blocks: int, group: int, head_dim: int, stages: int) -> int:
    """Dynamic shared memory of one decode CTA; the layout is the kernel's."""
    warps = LAUNCH["decode_warps"]
    table = (split_blocks * 8 + 15) // 16 * 16
    rings = warps * stages * 2 * LAUNCH["decode_loads"] * 32 * 16
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
    return _plan_splits(base_ctas, max_tokens, block_size, resident_ctas, LAUNCH["max_split_blocks"],
                        LAUNCH["min_split_tokens"], LAUNCH["split_overhead_tokens"])


@functools.lru_cache(maxsize=4096)
def _plan_splits(base_ctas, max_tokens, block_size, resident_ctas, max_split_blocks, min_split_tokens,
                 overhead_tokens) -> tuple[int, int]:
    if max_tokens == 0:
        return 1, block_size
    fewest = cdiv(max_tokens, max_split_blocks * block_size)
    most = max(fewest, max_tokens // max(min_split_tokens, 1))
    # Powers of two only, from the one at or above fewest (the table must fit) up to most: plans of
    # 3, 5, 6 or 7 splits measured slower than those of 1, 2 or 4 (docs/engine.md).
    first = 1 << (fewest - 1).bit_length()
    counts = [first << k for k in range(max(most // first, 1).bit_length())]
    best = None
    for splits in counts:
        split_tokens = cdiv(cdiv(max_tokens, splits), block_size) * block_size
        used = cdiv(max_tokens, split_tokens)
        waves = cdiv(base_ctas * used, resident_ctas)
        cost = waves * (split_tokens + overhead_tokens)
        if best is None or cost < best[0]:
            best = (cost, used, split_tokens)
    return best[1], best[2]


@dataclass(frozen=True, slots=True)
class NewTokenKV:
    """Each decode row's new token, for the kernel to write into the cache before it attends (one
    launch fewer per layer than cache_ops.write_slots first). keys / values [rows, kv_heads,
    head_dim] (head_dim contiguous, any other strides, the cache's dtype); slots int64 [rows], the
    token's slot (-1: nothing written). A row's slot must be where its seq_lens-th token goes (the
    kernel reads it back from there), and -1 where seq_lens is 0."""

    keys: torch.Tensor
    values: torch.Tensor
    slots: torch.Tensor


@dataclass(frozen=True, slots=True)
class DecodePlan:
    kernel_name: str  # paged_decode_<dtype>_d<head_dim>_g<group>_l<loads>s<stages>v<row vectors>
    group: int  # query heads per CTA (a power of two; heads past the GQA ratio idle)
    groups: int  # CTAs per KV head along the grid's y axis
    splits: int  # CTAs per row along the sequence (1: the kernel writes the output itself)
    split_tokens: int  # tokens per split, a multiple of block_size
    threads: int
    smem_bytes: int  # dynamic shared memory of one CTA


def decode_plan(storage: PagedKVStorage, batch: int, heads: int, max_blocks: int,
                window: int | None = None) -> DecodePlan:
    """How a decode launch is laid out for this cache, batch and block-table width. With a sliding
    window the splits cover the blocks a window can touch (window + block_size - 1 tokens at most,
    from the block holding its first token), not the table's width."""
    c = storage.config
    group_size = heads // c.num_kv_heads
    most = LAUNCH["max_heads_per_cta_fp8" if storage.scales is not None else "max_heads_per_cta"]
    group = min(most, 1 << (group_size - 1).bit_length())
    groups = cdiv(group_size, group)
    stages = LAUNCH["decode_stages"]
    name = (f"paged_decode_{kernel_dtype(storage)}_d{c.head_dim}_g{group}_l{LAUNCH['decode_loads']}"
            f"s{stages}v{LAUNCH['decode_row_vectors']}" + ("" if window is None else "_w"))
    kernel = kernel_loader.get_kernel(SOURCE, name, storage.device, module_defines(storage, window))
    threads = 32 * LAUNCH["decode_warps"]
    largest = _decode_smem(LAUNCH["max_split_blocks"], group, c.head_dim, stages)
    _allow_smem(kernel, name, storage.device, largest)
    resident = _sm_count(storage.device.index) * _resident_ctas_per_sm(
        kernel, name, storage.device.index, threads, largest)
    span = max_blocks * c.block_size
    if window is not None:
        span = min(span, cdiv(window + c.block_size - 1, c.block_size) * c.block_size)
    splits, split_tokens = plan_splits(batch * c.num_kv_heads * groups, span, c.block_size, resident)
    return DecodePlan(name, group, groups, splits, split_tokens, threads,
                      _decode_smem(split_tokens // c.block_size, group, c.head_dim, stages))


def decode_cupy(storage, layer, query, block_tables, seq_lens, query_lens, scale,
                window: int | None = None, new_kv: NewTokenKV | None = None) -> torch.Tensor:
    """window: attend each row's last `window` tokens (the `_w` kernels). new_kv: the rows' new
    token, which the kernel writes into the cache before it attends (see NewTokenKV)."""
    c = storage.config
    batch, heads, _, head_dim = query.shape
    device = storage.device
    if head_dim > 1 and query.stride(-1) != 1:
        query = query.contiguous()
    plan = decode_plan(storage, batch, heads, block_tables.shape[1], window)
    defines = module_defines(storage, window)
    windowed = () if window is None else (np.int32(window),)
    kernel = kernel_loader.get_kernel(SOURCE, plan.kernel_name, device, defines)
    max_tokens = block_tables.shape[1] * c.block_size
    out = torch.empty((batch, heads, 1, head_dim), dtype=c.dtype, device=device)
    ws_acc = ws_ml = None
    if plan.splits > 1:
        ws_acc = torch.empty((batch, heads, plan.splits, head_dim), dtype=torch.float32, device=device)
        ws_ml = torch.empty((batch, heads, plan.splits, 2), dtype=torch.float32, device=device)
    ptr = lambda t: np.uint64(0 if t is None else t.data_ptr())  # noqa: E731
    scales = ptr(None if storage.scales is None else storage.scales.values)
    lengths = (ptr(seq_lens), ptr(query_lens))
    if new_kv is None:
        writes = (np.uint64(0), np.uint64(0), np.int64(0), np.int64(0), np.int64(0), np.int64(0), np.uint64(0))
    else:
        k, v = new_kv.keys, new_kv.values
        writes = (ptr(k), ptr(v), np.int64(k.stride(0)), np.int64(k.stride(1)), np.int64(v.stride(0)),
                  np.int64(v.stride(1)), ptr(new_kv.slots))
    with kernel_loader.on_torch_stream(device):
        kernel((plan.splits, c.num_kv_heads * plan.groups, batch), (plan.threads,), (
            ptr(query), np.int64(query.stride(0)), np.int64(query.stride(1)), ptr(out),
            ptr(ws_acc), ptr(ws_ml), storage.cupy_chunk_ptrs, ptr(block_tables),
            np.int32(block_tables.stride(0)), *lengths, np.int32(c.num_kv_heads),
            np.int32(heads // c.num_kv_heads), np.int32(c.block_size.bit_length() - 1),
            np.int32(storage.chunk_blocks), np.int32(storage.address_blocks), np.int32(layer),
            np.int32(max_tokens), np.int32(plan.split_tokens), np.float32(scale * _LOG2E), *writes, scales,
            *windowed),
            shared_mem=plan.smem_bytes)
        if plan.splits > 1:
            name = f"paged_decode_reduce_{_DTYPE_NAMES[c.dtype]}_d{head_dim}" + ("" if window is None else "_w")
            reduce = kernel_loader.get_kernel(SOURCE, name, device, defines)
            reduce((heads, batch), (cdiv(head_dim, 32) * 32,), (
                ptr(out), ptr(ws_acc), ptr(ws_ml), *lengths, np.int32(max_tokens),
                np.int32(plan.split_tokens), np.int32(plan.splits),
                *(() if window is None else (np.int32(c.block_size.bit_length() - 1), np.int32(window)))))
    return out
