"""The elastic pool: growth within the budget, defragmentation, shrinking, the maintain() policy."""

import pytest
import torch

from ponytail import CacheConfig, NoRoom, PagedKVCache


def make_cache(max_blocks=12, chunk_blocks=4, threshold=0.1, prefix_caching=False,
               release_after_s=0.0) -> PagedKVCache:
    config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", max_batch_size=1,
                         max_seq_len=max_blocks * 4, block_size=4, chunk_blocks=chunk_blocks,
                         defrag_threshold=threshold, device="cpu")
    return PagedKVCache(config, release_after_s=release_after_s, enable_prefix_caching=prefix_caching)


def fill(cache, seq_id, n):
    result = cache.allocate(seq_id, [seq_id * 1000 + i for i in range(n)])  # distinct tokens
    assert result
    k = torch.randn(2, n, 2, 4)
    cache.write(k, -k, result.slots)
    cache.mark_computed(seq_id, n)
    return k


def assert_holds(cache, seq_id, k):
    data = cache.read(seq_id)
    assert torch.equal(data[:, 0], k) and torch.equal(data[:, 1], -k)


def test_pool_starts_with_one_chunk_and_grows_on_demand_within_budget():
    cache = make_cache()
    assert cache.stats().total_blocks == 4
    fill(cache, 1, 20)  # 5 blocks: one more chunk
    assert cache.stats().total_blocks == 8 and cache.num_chunks == 2
    fill(cache, 2, 16)  # 4 more: the third and last chunk
    assert cache.num_chunks == 3
    refused = cache.allocate(3, list(range(16)))
    assert isinstance(refused, NoRoom) and refused.needed == 4 and refused.free == 3
    assert cache.num_chunks == 3 and cache.invariants() == []


def test_defragment_moves_fewest_blocks_and_keeps_data_bit_exact():
    cache = make_cache()
    fill(cache, 1, 8)  # blocks 0, 1
    k2 = fill(cache, 2, 8)  # blocks 2, 3
    k3 = fill(cache, 3, 6)  # blocks 4, 5
    cache.free(1)
    assert cache.fragmentation == pytest.approx(2 / 6)
    result = cache.defragment()
    assert result.blocks_moved == 2
    assert result.bytes_moved == 2 * cache.config.block_bytes
    assert cache.block_table(3) == [0, 1] and cache.block_table(2) == [2, 3]
    assert_holds(cache, 2, k2)
    assert_holds(cache, 3, k3)
    assert cache.fragmentation == 0.0 and cache.invariants() == []


def test_shrink_compacts_then_releases_tail_chunks():
    cache = make_cache()
    fill(cache, 1, 16)
    fill(cache, 2, 16)
    k3 = fill(cache, 3, 4)  # block 8, in the third chunk
    cache.free(1)
    cache.free(2)
    assert cache.num_chunks == 3
    assert cache.shrink() == 2
    assert cache.num_chunks == 1 and cache.block_table(3) == [0]
    assert_holds(cache, 3, k3)
    assert cache.storage.allocated_bytes == 4 * cache.config.block_bytes
    assert cache.invariants() == []


def test_shrink_evicts_least_recently_used_prefix_blocks_and_keeps_the_rest():
    cache = make_cache(prefix_caching=True)
    k1 = fill(cache, 1, 16)  # blocks 0..3, all full: cached when freed
    fill(cache, 2, 20)  # blocks 4..8
    cache.free(2)
    cache.free(1)
    assert cache.stats().evictable_blocks == 9 and cache.stats().used_blocks == 0
    assert cache.shrink() == 2  # one chunk kept: seq 2's older blocks are evicted
    assert cache.stats().evictable_blocks == 4 and cache.num_chunks == 1
    hit = cache.allocate(5, [1000 + i for i in range(16)] + [7])
    assert hit.num_cached_tokens == 16
    assert torch.equal(cache.read(5)[:, 0, :16], k1)
    assert cache.invariants() == []


def test_maintain_grows_when_low_defragments_over_threshold_and_releases_idle_chunks():
    cache = make_cache(max_blocks=16, chunk_blocks=4, threshold=0.3)
    fill(cache, 1, 4)  # block 0
    fill(cache, 2, 12)  # blocks 1..3: the first chunk is full
    report = cache.maintain()  # 0 free blocks: under the 5% watermark
    assert report.chunks_added == 1 and cache.num_chunks == 2
    k3 = fill(cache, 3, 8)  # blocks 4, 5
    cache.free(2)  # holes 1..3 below the high-water mark 6: fragmentation 0.5
    report = cache.maintain()
    assert report.defrag is not None and report.defrag.blocks_moved == 2
    assert cache.block_table(3) == [1, 2]
    assert_holds(cache, 3, k3)
    # 3 blocks occupied + one chunk of headroom fit in 2 chunks: nothing to release yet.
    assert report.chunks_released == 0 and cache.num_chunks == 2
    fill(cache, 4, 32)  # 8 blocks, 5 free: grows by the one chunk it lacks
    assert cache.num_chunks == 3
    cache.free(4)
    report = cache.maintain()
    assert report.chunks_released == 1 and cache.num_chunks == 2
    assert cache.invariants() == []


def test_spare_chunks_go_back_only_after_release_after_s_spare_in_a_row():
    cache = make_cache(max_blocks=64, chunk_blocks=8, release_after_s=10.0)
    fill(cache, 1, 4 * 30)  # 30 blocks: 4 chunks
    cache.free(1)  # 3 chunks to spare (one chunk of headroom stays)
    assert cache.seconds_until_release(now=100.0) == 10.0  # the count starts here
    assert cache.maintain(now=105.0).chunks_released == 0 and cache.num_chunks == 4
    fill(cache, 2, 4 * 30)  # a burst uses the pool again: nothing spare, the count stops
    assert cache.maintain(now=106.0).chunks_released == 0 and cache.seconds_until_release(now=106.0) is None
    cache.free(2)
    assert cache.maintain(now=107.0).chunks_released == 0  # spare again: counts from 107, not 100
    assert cache.maintain(now=116.5).chunks_released == 0 and cache.num_chunks == 4
    assert cache.seconds_until_release(now=116.5) == 0.5
    assert cache.maintain(now=117.0).chunks_released == 3 and cache.num_chunks == 1
    assert cache.seconds_until_release(now=117.0) is None and cache.invariants() == []


def test_maintain_grows_ahead_only_for_the_reserve_it_is_given():
    cache = make_cache(max_blocks=64, chunk_blocks=8, threshold=0.9)
    fill(cache, 1, 4 * 30)  # 30 of 32 blocks used (4 chunks): 2 free, under the 5% default
    assert cache.maintain(reserve_blocks=2).chunks_added == 0  # 2 free cover a reserve of 2
    assert cache.num_chunks == 4
    assert cache.maintain(reserve_blocks=3).chunks_added == 1 and cache.num_chunks == 5
    assert cache.invariants() == []


def test_pool_sizes_and_block_tables_through_the_cache():
    cache = make_cache(max_blocks=12, chunk_blocks=4)
    assert (cache.max_blocks, cache.chunk_blocks, cache.num_chunks) == (12, 4, 1)
    assert cache.growable_blocks == 8 and cache.available_blocks == 12
    fill(cache, 1, 4 * 5 + 1)  # 6 blocks: the pool grows to 2 chunks
    assert cache.num_chunks == 2 and cache.growable_blocks == 4 and cache.available_blocks == 4 + 2
    table = cache.block_table(1)
    assert len(table) == 6 and cache.block_table(1, 9) == table[:3] and cache.block_table(1, 0) == []
    assert cache.slots(1, 3, 6) == [table[0] * 4 + 3, table[1] * 4, table[1] * 4 + 1]
    assert cache.has_seq(1) and not cache.has_seq(2)


def test_prefix_caching_and_release_delay_are_constructor_settings():
    with_prefixes = make_cache(prefix_caching=True, release_after_s=5.0)
    assert with_prefixes.allocator.enable_prefix_caching and with_prefixes.release_after_s == 5.0
    fill(with_prefixes, 1, 8)
    assert with_prefixes.allocate(2, [1000 + i for i in range(8)] + [7]).num_cached_tokens == 8
    without = make_cache(prefix_caching=False)
    fill(without, 1, 8)
    assert without.allocate(2, [1000 + i for i in range(8)] + [7]).num_cached_tokens == 0


def keeping_cache(keep: bool, max_blocks=64, release_after_s=10.0) -> PagedKVCache:
    config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", max_batch_size=1,
                         max_seq_len=max_blocks * 4, block_size=4, chunk_blocks=8, device="cpu")
    return PagedKVCache(config, release_after_s=release_after_s, keep_prefixes=keep)


@pytest.mark.parametrize("keep", [False, True])
def test_keep_prefixes_grows_the_pool_rather_than_evict_a_finished_prompt(keep):
    cache = keeping_cache(keep)
    k = fill(cache, 1, 4 * 8)  # one chunk of blocks, all cached once sequence 1 ends
    cache.free(1)
    fill(cache, 2, 4 * 8)  # another prompt as long
    assert cache.num_chunks == (2 if keep else 1)
    again = cache.allocate(3, [1000 + i for i in range(32)] + [7])
    assert again.num_cached_tokens == (32 if keep else 0)
    if keep:  # the hit reads the first prompt's K/V back
        assert torch.equal(cache.read(3)[:, 0, :32], k)
    assert cache.invariants() == []


def test_keep_prefixes_evicts_once_the_budget_is_reached():
    cache = keeping_cache(True, max_blocks=16)  # two chunks
    fill(cache, 1, 4 * 8)
    cache.free(1)
    fill(cache, 2, 4 * 8)  # grows into the second chunk
    cache.free(2)
    fill(cache, 3, 4 * 12)  # no chunk left to grow by: 12 of the 16 cached blocks are evicted
    assert cache.num_chunks == 2 and cache.allocator.num_evictable == 4
    cache.free(3)
    assert cache.allocate(4, [1000 + i for i in range(8)] + [7]).num_cached_tokens == 0  # least recent went first
    assert cache.invariants() == []


def test_keep_prefixes_holds_cached_blocks_until_the_pool_is_idle_for_release_after_s():
    import time
    cache = keeping_cache(True, release_after_s=10.0)
    fill(cache, 1, 4 * 30)  # 30 blocks: 4 chunks
    cache.free(1)
    fill(cache, 2, 4)  # a live sequence; the 30 cached blocks stay
    t = time.monotonic()
    assert cache.maintain(now=t).chunks_released == 0
    assert cache.maintain(now=t + 100).chunks_released == 0 and cache.num_chunks == 5  # busy all along
    cache.free(2)  # idle from here
    idle = time.monotonic()
    assert cache.maintain(now=idle + 5).chunks_released == 0
    assert cache.allocator.num_evictable == 31
    assert 4.9 < cache.seconds_until_release(now=idle + 5) <= 5.0  # an idle engine waits this long, then maintains
    assert cache.maintain(now=idle + 10.5).chunks_released == 4 and cache.num_chunks == 1  # one chunk of headroom
    assert cache.allocator.num_evictable == 8 and cache.invariants() == []


def test_without_keep_prefixes_idle_cached_blocks_are_spare():
    cache = keeping_cache(False, release_after_s=10.0)
    fill(cache, 1, 4 * 30)
    cache.free(1)
    assert cache.seconds_until_release(now=100.0) == 10.0
    assert cache.maintain(now=110.0).chunks_released == 3 and cache.num_chunks == 1
