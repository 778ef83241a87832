"""Device memory of the paged KV cache: K and V for every layer, in chunks of blocks.

Each chunk is one torch allocation (so the model and the cache share torch's caching allocator)
of shape [num_layers, 2, chunk_blocks, block_size, num_kv_heads, head_dim]; index 0 of dim 1 is
K, 1 is V. Growing the pool adds a chunk, shrinking drops chunks from the tail: nothing is ever
reallocated or copied to change the pool's size. Kernels reach the chunks through a device table
of base pointers, and CuPy sees each chunk as a zero-copy view of the same memory.

The pointer table has room for `max_chunks` chunks from the start and is rewritten in place, so
its address and the block-id bound kernels clamp against (`address_blocks`) never change while
the pool grows and shrinks: CUDA graphs captured with them stay valid. Entries past the live
chunks point at chunk 0, so even a bad block id reads memory the pool owns.
"""

from __future__ import annotations

import torch

from ..utils.device import to_device
from .config import CacheConfig
from .page_view import PageView, aligned_empty, build_page_view
from .scales import KVScales, dequantize


class PagedKVStorage:
    def __init__(self, config: CacheConfig, chunk_blocks: int, max_chunks: int = 1):
        self.config = config
        self.chunk_blocks = chunk_blocks
        self.device = config.device
        self.chunks: list[torch.Tensor] = []
        # FP8 pools: each layer's K and V scales (scales.py); None where K/V are stored as they come.
        self.scales = KVScales(config.num_layers, self.device) if config.is_fp8 else None
        self.cupy_views: list = []  # zero-copy CuPy views, one per chunk (CUDA with CuPy only)
        self.cupy_chunk_ptrs = None  # zero-copy CuPy view of chunk_ptrs: the kernels' argument
        self.chunk_ptrs = torch.zeros(max(1, max_chunks), dtype=torch.int64, device=self.device)
        self.ptr_table_version = 0  # bumped when the table moves (more chunks than it had room for)
        self._page_view: PageView | None = None  # built at the first page_view() after the chunks change
        self._page_view_current = False

    # --------------------------------------------------------------- layout
    @property
    def chunk_shape(self) -> tuple[int, ...]:
        c = self.config
        return (c.num_layers, 2, self.chunk_blocks, c.block_size, c.num_kv_heads, c.head_dim)

    @property
    def num_blocks(self) -> int:
        return len(self.chunks) * self.chunk_blocks

    @property
    def address_blocks(self) -> int:
        """Block ids below this are safe to dereference (the bound kernels clamp against)."""
        return len(self.chunk_ptrs) * self.chunk_blocks if self.chunks else 0

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_blocks * self.config.block_bytes

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer for K (or V)."""
        return self.config.layer_block_elems * self.config.dtype_size

    @property
    def chunk_allocation_bytes(self) -> int:
        """What one chunk asks of the device: its blocks, and the pad that starts it on the page grid
        (page_view.py). The pool's accounting counts blocks, as it leaves out torch's own rounding."""
        return self.chunk_bytes + self.layer_block_bytes

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the pool's blocks."""
        return len(self.chunks) * self.chunk_bytes

    # ------------------------------------------------------- grow / shrink
    def add_chunks(self, count: int) -> None:
        """Add `count` chunks. If the device runs out of memory part way, the chunks added so far
        stay (views refreshed) and torch.OutOfMemoryError propagates: the caller counts them."""
        try:
            for _ in range(count):
                # empty, not zeros: blocks are always written before they are read. Each chunk starts
                # on the grid of one layer's block (page_view.py).
                self.chunks.append(aligned_empty(self.chunk_shape, self.config.kv_dtype, self.device,
                                                 self.layer_block_bytes))
        finally:
            self._refresh_views()

    def release_chunks(self, count: int) -> None:
        """Drop the last `count` chunks and hand their memory back to the device."""
        if count <= 0:
            return
        del self.chunks[len(self.chunks) - count :]
        self._refresh_views()
        if self.device.type == "cuda":
            # Stream-ordered: queued kernels on these chunks finish before the memory is reused.
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def page_view(self) -> PageView | None:
        """Every layer's blocks as paged tensors with one page table (page_view.py), for kernels that
        take one; None where the chunks do not allow it. A new object after the chunks change: a
        step keeps the one it translated its tables with."""
        if not self._page_view_current:
            self._page_view = build_page_view(self.chunks, len(self.chunk_ptrs))
            self._page_view_current = True
        return self._page_view

    def _refresh_views(self) -> None:
        self._page_view_current = False
        pointers = [t.data_ptr() for t in self.chunks]
        if len(pointers) > len(self.chunk_ptrs):  # beyond the room planned for: a new table
            self.chunk_ptrs = torch.zeros(len(pointers), dtype=torch.int64, device=self.device)
            self.ptr_table_version += 1
            self.cupy_chunk_ptrs = None
        padding = pointers[:1] * (len(self.chunk_ptrs) - len(pointers)) if pointers else [0] * len(self.chunk_ptrs)
        # In place and stream-ordered: kernels queued earlier still read the old entries. Through
        # to_device (pinned, queued): a copy from pageable memory makes torch wait for every step in
        # flight, and the pool grows while async scheduling keeps one step queued ahead.
        self.chunk_ptrs.copy_(to_device(torch.tensor(pointers + padding, dtype=torch.int64), self.device))
        self.cupy_views = []
        if self.device.type == "cuda" and self.chunks:
            try:
                import cupy
            except Exception:
                return  # the fallback runs; kernel_loader logs why
            self.cupy_views = [cupy.from_dlpack(t.detach()) for t in self.chunks]
            if self.cupy_chunk_ptrs is None:
                self.cupy_chunk_ptrs = cupy.from_dlpack(self.chunk_ptrs)

    # ------------------------------------------------------------- access
    def locate(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(chunk index, index within the chunk) of each block id."""
        return block_ids // self.chunk_blocks, block_ids % self.chunk_blocks

    def block_data(self, block_id: int) -> torch.Tensor:
        """View [num_layers, 2, block_size, num_kv_heads, head_dim] of one block."""
        chunk, within = divmod(block_id, self.chunk_blocks)
        return self.chunks[chunk][:, :, within]

    def read_tokens(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """Copy of the K/V of a sequence's first `num_tokens` tokens: [num_layers, 2, T, H, D], in the
        model's dtype (an FP8 pool's values dequantized)."""
        c = self.config
        if not block_ids:
            return torch.empty((c.num_layers, 2, 0, c.num_kv_heads, c.head_dim), dtype=c.dtype,
                               device=self.device)
        data = torch.stack([self.block_data(b) for b in block_ids], dim=2)  # [L, 2, nb, bs, H, D]
        data = data.flatten(2, 3)[:, :, :num_tokens]
        if self.scales is not None:
            return dequantize(data, self.scales.values[:, :, None, None, None], c.dtype)
        return data.clone()
