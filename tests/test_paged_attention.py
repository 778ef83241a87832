"""paged_attention's torch fallback against a naive per-row fp64 attention, and its argument checks.

Rows grow by appends in turn, so their blocks interleave and spread over several small chunks.
"""

from __future__ import annotations

import itertools
import logging
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ponytail import CacheConfig, KernelError, PagedKVCache
from ponytail.kernels import loader as kernel_loader
from ponytail.attention import decode
from ponytail.attention.decode import decode_choice, plan_splits
from ponytail.attention.paged import paged_attention, paged_attention_varlen
from cache_machine import kernels

LAYERS = 2


class Batch:
    """A cache holding `lengths` tokens per row, with the K/V written kept for the reference."""

    def __init__(self, lengths, kv_heads, head_dim, dtype=torch.float32, block_size=16,
                 chunk_blocks=4, seed=0, device="cpu", table_pad=1):
        gen = torch.Generator().manual_seed(seed)
        needed = sum(-(-n // block_size) for n in lengths)
        total_blocks = (-(-needed // chunk_blocks) + 1) * chunk_blocks
        config = CacheConfig(num_layers=LAYERS, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                             max_batch_size=1, max_seq_len=total_blocks * block_size,
                             block_size=block_size, chunk_blocks=chunk_blocks, device=device)
        self.cache = PagedKVCache(config)
        self.lengths = list(lengths)
        self.keys = [torch.randn(LAYERS, n, kv_heads, head_dim, generator=gen).to(dtype) for n in lengths]
        self.values = [torch.randn(LAYERS, n, kv_heads, head_dim, generator=gen).to(dtype) for n in lengths]
        written = [0] * len(lengths)
        for row in range(len(lengths)):
            assert self.cache.allocate(row, [])
        # Round-robin appends of random sizes: every row's blocks interleave with the others'.
        rng = random.Random(seed)
        while any(w < n for w, n in zip(written, lengths)):
            for row, n in enumerate(lengths):
                take = min(n - written[row], rng.randint(1, 3 * block_size))
                if take <= 0:
                    continue
                result = self.cache.append(row, [row * 100_000 + written[row] + i for i in range(take)])
                assert result
                part = slice(written[row], written[row] + take)
                self.cache.write(self.keys[row][:, part].to(device), self.values[row][:, part].to(device),
                                 result.slots)
                written[row] += take
        width = max([len(self.cache.block_table(r)) for r in range(len(lengths))] + [0]) + table_pad
        self.block_tables = torch.full((len(lengths), width), -1, dtype=torch.int32)
        for row in range(len(lengths)):
            table = self.cache.block_table(row)
            self.block_tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
        self.block_tables = self.block_tables.to(device)
        self.seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)

    @property
    def storage(self):
        return self.cache.storage


def naive_attention(batch: Batch, layer, query, query_lens, scale, window=None) -> torch.Tensor:
    """One row and one query position at a time, fp64, explicit softmax; window: the last that many
    positions up to the query's own."""
    rows, heads, positions, head_dim = query.shape
    kv_heads = batch.keys[0].shape[2] if batch.keys else 1
    group = heads // kv_heads
    out = torch.zeros(rows, heads, positions, head_dim, dtype=torch.float64)
    for b in range(rows):
        n = batch.lengths[b]
        real = positions if query_lens is None else int(query_lens[b])
        keys = batch.keys[b][layer].double().repeat_interleave(group, dim=1)  # [n, Hq, D]
        values = batch.values[b][layer].double().repeat_interleave(group, dim=1)
        for j in range(positions - real, positions):
            pos = n - positions + j
            if pos < 0:
                continue
            q = query[b, :, j].double().cpu()  # [Hq, D]
            seen = slice(0 if window is None else max(0, pos + 1 - window), pos + 1)
            scores = torch.einsum("lhd,hd->hl", keys[seen], q) * scale
            weights = torch.exp(scores - scores.max(dim=1, keepdim=True).values)
            weights = weights / weights.sum(dim=1, keepdim=True)
            out[b, :, j] = torch.einsum("hl,lhd->hd", weights, values[seen])
    return out


def rel_error(out, ref) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def check(batch: Batch, heads, positions, query_lens=None, layer=1, dtype=torch.float32, seed=1, window=None):
    gen = torch.Generator().manual_seed(seed)
    head_dim = batch.cache.config.head_dim
    query = torch.randn(len(batch.lengths), heads, positions, head_dim, generator=gen).to(dtype)
    scale = 1 / math.sqrt(head_dim)
    with kernels("torch"):
        out = paged_attention(batch.storage, layer, query, batch.block_tables, batch.seq_lens,
                              query_lens, scale, sliding_window=window)
    ref = naive_attention(batch, layer, query, query_lens, scale, window)
    assert out.shape == query.shape and out.dtype == dtype
    err = rel_error(out, ref)
    assert err < TOLERANCE[dtype], f"relative error {err:.2e} (shape {tuple(query.shape)})"
    return out


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_decode_matches_naive_for_every_head_size_and_gqa_ratio(group, head_dim):
    batch = Batch([1, 15, 16, 17, 200], kv_heads=2, head_dim=head_dim, seed=group * 1000 + head_dim)
    check(batch, heads=2 * group, positions=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_long_rows_across_many_chunks(dtype):
    batch = Batch([2048, 1000, 33], kv_heads=1, head_dim=64, dtype=dtype, chunk_blocks=8, seed=3)
    assert batch.cache.num_chunks >= 8
    chunks = {b // batch.storage.chunk_blocks for b in batch.cache.block_table(0)}
    assert len(chunks) >= 4, "row 0's blocks should spread over several chunks"
    check(batch, heads=4, positions=1, dtype=dtype)
    check(batch, heads=4, positions=5, dtype=dtype)


@pytest.mark.parametrize("positions", [2, 7, 16, 40])
def test_prefill_with_context_is_causal(positions):
    batch = Batch([40, 57, 100, 45], kv_heads=2, head_dim=64, block_size=8, seed=positions)
    check(batch, heads=8, positions=positions)


@pytest.mark.parametrize("window", [1, 5, 8, 33, 1000])
@pytest.mark.parametrize("positions", [1, 7])
def test_a_sliding_window_sees_the_last_window_positions_with_left_padding(window, positions):
    batch = Batch([9, 30, 64, 5], kv_heads=2, head_dim=64, block_size=4, seed=window)
    query_lens = torch.tensor([3, 7, 1, 0], dtype=torch.int32) if positions > 1 else None
    check(batch, heads=6, positions=positions, query_lens=query_lens, window=window)


@pytest.mark.parametrize("window", [0, -3, 2.5, True, "64"])
def test_a_sliding_window_must_be_a_positive_int(small, window):
    with pytest.raises(KernelError, match=rf"sliding_window={window!r} must be None or a positive int"):
        paged_attention(small.storage, 0, torch.randn(2, 4, 1, 64), small.block_tables, small.seq_lens, None,
                        0.125, sliding_window=window)


def test_left_padding_gives_zeros_and_real_positions_match():
    batch = Batch([9, 30, 64, 5], kv_heads=2, head_dim=64, block_size=4, seed=7)
    query_lens = torch.tensor([3, 8, 1, 0], dtype=torch.int32)
    out = check(batch, heads=6, positions=8, query_lens=query_lens)
    assert torch.all(out[0, :, :5] == 0) and torch.all(out[2, :, :7] == 0) and torch.all(out[3] == 0)
    assert torch.all(out[0, :, 5:].abs().sum(-1) > 0)


def test_decode_padding_rows_and_empty_rows_are_zero():
    batch = Batch([0, 20, 0, 3], kv_heads=1, head_dim=64, seed=8)
    out = check(batch, heads=1, positions=1, query_lens=torch.tensor([0, 1, 1, 0], dtype=torch.int32))
    assert torch.all(out[[0, 2, 3]] == 0) and torch.all(out[1] != 0)


def test_each_real_position_attends_up_to_itself():
    """A query equal to one cached key, scaled up, attends almost only to it, if it can see it."""
    batch = Batch([12], kv_heads=1, head_dim=64, block_size=4, seed=9)
    keys, values = batch.keys[0][0], batch.values[0][0]
    query = torch.zeros(1, 1, 4, 64)
    query[0, 0, :] = keys[[8, 9, 10, 11], 0] * 50  # position j of 4 sits at cache position 8 + j
    with kernels("torch"):
        out = paged_attention(batch.storage, 0, query, batch.block_tables, batch.seq_lens, None, 1.0)
    torch.testing.assert_close(out[0, 0], values[[8, 9, 10, 11], 0], atol=1e-3, rtol=1e-3)


def test_garbage_past_the_end_of_a_block_never_leaks():
    batch = Batch([5, 21], kv_heads=1, head_dim=64, block_size=8, seed=10)
    for chunk in batch.storage.chunks:  # poison everything, then rewrite the real tokens
        chunk.fill_(float("nan"))
    for row, n in enumerate(batch.lengths):
        table = batch.cache.block_table(row)
        slots = [table[t // 8] * 8 + t % 8 for t in range(n)]
        batch.cache.write(batch.keys[row], batch.values[row], slots)
    out = check(batch, heads=2, positions=3)
    assert not torch.isnan(out).any()


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(0, 200), min_size=1, max_size=4), group=st.sampled_from([1, 2, 3, 4, 8]),
       kv_heads=st.integers(1, 3), block_size=st.sampled_from([1, 4, 16, 32]),
       positions=st.integers(1, 6), pad=st.booleans(), seed=st.integers(0, 2**16))
def test_random_shapes_match_naive(lengths, group, kv_heads, block_size, positions, pad, seed):
    batch = Batch(lengths, kv_heads=kv_heads, head_dim=64, block_size=block_size, seed=seed,
                  chunk_blocks=max(1, 64 // block_size))
    rng = random.Random(seed)
    real = [min(n, rng.randint(0, positions)) if pad else min(n, positions) for n in lengths]
    if not pad:  # all positions real: each row needs at least T tokens, or is an empty row
        batch_ok = all(n == 0 or n >= positions for n in lengths)
        if not batch_ok:
            return
    query_lens = torch.tensor(real, dtype=torch.int32) if pad else None
    check(batch, heads=kv_heads * group, positions=positions, query_lens=query_lens, layer=seed % LAYERS)


def test_split_plan_covers_the_table_and_fills_the_waves():
    for base, tokens, block in [(2048, 4096, 16), (512, 4096, 16), (32, 32768, 16), (4, 100, 1), (7, 0, 16),
                                (1, 1 << 20, 16)]:
        splits, split_tokens = plan_splits(base, tokens, block, resident_ctas=396)
        assert split_tokens % block == 0 and splits * split_tokens >= tokens
        assert (splits - 1) * split_tokens < max(tokens, 1)
        assert split_tokens <= 512 * block  # the block table fits shared memory
    # A batch that fills the GPU exactly once is not split; a small one is split to fill it.
    assert plan_splits(396, 4096, 16, resident_ctas=396) == (1, 4096)
    splits, _ = plan_splits(4, 32768, 16, resident_ctas=396)
    assert 4 * splits <= 396 < 4 * 2 * splits  # one wave: twice the splits would take two


def test_split_plan_with_power_of_two_counts_only():
    for base, tokens, block in [(2048, 16384, 16), (128, 32768, 16), (512, 4096, 16), (32, 2048, 16),
                                (7, 0, 16), (1, 1 << 20, 16), (4, 100, 1), (2048, 40000, 16), (64, 1500, 16),
                                (3, 1000, 16)]:
        splits, split_tokens = plan_splits(base, tokens, block, resident_ctas=396)
        assert splits & (splits - 1) == 0, (base, tokens, splits)
        assert split_tokens % block == 0 and splits * split_tokens >= tokens
        assert (splits - 1) * split_tokens < max(tokens, 1)
        assert split_tokens <= 512 * block
    # Any count would take 5 splits of 3,280 tokens here; powers of two take 4 of 4,096.
    assert plan_splits(2048, 16384, 16, resident_ctas=396) == (4, 4096)
    # 192 rows of a 7B (MHA: 32 CTAs a row) over an 8k table on 528 resident CTAs: any count would take 3
    assert plan_splits(192 * 32, 8192, 16, resident_ctas=528) == (1, 8192)


# ------------------------------------------------------------------------------------- varlen
def pack(query, counts):
    """[B, Hq, T, D] right-aligned rows -> the engine's packed [N, Hq, D] and cu_seq_q."""
    positions = query.shape[2]
    parts = [query[b, :, positions - n :].transpose(0, 1) for b, n in enumerate(counts)]
    cu = torch.tensor([0] + list(itertools.accumulate(counts)), dtype=torch.int32)
    return torch.cat(parts), cu


@pytest.mark.parametrize("counts", [[1, 1, 1], [5, 1, 17], [0, 9, 3], [16, 16, 16]])
def test_varlen_matches_naive_row_by_row(counts):
    batch = Batch([20, 45, 17], kv_heads=2, head_dim=64, block_size=8, seed=sum(counts))
    width = max(counts)
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(3, 6, width, 64, generator=gen)
    packed, cu = pack(query, counts)
    with kernels("torch"):
        out = paged_attention_varlen(batch.storage, 1, packed, cu, width, batch.block_tables, batch.seq_lens, 0.125)
    query_lens = torch.tensor(counts, dtype=torch.int32)
    ref, _ = pack(naive_attention(batch, 1, query, query_lens, 0.125), counts)
    assert out.shape == packed.shape
    assert rel_error(out, ref) < TOLERANCE[torch.float32]
    step = torch.full((2 + packed.shape[0], *packed.shape[1:]), float("nan"))  # 2 decode rows first
    with kernels("torch"):
        into = paged_attention_varlen(batch.storage, 1, packed, cu, width, batch.block_tables, batch.seq_lens, 0.125,
                                      out=step[2:])
    assert into.data_ptr() == step[2:].data_ptr() and torch.equal(step[2:], out) and torch.isnan(step[:2]).all()


@pytest.mark.parametrize("change, message", [
    (dict(query=torch.randn(2, 4, 1, 64)), r"query must be \[tokens, query heads, head_dim\]"),
    (dict(cu=torch.tensor([0, 3, 4])), r"cu_seq_q must be int32 \[batch \+ 1 = 3\]"),
    (dict(cu=torch.tensor([0, 3], dtype=torch.int32)), r"cu_seq_q must be int32 \[batch \+ 1 = 3\]"),
    (dict(cu=torch.tensor([0, 3, 5], dtype=torch.int32)), r"must rise from 0 to the 4 query tokens"),
    (dict(cu=torch.tensor([0, 5, 4], dtype=torch.int32)), r"must rise from 0 to the 4 query tokens"),
    (dict(width=2), r"a row has 3 query tokens, more than max_query_len=2"),
    (dict(width=0), r"max_query_len=0 must be a positive int"),
    (dict(query=torch.randn(4, 3, 64)), "3 heads, not a positive multiple of the cache's 2 KV heads"),
])
def test_varlen_bad_arguments_raise_clear_errors(small, change, message):
    query = change.get("query", torch.randn(4, 4, 64))
    cu = change.get("cu", torch.tensor([0, 3, 4], dtype=torch.int32))
    with pytest.raises(KernelError, match=message):
        paged_attention_varlen(small.storage, 0, query, cu, change.get("width", 3), small.block_tables,
                               small.seq_lens, 0.125)


# ------------------------------------------------------------------------------------- errors
@pytest.fixture
def small():
    return Batch([10, 20], kv_heads=2, head_dim=64, seed=11)


def call(batch, query=None, layer=0, tables=None, seq_lens=None, query_lens=None, scale=0.125):
    query = torch.randn(2, 4, 1, 64) if query is None else query
    return paged_attention(batch.storage, layer, query,
                           batch.block_tables if tables is None else tables,
                           batch.seq_lens if seq_lens is None else seq_lens, query_lens, scale)


@pytest.mark.parametrize("kwargs, message", [
    (dict(query=torch.randn(2, 3, 1, 64)), "3 heads, not a positive multiple of the cache's 2 KV heads"),
    (dict(query=torch.randn(2, 4, 1, 32)), "head_dim 32 does not match the cache's head_dim 64"),
    (dict(query=torch.randn(2, 4, 1, 64, dtype=torch.float64)), "dtype torch.float64 does not match"),
    (dict(query=torch.randn(2, 4, 64)), r"query must be \[batch, query heads, positions, head_dim\]"),
    (dict(query=torch.randn(2, 4, 0, 64)), "0 positions"),
    (dict(layer=2), "layer=2 is outside the cache's 2 layers"),
    (dict(tables=torch.zeros(3, 4, dtype=torch.int32)), r"block_tables must be \[batch=2, max_blocks\]"),
    (dict(tables=torch.zeros(2, 4, dtype=torch.int64)), "block_tables must be int32"),
    (dict(seq_lens=torch.tensor([10, 20])), "seq_lens must be int32"),
    (dict(seq_lens=torch.tensor([10], dtype=torch.int32)), r"seq_lens must be \[batch=2\]"),
    (dict(query_lens=torch.tensor([1, 1, 1], dtype=torch.int32)), r"query_lens must be \[batch=2\]"),
    (dict(query=torch.randn(2, 4, 11, 64)), r"row 0 has 11 real query tokens but seq_lens\[0\]=10"),
    (dict(query_lens=torch.tensor([2, 1], dtype=torch.int32)), r"query_lens\[0\]=2 is outside 0..1"),
    (dict(seq_lens=torch.tensor([10, 999], dtype=torch.int32)), r"seq_lens\[1\]=999 is outside"),
    (dict(tables=torch.tensor([[-1, 0], [1, 7000]], dtype=torch.int32)), r"block_tables\[0\] holds block ids \[-1\]"),
    (dict(scale=float("nan")), "scale=nan is not a finite number"),
])
def test_bad_arguments_raise_clear_errors(small, kwargs, message):
    with pytest.raises(KernelError, match=message):
        call(small, **kwargs)


def test_entries_past_a_rows_blocks_are_ignored(small):
    tables = small.block_tables.clone()
    tables[0, 1:] = 12345  # row 0 has 10 tokens: one block of 16
    with kernels("torch"):
        torch.testing.assert_close(call(small, tables=tables, query=torch.ones(2, 4, 1, 64)),
                                   call(small, query=torch.ones(2, 4, 1, 64)))


def test_unsupported_head_size_is_a_logged_fallback_not_a_silent_one(monkeypatch, caplog):
    custom = kernel_loader.KernelChoice(True, "CuPy RawModule on cuda:0")
    assert decode_choice(custom, 128) is custom
    choice = decode_choice(custom, 72)
    assert not choice.use_custom and "head_dim=72 has no decode kernel" in choice.reason
    monkeypatch.setenv("PONYTAIL_KERNELS", "cupy")
    with pytest.raises(KernelError, match="PONYTAIL_KERNELS=cupy but head_dim=72 has no decode kernel"):
        decode_choice(custom, 72)
    monkeypatch.setenv("PONYTAIL_KERNELS", "auto")
    batch = Batch([5], kv_heads=1, head_dim=72, seed=12)  # any head size works in the fallback
    with caplog.at_level(logging.DEBUG, logger="ponytail.kernels"):
        out = paged_attention(batch.storage, 0, torch.randn(1, 2, 1, 72), batch.block_tables,
                              batch.seq_lens, None, 0.1)
    assert out.shape == (1, 2, 1, 72)
    assert any("paged_attention decode: fallback" in r.getMessage() for r in caplog.records)


def test_new_kv_is_written_before_the_decode_rows_attend():
    """new_kv on the fallback: the rows' last token comes from new_kv, not from what the cache held."""
    from ponytail.attention.decode import NewTokenKV

    batch = Batch([1, 17, 40, 0], kv_heads=2, head_dim=64, block_size=4, seed=3)
    layer, size = 1, batch.cache.config.block_size
    gen = torch.Generator().manual_seed(4)
    keys, values = torch.randn(4, 2, 64, generator=gen), torch.randn(4, 2, 64, generator=gen)
    slots = []
    for b, n in enumerate(batch.lengths):
        table = batch.cache.block_table(b)
        slots.append(-1 if n == 0 else table[(n - 1) // size] * size + (n - 1) % size)
        if n:
            batch.keys[b][layer, n - 1], batch.values[b][layer, n - 1] = keys[b], values[b]
    query = torch.randn(4, 6, 1, 64, generator=gen)
    with kernels("torch"):
        out = paged_attention(batch.storage, layer, query, batch.block_tables, batch.seq_lens, None, 0.125,
                              new_kv=NewTokenKV(keys, values, torch.tensor(slots)))
    assert rel_error(out, naive_attention(batch, layer, query, None, 0.125)) < TOLERANCE[torch.float32]


def test_new_kv_must_be_one_token_per_row_shaped_as_the_cache(small):
    from ponytail.attention.decode import NewTokenKV

    rows = small.seq_lens.shape[0]
    kv = torch.zeros(rows, 2, 64)
    slots = torch.full((rows,), -1)
    query = torch.randn(rows, 4, 1, 64)
    call = lambda new_kv, q=query: paged_attention(small.storage, 0, q, small.block_tables,  # noqa: E731
                                                   small.seq_lens, None, 0.125, new_kv=new_kv)
    shape = rf"new_kv.keys must be \[{rows} rows, 2 kv heads, 64 head_dim\], got \(1, 2, 64\)"
    with pytest.raises(KernelError, match=shape):
        call(NewTokenKV(kv[:1], kv, slots))
    with pytest.raises(KernelError, match=r"new_kv.values must be torch.float32 on cpu, got torch.float16"):
        call(NewTokenKV(kv, kv.half(), slots))
    with pytest.raises(KernelError, match=r"new_kv.keys must have a contiguous head_dim"):
        call(NewTokenKV(torch.zeros(rows, 2, 64 * 2)[:, :, ::2], kv, slots))
    with pytest.raises(KernelError, match=rf"new_kv.slots must be int64 \[{rows}\] on cpu, got torch.int32"):
        call(NewTokenKV(kv, kv, slots.int()))
    with pytest.raises(KernelError, match=r"new_kv takes one query position per row \(decode\), got 3"):
        call(NewTokenKV(kv, kv, slots), torch.randn(rows, 4, 3, 64))
