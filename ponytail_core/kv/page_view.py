"""The pool's blocks as one paged tensor per layer, for kernels that take a page table.

The pool's chunks are separate allocations (storage.py), so no tensor holds all of a layer's
blocks: Ponytail's kernels reach them through the table of chunk pointers. A kernel with a page
table (FlashAttention-4) instead reads page p of a [pages, block_size, kv_heads, head_dim]
tensor at origin + p * page_bytes. Every chunk starts at an address that is a multiple of
page_bytes (the storage pads its allocation so), so every block of every layer lies on one grid
of pages that starts at the lowest chunk. Layer l's K is a tensor over that grid starting
2 * l * chunk_blocks pages in, its V chunk_blocks pages later, and block j of chunk c is page
first_page[c] + j in both, whatever the layer: one page table per step serves every layer.

The tensors also cover address space between the chunks that the pool does not own. A kernel
reads only the pages its table names, each inside a chunk, so nothing there is ever touched.
vLLM allocates one tensor per layer up front instead; the pool grows and shrinks by chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..utils.device import to_device

MAX_PAGES = 2**31 - 1  # page ids are int32 in the kernels' tables


@dataclass(frozen=True, slots=True)
class PageView:
    grid: torch.Tensor  # [grid pages, block_size, kv_heads, head_dim] from the lowest chunk's start
    first_page: torch.Tensor  # [room for chunks] int32 on the device: each chunk's first page
    chunk_blocks: int
    layer_pages: int  # pages one layer's K (or V) tensor spans: every chunk's blocks

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K and V as [layer_pages, block_size, kv_heads, head_dim] views."""
        k = 2 * layer * self.chunk_blocks
        v = k + self.chunk_blocks
        return self.grid[k : k + self.layer_pages], self.grid[v : v + self.layer_pages]

    def page_table(self, block_tables: torch.Tensor) -> torch.Tensor:
        """block_tables (int32, block ids; -1 padding reads as block 0) as pages of this view, int32.
        Ids are clamped to the blocks the chunk table can address, as the pool's kernels clamp them:
        a bad id reads a wrong block of the pool, never memory outside it or a failed index."""
        blocks = block_tables.clamp(0, self.first_page.shape[0] * self.chunk_blocks - 1)
        chunk = torch.div(blocks, self.chunk_blocks, rounding_mode="floor")
        first = self.first_page.index_select(0, chunk.flatten()).view_as(blocks)
        return first + (blocks - chunk * self.chunk_blocks)

    def pages_for(self, block_tables: torch.Tensor) -> StepPages:
        return StepPages(self, self.page_table(block_tables))


@dataclass(frozen=True, slots=True)
class StepPages:
    """A step's block tables as pages of one view: the view they are valid for, and the table."""

    view: PageView
    table: torch.Tensor  # [rows, max blocks] int32


def aligned_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, align_bytes: int) -> torch.Tensor:
    """torch.empty(shape) whose first element's address is a multiple of align_bytes (a multiple of
    the element size): a view into an allocation one alignment larger."""
    numel = math.prod(shape)
    flat = torch.empty(numel + align_bytes // dtype.itemsize, dtype=dtype, device=device)
    skip = (-flat.data_ptr()) % align_bytes // dtype.itemsize
    return flat[skip : skip + numel].view(shape)


class _Memory:
    """Raw memory as an array interface (CUDA's or NumPy's), for a zero-copy torch view."""

    def __init__(self, address: int, nbytes: int, cuda: bool):
        interface = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}
        if cuda:
            self.__cuda_array_interface__ = interface | {"strides": None}
        else:
            self.__array_interface__ = interface


def build_page_view(chunks: list[torch.Tensor], room: int) -> PageView | None:
    """The view over the pool's `chunks` (each [num_layers, 2, chunk_blocks, block_size, kv_heads,
    head_dim]; room: entries of the chunk pointer table), or None where it cannot be built: no
    chunks, a chunk off the page grid, or more pages than int32 ids."""
    if not chunks:
        return None
    sample = chunks[0]
    num_layers, _, chunk_blocks, *page_shape = sample.shape
    page_bytes = math.prod(page_shape) * sample.element_size()
    starts = [c.data_ptr() for c in chunks]
    if any(start % page_bytes for start in starts):
        return None
    origin = min(starts)
    first = [(start - origin) // page_bytes for start in starts]
    layer_pages = max(first) + chunk_blocks
    grid_pages = layer_pages + (2 * num_layers - 1) * chunk_blocks
    if grid_pages > MAX_PAGES:
        return None
    memory = _Memory(origin, grid_pages * page_bytes, cuda=sample.device.type == "cuda")
    raw = (torch.as_tensor(memory, device=sample.device) if sample.device.type == "cuda"
           else torch.from_numpy(np.asarray(memory)))
    grid = raw.view(sample.dtype).view(grid_pages, *page_shape)
    table = first + first[:1] * (max(room, len(first)) - len(first))  # past the live chunks: chunk 0's, as chunk_ptrs
    return PageView(grid, to_device(torch.tensor(table, dtype=torch.int32), sample.device), chunk_blocks, layer_pages)
