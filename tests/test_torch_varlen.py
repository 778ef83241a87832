"""The unpadded torch path of paged attention (torch_varlen.py): exact against fp64, and its size.

Mixed rows (decode rows, chunks with context, chunks that start their sequence, empty rows) go
through paged_attention_varlen with PONYTAIL_KERNELS=torch, as the CPU engine runs them, and
are compared with test_paged_attention's naive per-row fp64 attention. The size test records
every tensor the path builds (a TorchDispatchMode) for the step issue 14 describes: one
2k-token chunk with context beside 31 decode rows.
"""

from __future__ import annotations

import itertools
import math
import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from ponytail.attention.paged import paged_attention_varlen
from ponytail.attention.torch_varlen import decode_width, plan_torch_attention
from cache_machine import kernels
from test_paged_attention import TOLERANCE, Batch, naive_attention, rel_error


def packed_reference(batch: Batch, query: torch.Tensor, counts: list[int], scale: float,
                     window: int | None = None) -> torch.Tensor:
    """Packed [N, Hq, D] queries -> the naive fp64 attention, packed the same way."""
    outs = []
    start = 0
    for b, count in enumerate(counts):
        q = query[start : start + count].transpose(0, 1)[None]  # [1, Hq, count, D]
        one = Batch.__new__(Batch)
        one.lengths, one.keys, one.values = [batch.lengths[b]], [batch.keys[b]], [batch.values[b]]
        outs.append(naive_attention(one, 1, q, None, scale, window)[0].transpose(0, 1))
        start += count
    return torch.cat(outs)


def run_varlen(batch: Batch, counts: list[int], heads: int, seed: int = 3, window: int | None = None):
    head_dim = batch.cache.config.head_dim
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(sum(counts), heads, head_dim, generator=gen)
    cu = torch.tensor([0] + list(itertools.accumulate(counts)), dtype=torch.int32)
    scale = 1 / math.sqrt(head_dim)
    with kernels("torch"):
        out = paged_attention_varlen(batch.storage, 1, query, cu, max(max(counts), 1), batch.block_tables,
                                     batch.seq_lens, scale, sliding_window=window)
    return out, packed_reference(batch, query, counts, scale, window)


def test_mixed_step_matches_fp64():
    # Decode rows of varied lengths (several groups), a chunk with context, a chunk that starts its
    # sequence, a one-token chunk with context, and an empty row with no query tokens.
    lengths = [3, 17, 16, 250, 40, 90, 33, 1, 64]
    counts = [1, 1, 1, 1, 25, 90, 1, 1, 0]
    batch = Batch(lengths, kv_heads=3, head_dim=64, block_size=16, seed=4)
    out, ref = run_varlen(batch, counts, heads=9)
    assert out.shape == ref.shape
    assert rel_error(out, ref) < TOLERANCE[torch.float32]


@settings(max_examples=15, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(1, 120), st.integers(0, 3)), min_size=1, max_size=7),
       kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]),
       block_size=st.sampled_from([4, 16]), seed=st.integers(0, 1000))
def test_random_mixed_steps_match_fp64(rows, kv_heads, group, block_size, seed):
    rng = random.Random(seed)
    lengths = [n for n, _ in rows]
    # kind 0: decode, 1: chunk with context, 2: whole sequence, 3: no query tokens
    counts = [[1, rng.randint(1, n), n, 0][kind] for n, kind in rows]
    if not any(counts):
        counts[0] = 1
    batch = Batch(lengths, kv_heads=kv_heads, head_dim=64, block_size=block_size, chunk_blocks=3, seed=seed)
    out, ref = run_varlen(batch, counts, heads=kv_heads * group, seed=seed)
    assert rel_error(out, ref) < TOLERANCE[torch.float32]


@settings(max_examples=25, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(1, 120), st.integers(0, 3)), min_size=1, max_size=7),
       window=st.integers(1, 130), block_size=st.sampled_from([4, 16]), seed=st.integers(0, 1000))
def test_random_mixed_steps_in_a_sliding_window_match_fp64(rows, window, block_size, seed):
    """Windows narrower and wider than the rows, ending mid-block and on a block's edge: each
    query sees exactly the last `window` positions up to its own."""
    rng = random.Random(seed)
    lengths = [n for n, _ in rows]
    counts = [[1, rng.randint(1, n), n, 0][kind] for n, kind in rows]
    if not any(counts):
        counts[0] = 1
    batch = Batch(lengths, kv_heads=2, head_dim=64, block_size=block_size, chunk_blocks=3, seed=seed)
    out, ref = run_varlen(batch, counts, heads=6, seed=seed, window=window)
    assert rel_error(out, ref) < TOLERANCE[torch.float32]


def test_a_sliding_window_gathers_only_the_blocks_its_queries_see():
    batch = Batch([200, 37, 64], kv_heads=1, head_dim=64, block_size=16, seed=5)
    tables = [batch.cache.block_table(r) for r in range(3)]
    whole = plan_torch_attention(batch.storage, [1, 37, 10], [200, 37, 64], tables)
    narrow = plan_torch_attention(batch.storage, [1, 37, 10], [200, 37, 64], tables, window=20)
    # decode row: positions 180..199 -> blocks 11, 12 (2 of 13, which pad to 16 without a window);
    # the 37-token chunk starts its sequence: all 3 blocks; the 10-token chunk's first query
    # (position 54) sees 35..54 -> blocks 2, 3.
    assert (whole.num_blocks, narrow.num_blocks) == (16 + 3 + 4, 2 + 3 + 2)
    assert narrow.decode[0].mask.sum().item() == 20
    assert narrow.chunks[1].mask.shape == (10, 64 - 32) and narrow.chunks[1].mask.sum(dim=1).tolist() == [20] * 10


def test_decode_widths_depend_on_the_row_alone_and_waste_at_most_a_third():
    widths = [decode_width(n, 16) // 16 for n in (1, 16, 17, 33, 49, 65, 97, 129, 2000)]
    assert widths == [1, 1, 2, 3, 4, 6, 8, 12, 128]
    for n in range(1, 5000, 7):
        width = decode_width(n, 16)
        assert width % 16 == 0 and n <= width and width - 16 * -(-n // 16) <= width // 3 + 16


def test_a_decode_rows_result_does_not_depend_on_the_rows_beside_it():
    """The sync and async engines batch the same row with different neighbours: bit for bit on one
    thread; with more, the batched GEMMs may split a row's sums differently for another batch
    (last-place differences, 9e-8 on a 2-thread AMD EPYC), so within float32 rounding there."""
    batch = Batch([70, 75, 300, 12, 71], kv_heads=2, head_dim=64, block_size=16, seed=9)
    query = torch.randn(5, 6, 64, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    try:
        for num_threads in sorted({1, threads}):
            torch.set_num_threads(num_threads)
            with kernels("torch"):
                together = paged_attention_varlen(batch.storage, 1, query, torch.arange(6, dtype=torch.int32), 1,
                                                  batch.block_tables, batch.seq_lens, 0.125)
                for rows in ([0], [0, 1], [0, 2, 4]):
                    alone = paged_attention_varlen(batch.storage, 1, query[rows],
                                                   torch.arange(len(rows) + 1, dtype=torch.int32), 1,
                                                   batch.block_tables[rows], batch.seq_lens[rows], 0.125)
                    if num_threads == 1:
                        assert torch.equal(alone, together[rows])
                    else:
                        torch.testing.assert_close(alone, together[rows], rtol=1e-5, atol=1e-6)
    finally:
        torch.set_num_threads(threads)


class ShapeRecorder(TorchDispatchMode):
    """Every new tensor (fresh memory, not a view or an in-place result) an op returns while active."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def test_2k_chunk_with_context_beside_31_decode_rows_builds_tokens_times_context():
    """Issue 14's step: the padded fallback built [32 rows, 9 heads, 2048, 2560] fp32 scores (6 GB);
    the torch path may build nothing larger than one row's tokens x its context, and all of it
    together stays within a small multiple of the step's tokens x context."""
    rng = random.Random(14)
    decode = [rng.randint(20, 400) for _ in range(31)]
    context, chunk = 512, 2048
    lengths = decode + [context + chunk]
    counts = [1] * 31 + [chunk]
    heads, kv_heads, head_dim = 9, 3, 64  # the default model's attention
    batch = Batch(lengths, kv_heads=kv_heads, head_dim=head_dim, block_size=16, chunk_blocks=64, seed=14)
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(sum(counts), heads, head_dim, generator=gen)
    cu = torch.tensor([0] + list(itertools.accumulate(counts)), dtype=torch.int32)
    recorder = ShapeRecorder()
    with kernels("torch"), recorder:
        out = paged_attention_varlen(batch.storage, 1, query, cu, chunk, batch.block_tables, batch.seq_lens, 0.125)

    tokens_x_context = sum(c * n for c, n in zip(counts, lengths))  # 2048 * 2560 + the decode rows' lengths
    kv_elems = 2 * sum(lengths) * kv_heads * head_dim * 2  # K and V gathered, decode rows padded 2x at most
    padded_scores = len(lengths) * heads * chunk * max(lengths)
    largest = max(math.prod(shape) for _, shape in recorder.shapes)
    total = sum(math.prod(shape) for _, shape in recorder.shapes)
    assert largest <= max(tokens_x_context, kv_elems), sorted(recorder.shapes, key=lambda s: -math.prod(s[1]))[:5]
    assert total <= 4 * (tokens_x_context + kv_elems + query.numel())
    assert 50 * total < padded_scores  # what the padded path's scores alone held
    # No tensor spans every row at the longest row's length.
    assert not any(len(shape) >= 3 and shape[0] == len(lengths) and max(lengths) in shape
                   for _, shape in recorder.shapes)
    # And it is right: a few decode rows, and the chunk's first and last 16 tokens (a row cut at
    # their last position holds the same keys), against fp64.
    starts = [0] + list(itertools.accumulate(counts))
    pieces = [(b, starts[b], starts[b] + 1, lengths[b]) for b in (0, 7, 30)]
    pieces += [(31, starts[31], starts[31] + 16, context + 16), (31, starts[32] - 16, starts[32], context + chunk)]
    sub = Batch.__new__(Batch)
    sub.lengths = [n for *_, n in pieces]
    sub.keys = [batch.keys[b][:, :n] for b, _, _, n in pieces]
    sub.values = [batch.values[b][:, :n] for b, _, _, n in pieces]
    got = torch.cat([out[a:e] for _, a, e, _ in pieces])
    ref = packed_reference(sub, torch.cat([query[a:e] for _, a, e, _ in pieces]), [e - a for _, a, e, _ in pieces],
                           0.125)
    assert rel_error(got, ref) < TOLERANCE[torch.float32]


def test_plan_is_built_from_host_lists_and_keeps_rows_apart():
    batch = Batch([40, 10, 33], kv_heads=1, head_dim=64, block_size=16, chunk_blocks=2, seed=2)
    tables = batch.block_tables.tolist()
    plan = plan_torch_attention(batch.storage, [1, 10, 5], [40, 10, 33], tables)
    assert plan.num_tokens == 16
    assert [g.rows.tolist() for g in plan.decode] == [[0]]
    assert [(c.query_start, c.tokens, c.length, c.mask is None) for c in plan.chunks] == [(1, 10, 10, True),
                                                                                       (11, 5, 33, False)]
    assert plan.chunks[1].mask.shape == (5, 33)
    assert plan.num_blocks == 3 + 1 + 3  # each row's own blocks, no padding for one decode row


def test_slot_writes_match_write_slots_across_chunks_and_skip_padding():
    from ponytail import CacheConfig, PagedKVCache
    from ponytail.attention.torch_varlen import SlotWrites
    from ponytail.kv.cache_ops import write_slots

    config = CacheConfig(num_layers=3, num_kv_heads=2, head_dim=64, dtype=torch.float32, max_batch_size=1,
                         max_seq_len=16 * 4 * 3, block_size=4, chunk_blocks=4, device="cpu")
    ours, theirs = PagedKVCache(config), PagedKVCache(config)
    for cache in (ours, theirs):
        cache.grow(3)
        for chunk in cache.storage.chunks:
            chunk.zero_()
    gen = torch.Generator().manual_seed(0)
    for slots in ([5, 17, 40, -1, 3, 33], [9, 10, 11], [-1, -1]):  # chunks of 16 slots: several, one, none
        mapping = torch.tensor(slots)
        keys = torch.randn(3, len(slots), 2, 64, generator=gen)
        values = torch.randn(3, len(slots), 2, 64, generator=gen)
        writes = SlotWrites(ours.storage, mapping)
        for layer in range(3):
            writes.write(layer, keys[layer], values[layer])
        write_slots(theirs.storage, keys, values, mapping)
        for a, b in zip(ours.storage.chunks, theirs.storage.chunks):
            assert torch.equal(a, b)
