"""CuPy kernels against the torch fallback on a GPU, bit for bit (marked gpu: skipped without CUDA)."""

import os
import random

import pytest
import torch

from ponytail import CacheConfig, PagedKVCache
from ponytail.kernels import loader as kernel_loader
from ponytail.kv import cache_ops
from cache_machine import bits, kernels

pytestmark = pytest.mark.gpu


def make_cache(dtype, head_dim, kv_heads=4, layers=3, blocks=64, chunk_blocks=16) -> PagedKVCache:
    config = CacheConfig(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                         max_batch_size=1, max_seq_len=blocks * 16, chunk_blocks=chunk_blocks, device="cuda")
    cache = PagedKVCache(config, initial_chunks=blocks // chunk_blocks)
    for chunk in cache.storage.chunks:
        chunk.copy_(torch.randn_like(chunk, dtype=torch.float32).to(dtype))
    return cache


def clone_pool(cache):
    return [c.clone() for c in cache.storage.chunks]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256, 3])
def test_write_slots_kernel_equals_fallback(dtype, head_dim):
    cache = make_cache(dtype, head_dim)
    start = clone_pool(cache)
    tokens = 300
    slots = torch.randperm(64 * 16, device="cuda")[:tokens]
    slots[::7] = -1  # padding
    # [layers, heads, tokens, dim] transposed to [layers, tokens, heads, dim]: a strided view.
    keys = torch.randn(3, 4, tokens, head_dim, device="cuda").to(dtype).transpose(1, 2)
    values = torch.randn(3, tokens, 4, head_dim, device="cuda").to(dtype)
    results = {}
    for mode in ("cupy", "torch"):
        for chunk, saved in zip(cache.storage.chunks, start):
            chunk.copy_(saved)
        with kernels(mode):
            cache.write(keys[1:], values[1:], slots, layer_start=1)
        results[mode] = clone_pool(cache)
    for a, b, s in zip(results["cupy"], results["torch"], start):
        assert torch.equal(bits(a), bits(b))
        assert not torch.equal(bits(a), bits(s)) or tokens == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_copy_blocks_kernel_equals_fallback_across_chunks(dtype):
    cache = make_cache(dtype, 128)
    ids = list(range(64))
    random.Random(0).shuffle(ids)
    pairs = list(zip(ids[:30], ids[30:60]))
    start = clone_pool(cache)
    results = {}
    for mode in ("cupy", "torch"):
        for chunk, saved in zip(cache.storage.chunks, start):
            chunk.copy_(saved)
        with kernels(mode):
            cache_ops.copy_blocks(cache.storage, pairs)
        results[mode] = clone_pool(cache)
    for a, b in zip(results["cupy"], results["torch"]):
        assert torch.equal(bits(a), bits(b))
    for src, dst in pairs:
        assert torch.equal(bits(cache.storage.block_data(dst)), bits(cache.storage.block_data(src)))


def test_cupy_views_share_the_torch_memory():
    import cupy

    cache = make_cache(torch.float16, 64, blocks=32)
    for chunk, view in zip(cache.storage.chunks, cache.storage.cupy_views):
        assert view.data.ptr == chunk.data_ptr() and view.shape == chunk.shape
        view[0, 0, 0, 0, 0, 0] = 7.0
        torch.cuda.synchronize()
        assert chunk[0, 0, 0, 0, 0, 0].item() == 7.0
    table = cupy.asnumpy(cache.storage.cupy_chunk_ptrs).tolist()
    live = [c.data_ptr() for c in cache.storage.chunks]
    assert table[: len(live)] == live and set(table[len(live) :]) <= {live[0]}


def test_pointer_table_stays_put_while_the_pool_grows_and_shrinks():
    """CUDA graphs bake the table's address and address_blocks in: neither may move."""
    config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16, max_batch_size=1,
                         max_seq_len=64 * 16, chunk_blocks=16, device="cuda")
    cache = PagedKVCache(config, initial_chunks=1)
    table, bound, version = cache.storage.chunk_ptrs.data_ptr(), cache.storage.address_blocks, \
        cache.storage.ptr_table_version
    cache.grow(cache.max_chunks - cache.num_chunks)
    cache.shrink()
    assert cache.storage.chunk_ptrs.data_ptr() == table and cache.storage.address_blocks == bound
    assert cache.storage.ptr_table_version == version
    assert cache.storage.cupy_chunk_ptrs.data.ptr == table


def test_growing_does_not_wait_for_the_work_queued_before_it():
    """The engine grows the pool while a step runs (async scheduling): a grow that waited for the
    device would leave it idle while the host builds the next step."""
    config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16, max_batch_size=1,
                         max_seq_len=64 * 16, chunk_blocks=16, device="cuda")
    cache = PagedKVCache(config, initial_chunks=1)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of device time queued on the current stream
    assert cache.grow(2) == 2
    still_running = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_running, "grow() waited for the queued work"
    pointers = cache.storage.chunk_ptrs[:cache.num_chunks].tolist()  # the table's copy landed in order
    assert pointers == [c.data_ptr() for c in cache.storage.chunks]


def test_custom_kernel_is_chosen_and_logged(caplog, monkeypatch):
    import logging

    monkeypatch.delenv("PONYTAIL_KERNELS", raising=False)
    choice = kernel_loader.choose(torch.device("cuda:0"))
    assert choice.use_custom and choice.label == "custom kernel"
    cache = make_cache(torch.float16, 64, blocks=16)
    with caplog.at_level(logging.DEBUG, logger="ponytail.kernels"):
        cache_ops.copy_blocks(cache.storage, [(0, 1)])
    assert any("copy_blocks: custom kernel (CuPy RawModule on cuda:0)" in r.getMessage() for r in caplog.records)


def test_shrink_gives_memory_back_to_the_device():
    torch.cuda.empty_cache()
    config = CacheConfig(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", max_batch_size=64,
                         max_seq_len=4096, chunk_blocks=1024, device="cuda")  # 2 GiB chunks
    cache = PagedKVCache(config)
    chunk_bytes = cache.storage.chunk_bytes
    for seq in range(8):  # 8 x 1024 tokens = 512 blocks; then a long one to force growth
        assert cache.allocate(seq, [seq] * 1024)
    assert cache.allocate("long", list(range(3 * 1024 * 16)))
    assert cache.num_chunks == 4
    keys = torch.randn(32, 1024, 8, 128, device="cuda", dtype=torch.bfloat16)
    grown = torch.cuda.memory_reserved()
    free_before = torch.cuda.mem_get_info()[0]
    slots = [cache.allocator.slot(3, p) for p in range(1024)]
    cache.write(keys, keys, slots)
    cache.free("long")
    for seq in (0, 1, 2, 4, 5, 6, 7):
        cache.free(seq)
    released = cache.shrink()
    assert released == 3 and cache.num_chunks == 1
    assert torch.cuda.memory_reserved() <= grown - 3 * chunk_bytes
    assert torch.cuda.mem_get_info()[0] >= free_before + 3 * chunk_bytes - (64 << 20)
    assert torch.equal(bits(cache.read(3)[:, 0]), bits(keys))
    assert cache.invariants() == []
