"""Writing new tokens' K/V into their slots and copying blocks: custom kernel or torch fallback.

Both paths have the same semantics and are bit-exact with each other (they only move bytes).
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels import loader as kernel_loader
from ..kernels.launch import vector_width
from ..errors import KernelError
from .scales import quantize
from .storage import PagedKVStorage
from ..utils.arith import cdiv
from ..utils.device import to_device

_SOURCE = "cache_ops.cu"
# Launch tunables, read by the launches below and nowhere else.
_LAUNCH = {
    "write_max_threads": 512,  # one CTA per (token, layer); threads cover heads x row vectors
    "copy_threads": 256,  # one CTA per (block pair, layer, K-or-V)
    "copy_unroll": 4,  # 16-byte loads in flight per thread before its stores (cache_ops.cu instantiates 4)
}

# The model dtypes an FP8 pool's write kernels read (kv/config.py refuses float32 with FP8 on CUDA).
_FP8_SOURCES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


# ---------------------------------------------------------------- write_slots
def _check_write_args(storage: PagedKVStorage, keys: torch.Tensor, values: torch.Tensor,
                      slot_mapping: torch.Tensor, layer_start: int) -> None:
    c = storage.config
    for name, t in (("keys", keys), ("values", values)):
        if t.dim() != 4 or t.shape[2:] != (c.num_kv_heads, c.head_dim):
            raise KernelError(f"{name} must be [layers, tokens, {c.num_kv_heads} kv heads, "
                              f"{c.head_dim} head_dim], got {tuple(t.shape)}")
        if t.dtype != c.dtype:
            raise KernelError(f"{name} dtype {t.dtype} does not match the cache dtype {c.dtype}")
        if t.device != storage.device:
            raise KernelError(f"{name} is on {t.device}, the cache on {storage.device}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise KernelError(f"{name} must have a contiguous head_dim (stride 1), got strides {t.stride()}")
    if keys.shape != values.shape:
        raise KernelError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in shape")
    if not 0 <= layer_start <= c.num_layers - keys.shape[0]:
        raise KernelError(f"layers {layer_start}..{layer_start + keys.shape[0] - 1} are outside "
                          f"the cache's {c.num_layers} layers")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != keys.shape[1]:
        raise KernelError(f"slot_mapping must be 1-D with one slot per token ({keys.shape[1]}), "
                          f"got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.device != storage.device:
        raise KernelError(f"slot_mapping must be int64 on {storage.device}, got "
                          f"{slot_mapping.dtype} on {slot_mapping.device}")


def write_slots(storage: PagedKVStorage, keys: torch.Tensor, values: torch.Tensor,
                slot_mapping: torch.Tensor, layer_start: int = 0) -> None:
    """Store keys/values [layers, tokens, kv_heads, head_dim] at `slot_mapping` (-1 = skip),
    for layers layer_start.. of the cache, in one launch."""
    _check_write_args(storage, keys, values, slot_mapping, layer_start)
    if keys.shape[0] == 0 or keys.shape[1] == 0:
        return
    if storage.scales is not None and storage.scales.calculating:
        storage.scales.observe(layer_start, keys, values, slot_mapping)
    choice = kernel_loader.choose(storage.device)
    kernel_loader.log_choice("write_slots", choice)
    if storage.scales is not None:  # FP8: quantize; the kernel stores four elements a word
        if choice.use_custom and storage.config.head_dim % 4 == 0:
            _write_slots_fp8_cupy(storage, keys, values, slot_mapping, layer_start)
        else:
            _write_slots_torch(storage, keys, values, slot_mapping, layer_start)
    elif choice.use_custom:
        _write_slots_cupy(storage, keys, values, slot_mapping, layer_start)
    else:
        _write_slots_torch(storage, keys, values, slot_mapping, layer_start)


def _write_slots_cupy(storage, keys, values, slot_mapping, layer_start) -> None:
    c = storage.config
    es = keys.element_size()
    row_bytes = c.head_dim * es
    k_strides = [s * es for s in keys.stride()[:3]]
    v_strides = [s * es for s in values.stride()[:3]]
    width = vector_width(row_bytes, *k_strides, *v_strides, keys.data_ptr(), values.data_ptr())
    kernel = kernel_loader.get_kernel(_SOURCE, f"write_slots_v{width}", storage.device)
    total_vecs = c.num_kv_heads * row_bytes // width
    threads = min(_LAUNCH["write_max_threads"], cdiv(total_vecs, 32) * 32)
    grid = (keys.shape[1], keys.shape[0])
    with kernel_loader.on_torch_stream(storage.device):
        kernel(grid, (threads,), (
            np.uint64(keys.data_ptr()), np.uint64(values.data_ptr()), np.uint64(slot_mapping.data_ptr()),
            storage.cupy_chunk_ptrs,
            *(np.int64(s) for s in k_strides), *(np.int64(s) for s in v_strides),
            np.int32(c.num_kv_heads), np.int32(row_bytes), np.int32(c.block_size),
            np.int32(storage.chunk_blocks), np.int32(layer_start)))


def _write_slots_fp8_cupy(storage, keys, values, slot_mapping, layer_start) -> None:
    """Quantizing writes (cache_ops.cu's write_slots_fp8_*): strides in elements of the 16-bit source."""
    c = storage.config
    kernel = kernel_loader.get_kernel(_SOURCE, f"write_slots_fp8_{_FP8_SOURCES[c.dtype]}", storage.device)
    words = c.num_kv_heads * c.head_dim // 4
    threads = min(_LAUNCH["write_max_threads"], cdiv(words, 32) * 32)
    with kernel_loader.on_torch_stream(storage.device):
        kernel((keys.shape[1], keys.shape[0]), (threads,), (
            np.uint64(keys.data_ptr()), np.uint64(values.data_ptr()), np.uint64(slot_mapping.data_ptr()),
            storage.cupy_chunk_ptrs, np.uint64(storage.scales.values.data_ptr()),
            *(np.int64(s) for s in keys.stride()[:3]), *(np.int64(s) for s in values.stride()[:3]),
            np.int32(c.num_kv_heads), np.int32(c.head_dim), np.int32(c.block_size),
            np.int32(storage.chunk_blocks), np.int32(layer_start)))


def _write_slots_torch(storage, keys, values, slot_mapping, layer_start) -> None:
    c = storage.config
    layers = slice(layer_start, layer_start + keys.shape[0])
    valid = slot_mapping >= 0
    blocks = slot_mapping // c.block_size
    offsets = slot_mapping % c.block_size
    chunk_of, within = storage.locate(blocks)
    for chunk_index, chunk in enumerate(storage.chunks):
        sel = valid & (chunk_of == chunk_index)
        if not bool(sel.any()):
            continue
        tokens = chunk.view(c.num_layers, 2, storage.chunk_blocks * c.block_size, c.num_kv_heads, c.head_dim)
        local = within[sel] * c.block_size + offsets[sel]
        k, v = keys[:, sel], values[:, sel]
        if storage.scales is not None:
            scales = storage.scales.values[layers, :, None, None, None]  # [layers, 2, 1, 1, 1]
            k, v = quantize(k, scales[:, 0]), quantize(v, scales[:, 1])
        tokens[layers, 0, local] = k
        tokens[layers, 1, local] = v


# ---------------------------------------------------------------- copy_blocks
def _check_pairs(storage: PagedKVStorage, pairs: np.ndarray) -> None:
    if pairs.ndim != 2 or pairs.shape[1] != 2:
        raise KernelError(f"copy_blocks: pairs must be (src, dst) pairs, got shape {pairs.shape}")
    n = storage.num_blocks
    bad = pairs[(pairs < 0) | (pairs >= n)]
    if bad.size:
        raise KernelError(f"block ids {bad[:8].tolist()} are outside the pool's {n} blocks")
    if np.unique(pairs[:, 1]).size != len(pairs):
        raise KernelError("copy_blocks: a destination block appears twice")
    if np.intersect1d(pairs[:, 0], pairs[:, 1]).size:
        raise KernelError("copy_blocks: a block is both a source and a destination (the copies would race)")


def copy_blocks(storage: PagedKVStorage, pairs) -> None:
    """Copy whole blocks (every layer, K and V) from src to dst ids, in one launch.

    `pairs` is a sequence of (src, dst) or an int array of shape [n, 2].
    """
    if not len(pairs):  # the common case (an append without copy-on-write): return before any work
        return
    pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    _check_pairs(storage, pairs)
    choice = kernel_loader.choose(storage.device)
    kernel_loader.log_choice("copy_blocks", choice)
    if choice.use_custom:
        pair_tensor = to_device(torch.from_numpy(pairs), storage.device)
        launch_copy_blocks(storage, pair_tensor)
        # Keep the index tensor alive until the stream has consumed it.
        pair_tensor.record_stream(torch.cuda.current_stream(storage.device))
    else:
        _copy_blocks_torch(storage, pairs)


def launch_copy_blocks(storage: PagedKVStorage, pair_tensor: torch.Tensor) -> None:
    """The kernel launch alone, for pairs already checked and on the device ([n, 2] int64)."""
    layer_block_bytes = storage.layer_block_bytes
    width = vector_width(layer_block_bytes)
    kernel = kernel_loader.get_kernel(_SOURCE, f"copy_blocks_v{width}_u{_LAUNCH['copy_unroll']}", storage.device)
    grid = (pair_tensor.shape[0], 2 * storage.config.num_layers)
    with kernel_loader.on_torch_stream(storage.device):
        kernel(grid, (_LAUNCH["copy_threads"],), (
            storage.cupy_chunk_ptrs, np.uint64(pair_tensor.data_ptr()),
            np.int32(storage.chunk_blocks), np.int64(layer_block_bytes)))


def _copy_blocks_torch(storage: PagedKVStorage, pairs: np.ndarray) -> None:
    # No destination is a source (checked), so copying group by group equals one batched copy.
    src_chunk, src_within = np.divmod(pairs[:, 0], storage.chunk_blocks)
    dst_chunk, dst_within = np.divmod(pairs[:, 1], storage.chunk_blocks)
    for sc, dc in set(zip(src_chunk.tolist(), dst_chunk.tolist())):
        sel = (src_chunk == sc) & (dst_chunk == dc)
        src_index = torch.from_numpy(src_within[sel]).to(storage.device)
        dst_index = torch.from_numpy(dst_within[sel]).to(storage.device)
        storage.chunks[dc][:, :, dst_index] = storage.chunks[sc][:, :, src_index]
