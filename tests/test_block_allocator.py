"""Small pools with exact block ids, ref counts and free lists after every step."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ponytail.kv.block_allocator as block_allocator
from ponytail.kv.block_allocator import BlockAllocator
from ponytail.kv.blocks import NoRoom


def refs(alloc: BlockAllocator) -> list[int]:
    return [b.ref_count for b in alloc.blocks]


def test_allocate_takes_lowest_ids_and_appends_only_at_boundaries():
    alloc = BlockAllocator(12, block_size=4)
    result = alloc.allocate("a", list(range(10)))
    assert alloc.block_table("a") == [0, 1, 2]
    assert result.slots == list(range(10))
    assert result.copies == [] and result.num_cached_tokens == 0
    assert refs(alloc)[:4] == [1, 1, 1, 0]
    assert alloc.num_free == 9

    assert alloc.append("a", [10, 11]).slots == [10, 11]  # fills block 2, no new block
    assert alloc.block_table("a") == [0, 1, 2]
    assert alloc.append("a", [12]).slots == [12]  # boundary: block 3
    assert alloc.block_table("a") == [0, 1, 2, 3]
    assert alloc.seq_len("a") == 13
    assert alloc.invariants() == []


def test_free_returns_blocks_and_next_allocation_reuses_lowest():
    alloc = BlockAllocator(12, block_size=4, enable_prefix_caching=False)
    alloc.allocate("a", [1] * 8)
    alloc.allocate("b", [2] * 4)
    alloc.free("a")
    assert alloc.num_free == 11 and alloc.block_table("b") == [2]
    alloc.allocate("c", [3] * 5)
    assert alloc.block_table("c") == [0, 1]
    assert alloc.invariants() == []


def test_fork_shares_blocks_and_copy_on_write_of_shared_partial_block():
    alloc = BlockAllocator(12, block_size=4)
    alloc.allocate("p", [1, 2, 3, 4, 5, 6])  # block 0 full, block 1 holds 2 tokens
    alloc.fork("p", "c")
    assert alloc.block_table("c") == [0, 1]
    assert refs(alloc)[:3] == [2, 2, 0]

    child = alloc.append("c", [99])
    assert child.copies == [(1, 2)]  # the shared partial block is copied first
    assert child.slots == [2 * 4 + 2]
    assert alloc.block_table("c") == [0, 2]
    assert refs(alloc)[:3] == [2, 1, 1]

    parent = alloc.append("p", [7])  # block 1 is the parent's alone now: written in place
    assert parent.copies == [] and parent.slots == [6]
    assert alloc.invariants() == []

    alloc.free("p")
    assert refs(alloc)[:3] == [1, 0, 1]
    alloc.free("c")
    assert alloc.num_used == 0
    assert alloc.invariants() == []


def test_fork_at_block_boundary_needs_no_copy():
    alloc = BlockAllocator(12, block_size=4)
    alloc.allocate("p", [1, 2, 3, 4])
    alloc.fork("p", "c")
    result = alloc.append("c", [5])
    assert result.copies == [] and alloc.block_table("c") == [0, 1]
    assert alloc.invariants() == []


def test_no_room_changes_nothing():
    alloc = BlockAllocator(3, block_size=4)
    result = alloc.allocate("a", list(range(13)))
    assert isinstance(result, NoRoom) and not result
    assert (result.needed, result.free) == (4, 3)
    assert result.message == "no room: needs 4 free KV blocks, 3 available"
    assert not alloc.has_seq("a") and alloc.num_free == 3

    alloc.allocate("b", list(range(12)))
    before = alloc.block_table("b")
    refused = alloc.append("b", [1])
    assert not refused and refused.needed == 1 and refused.free == 0
    assert alloc.block_table("b") == before and alloc.seq_len("b") == 12
    assert alloc.invariants() == []


def test_copy_on_write_counts_toward_room():
    alloc = BlockAllocator(2, block_size=4)
    alloc.allocate("p", [1, 2])
    alloc.fork("p", "c")
    assert alloc.blocks_needed_to_append("c", 1) == 1
    alloc.allocate("x", [3])
    assert not alloc.append("c", [4])
    assert alloc.invariants() == []


def test_prefix_blocks_are_cached_reused_and_evicted_lru():
    alloc = BlockAllocator(4, block_size=4)
    alloc.allocate("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # blocks 0, 1 full; block 2 partial
    alloc.commit("a", 9)
    alloc.free("a")
    assert alloc.num_evictable == 2 and alloc.num_free == 4

    hit = alloc.allocate("b", [1, 2, 3, 4, 5, 6, 7, 8, 10])
    alloc.commit("b", 9)
    assert hit.num_cached_tokens == 8
    assert alloc.block_table("b") == [0, 1, 2]
    assert hit.slots == [8]
    assert refs(alloc) == [1, 1, 1, 0]

    partial = alloc.allocate("c", [1, 2, 3, 4, 0, 0, 0, 0])  # only the first block matches
    alloc.commit("c", 8)
    assert partial.num_cached_tokens == 4
    assert alloc.block_table("c") == [0, 3]
    assert refs(alloc) == [2, 1, 1, 1]
    alloc.free("b")
    alloc.free("c")
    # Freed tail first: LRU order is b's block 1, then c's block 3, then block 0.
    assert list(alloc._evictable) == [1, 3, 0]
    alloc.allocate("d", list(range(100, 108)))  # needs 2 blocks: free block 2, then evicts 1
    assert alloc.block_table("d") == [2, 1]
    assert alloc.num_evictable == 2
    assert alloc.invariants() == []


def test_hash_collision_is_caught_by_token_check(monkeypatch):
    monkeypatch.setattr(block_allocator, "chain_hash", lambda prev, tokens: 42)
    alloc = BlockAllocator(4, block_size=2)
    alloc.allocate("a", [1, 2])
    alloc.commit("a", 2)
    alloc.free("a")
    result = alloc.allocate("b", [3, 4])
    assert result.num_cached_tokens == 0
    assert alloc.block_table("b") == [1]
    assert alloc.invariants() == []


def test_compaction_moves_fewest_blocks_and_remaps_tables():
    alloc = BlockAllocator(12, block_size=4, enable_prefix_caching=False)
    alloc.allocate("a", [0] * 4)  # [0]
    alloc.allocate("b", [0] * 4)  # [1]
    alloc.allocate("c", [0] * 8)  # [2, 3]
    alloc.allocate("d", [0] * 4)  # [4]
    alloc.free("a")
    alloc.free("c")
    assert alloc.high_water_mark == 5
    assert alloc.fragmentation == pytest.approx(3 / 5)
    moves = alloc.plan_compaction()
    assert moves == {4: 0}
    assert alloc.block_table("b") == [1] and alloc.block_table("d") == [0]
    assert alloc.high_water_mark == 2 and alloc.fragmentation == 0.0
    assert alloc.invariants() == []
    assert alloc.plan_compaction() == {}


def test_compaction_remaps_prefix_hash_entries():
    alloc = BlockAllocator(8, block_size=4)
    alloc.allocate("a", [9, 9, 9])  # partial: not cached
    alloc.allocate("b", [1, 1, 1, 1])
    alloc.allocate("c", [2, 2, 2, 2])
    alloc.commit("c", 4)
    alloc.free("a")  # block 0 free
    alloc.free("c")  # block 2 evictable
    assert alloc.plan_compaction() == {2: 0}
    assert list(alloc._evictable) == [0]
    assert alloc.invariants() == []
    hit = alloc.allocate("d", [2, 2, 2, 2, 3])
    assert hit.num_cached_tokens == 4 and alloc.block_table("d") == [0, 2]


def test_grow_and_shrink_capacity():
    alloc = BlockAllocator(4, block_size=4)
    alloc.grow(4)
    assert alloc.num_blocks == 8 and alloc.num_free == 8
    alloc.allocate("a", [0] * 8)
    alloc.commit("a", 8)
    alloc.free("a")  # two evictable blocks at ids 0, 1
    alloc.allocate("b", [1] * 20)  # ids 2..6
    with pytest.raises(ValueError, match="still in use; compact first"):
        alloc.shrink(4)
    alloc.free("b")
    alloc.shrink(6)
    assert alloc.num_blocks == 2 and alloc.invariants() == []


def test_bad_sequence_ids_are_clear_errors():
    alloc = BlockAllocator(4, block_size=4)
    alloc.allocate("a", [1])
    with pytest.raises(ValueError, match="seq_id='a' is already allocated"):
        alloc.allocate("a", [1])
    with pytest.raises(KeyError, match="seq_id='zz' is not allocated"):
        alloc.append("zz", [1])
    with pytest.raises(ValueError, match="child_id='a' is already allocated"):
        alloc.fork("a", "a")
    with pytest.raises(KeyError, match="seq_id='zz' is not allocated"):
        alloc.free("zz")


def test_blocks_are_offered_to_other_prompts_only_once_computed():
    alloc = BlockAllocator(12, block_size=4)
    alloc.allocate("a", list(range(12)))  # a prompt whose K/V is not computed yet
    early = alloc.allocate("b", list(range(12)) + [99])
    assert early.num_cached_tokens == 0  # nothing to reuse before it is written
    alloc.commit("a", 6)  # chunked prefill: the first block is written
    late = alloc.allocate("c", list(range(12)) + [99])
    assert late.num_cached_tokens == 4 and alloc.block_table("c")[0] == alloc.block_table("a")[0]
    alloc.free("a")  # blocks 1, 2 of "a" were never written: they must not stay cached
    assert alloc.num_evictable == 0
    assert alloc.invariants() == []


@pytest.mark.parametrize("length", [5, 7, 8, 9, 12])
def test_a_replaced_placeholder_hashes_like_the_real_token(length):
    """Async scheduling appends -1 for a token still on the device and replaces it once known:
    partial or full, the last block must end up exactly as if the real token had been appended."""
    tokens = list(range(100, 100 + length))
    direct, placed = BlockAllocator(12, block_size=4), BlockAllocator(12, block_size=4)
    direct.allocate("s", tokens[:-1])
    direct.append("s", tokens[-1:])
    placed.allocate("s", tokens[:-1])
    placed.append("s", [-1])
    placed.replace_token("s", length - 1, tokens[-1])
    for alloc in (direct, placed):
        alloc.append("s", [7, 8, 9, 10])  # the chain continues from the replaced block
        alloc.commit("s", length + 4)
    assert [(b.hash, b.token_ids) for b in placed.blocks] == [(b.hash, b.token_ids) for b in direct.blocks]
    assert placed._hash_to_block == direct._hash_to_block
    assert placed.invariants() == [] and direct.invariants() == []
    hit = placed.allocate("t", tokens + [7, 8, 9, 10, 11])
    assert hit.num_cached_tokens == (length + 4) // 4 * 4  # the replaced block serves other prompts


def test_only_an_uncommitted_last_block_takes_a_replacement():
    alloc = BlockAllocator(12, block_size=4)
    alloc.allocate("s", [1, 2, 3, 4, 5, -1])
    with pytest.raises(ValueError, match="position 3 is not in the last block of seq 's' \\(6 tokens\\)"):
        alloc.replace_token("s", 3, 9)
    alloc.replace_token("s", 5, 6)
    alloc.append("s", [7, -1])  # the placeholder fills block 1
    alloc.commit("s", 8)
    with pytest.raises(ValueError, match="block 1 of seq 's' is already offered to the prefix cache"):
        alloc.replace_token("s", 7, 8)


def test_a_committed_placeholder_is_an_invariant_violation():
    alloc = BlockAllocator(12, block_size=4)
    alloc.allocate("s", [1, 2, 3, -1])
    alloc.commit("s", 4)  # the engine must replace placeholders first
    assert any("holds a negative token id" in p for p in alloc.invariants())


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 5), min_size=2, max_size=40), data=st.data())
def test_decoding_through_placeholders_equals_decoding_real_tokens(tokens, data):
    """The engine's pattern: each new token enters as a placeholder, is replaced once read back,
    and only then may commit() cover its block. Few distinct ids, so blocks repeat and hit."""
    direct, placed = BlockAllocator(16, block_size=4), BlockAllocator(16, block_size=4)
    for alloc in (direct, placed):
        alloc.allocate("s", tokens[:1])
    for position, token in enumerate(tokens[1:], start=1):
        direct.append("s", [token])
        placed.append("s", [-1])
        placed.replace_token("s", position, token)
        if data.draw(st.booleans()):
            for alloc in (direct, placed):
                alloc.commit("s", position + 1)
        assert placed.invariants() == []
    assert [(b.hash, b.token_ids) for b in placed.blocks] == [(b.hash, b.token_ids) for b in direct.blocks]
    assert placed._hash_to_block == direct._hash_to_block
    for alloc in (direct, placed):
        alloc.free("s")
    assert placed.allocate("t", tokens).num_cached_tokens == direct.allocate("t", tokens).num_cached_tokens


@settings(max_examples=60, deadline=None)
@given(block_size=st.sampled_from([1, 3, 4, 16]), pieces=st.lists(st.integers(1, 40), min_size=1, max_size=8),
       data=st.data())
def test_slots_come_block_by_block_as_each_token_would_find_them(block_size, pieces, data):
    """_extend and slots() place a block's worth of tokens at a time; every slot is where slot() puts
    its position, and the hashes match placing the same tokens one at a time."""
    whole = BlockAllocator(400, block_size=block_size)  # room for 8 x 40 tokens in blocks of 1
    one_by_one = BlockAllocator(400, block_size=block_size)
    tokens = list(range(1000, 1000 + sum(pieces)))
    got = whole.allocate("a", tokens[: pieces[0]]).slots
    one_by_one.allocate("a", tokens[:1])
    for token in tokens[1 : pieces[0]]:
        one_by_one.append("a", [token])
    done = pieces[0]
    for piece in pieces[1:]:
        got += whole.append("a", tokens[done : done + piece]).slots
        for token in tokens[done : done + piece]:
            one_by_one.append("a", [token])
        done += piece
    assert got == [whole.slot("a", p) for p in range(done)]
    start = data.draw(st.integers(0, done))
    stop = data.draw(st.integers(start, done))
    assert whole.slots("a", start, stop) == [whole.slot("a", p) for p in range(start, stop)]
    assert whole.block_table("a") == one_by_one.block_table("a")
    whole.commit("a", done)
    one_by_one.commit("a", done)
    assert [b.hash for b in whole.blocks] == [b.hash for b in one_by_one.blocks]
    assert whole.invariants() == [] and one_by_one.invariants() == []
