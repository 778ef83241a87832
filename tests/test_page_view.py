"""The pool's page view (kv/page_view.py): every block of every layer as a page of one grid."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ponytail import CacheConfig, PagedKVCache
from ponytail.kv import page_view as page_view_module
from ponytail.kv.page_view import aligned_empty, build_page_view

LAYERS = 3


def make_pool(chunks: int = 3, spacer_elems: int = 0, chunk_blocks: int = 4, kv_heads: int = 3,
              head_dim: int = 8) -> PagedKVCache:
    """A CPU pool of random K/V; spacer_elems: a float32 tensor that size is allocated after the
    first chunk and before the others (kept on the pool, so the addresses stay apart)."""
    config = CacheConfig(num_layers=LAYERS, num_kv_heads=kv_heads, head_dim=head_dim, dtype=torch.bfloat16,
                         max_batch_size=1, max_seq_len=16 * chunk_blocks * (chunks + 2), block_size=16,
                         chunk_blocks=chunk_blocks, device="cpu")
    cache = PagedKVCache(config, initial_chunks=1)
    cache.spacer = torch.empty(spacer_elems)
    cache.storage.add_chunks(chunks - 1)
    for chunk in cache.storage.chunks:
        chunk.copy_(torch.randn(chunk.shape).to(chunk.dtype))
    return cache


def assert_pages_hold_the_blocks(storage, block_ids: list[int]) -> None:
    view = storage.page_view()
    table = view.page_table(torch.tensor([block_ids], dtype=torch.int32))
    for layer in range(LAYERS):
        k, v = view.layer(layer)
        for block, page in zip(block_ids, table[0].tolist()):
            data = storage.block_data(block)
            assert torch.equal(k[page], data[layer, 0]), f"layer {layer} block {block}: K"
            assert torch.equal(v[page], data[layer, 1]), f"layer {layer} block {block}: V"


def test_chunks_start_on_the_grid_of_one_layer_block():
    storage = make_pool(chunks=4, kv_heads=3, head_dim=8).storage  # 768-byte blocks: not a power of two
    assert all(chunk.data_ptr() % storage.layer_block_bytes == 0 for chunk in storage.chunks)
    assert all(tuple(chunk.shape) == storage.chunk_shape and chunk.is_contiguous() for chunk in storage.chunks)


@settings(max_examples=25, deadline=None)
@given(spacer=st.integers(0, 200_000), chunks=st.integers(1, 5), data=st.data())
def test_every_block_of_every_layer_is_its_page_in_that_layers_k_and_v(spacer, chunks, data):
    storage = make_pool(chunks=chunks, spacer_elems=spacer).storage
    blocks = data.draw(st.lists(st.integers(0, storage.num_blocks - 1), min_size=1, max_size=12))
    assert_pages_hold_the_blocks(storage, blocks)


def test_padding_reads_as_block_zero_and_views_are_rebuilt_when_the_pool_changes():
    cache = make_pool(chunks=2)
    storage = cache.storage
    view = storage.page_view()
    assert storage.page_view() is view  # kept while the chunks stay
    table = view.page_table(torch.tensor([[5, -1, -1]], dtype=torch.int32))
    assert table[0, 1:].tolist() == [view.page_table(torch.tensor([[0]], dtype=torch.int32)).item()] * 2
    # An id past what the chunk table addresses reads the last addressable block, inside the pool.
    last = storage.address_blocks - 1
    beyond = view.page_table(torch.tensor([[last + 1, 10**6]], dtype=torch.int32))
    assert beyond[0].tolist() == [view.page_table(torch.tensor([[last]], dtype=torch.int32)).item()] * 2
    storage.add_chunks(2)
    for chunk in storage.chunks[2:]:
        chunk.copy_(torch.randn(chunk.shape).to(chunk.dtype))
    grown = storage.page_view()
    assert grown is not view and grown.first_page.shape[0] >= 4
    assert_pages_hold_the_blocks(storage, list(range(storage.num_blocks)))
    storage.release_chunks(3)
    assert storage.page_view() is not grown
    assert_pages_hold_the_blocks(storage, list(range(storage.num_blocks)))


def test_no_view_where_a_chunk_is_off_the_grid_or_the_pages_outgrow_int32(monkeypatch):
    storage = make_pool(chunks=2).storage
    page_bytes = storage.layer_block_bytes
    chunk_bytes = storage.chunks[0].numel() * storage.chunks[0].element_size()
    off = aligned_empty((chunk_bytes + 2,), torch.uint8, torch.device("cpu"), page_bytes)[2:]  # 2 bytes past the grid
    shifted = off.view(torch.bfloat16).view(storage.chunk_shape)
    assert build_page_view([storage.chunks[0], shifted], room=2) is None
    assert build_page_view([], room=2) is None
    view = build_page_view(storage.chunks, room=2)
    monkeypatch.setattr(page_view_module, "MAX_PAGES", view.grid.shape[0] - 1)
    assert build_page_view(storage.chunks, room=2) is None


@pytest.mark.parametrize("align", [2, 768, 4096])
def test_aligned_empty_starts_on_the_alignment(align):
    tensor = aligned_empty((3, 5, 7), torch.bfloat16, torch.device("cpu"), align)
    assert tensor.data_ptr() % align == 0 and tuple(tensor.shape) == (3, 5, 7) and tensor.is_contiguous()
