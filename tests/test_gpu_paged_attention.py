"""The CuPy decode kernel and the gather + SDPA prefill path against the fp32 fallback and an fp64
reference (marked gpu: skipped without CUDA). Run with -s to see the errors of every case."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
import logging
import math
from unittest import mock

import pytest
import torch

from ponytail import CacheConfig, PagedKVCache
from ponytail.attention import decode, prefill_cupy, torch_fallback
from ponytail.attention.fa4 import fa4_pages_problem, fa4_problem
from ponytail.attention.paged import paged_attention, paged_attention_varlen
from ponytail.kv import storage as storage_module
from cache_machine import kernels

pytestmark = pytest.mark.gpu

# ||out - ref|| / ||ref|| allowed per dtype.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
LAYERS = 2


def make_batch(lengths, kv_heads, head_dim, dtype, block_size=16, chunk_blocks=64, seed=0, table_pad=3,
               spacer_bytes=0):
    """A cache of random K/V whose rows own randomly scattered blocks, and their tables.
    spacer_bytes: that much device memory is allocated after the first chunk, before the others."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    needed = sum(-(-n // block_size) for n in lengths)
    chunks = max(2 if spacer_bytes else 1, -(-(needed + 1) // chunk_blocks))
    config = CacheConfig(num_layers=LAYERS, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                         max_batch_size=1, max_seq_len=chunks * chunk_blocks * block_size,
                         block_size=block_size, chunk_blocks=chunk_blocks, device="cuda")
    if spacer_bytes:  # the chunks come from one arena, the first spacer_bytes before the others
        with mock.patch.object(storage_module, "aligned_empty", ArenaChunks(spacer_bytes, chunks, config)):
            cache = PagedKVCache(config, initial_chunks=chunks)
    else:
        cache = PagedKVCache(config, initial_chunks=chunks)
    for chunk in cache.storage.chunks:
        chunk.copy_(torch.randn(chunk.shape, generator=gen, device="cuda").to(dtype))
    order = torch.randperm(cache.storage.num_blocks, generator=gen, device="cuda").int()
    width = max(-(-n // block_size) for n in lengths) + table_pad
    tables = torch.full((len(lengths), width), -1, dtype=torch.int32, device="cuda")
    start = 0
    for row, n in enumerate(lengths):
        count = -(-n // block_size)
        tables[row, :count] = order[start : start + count]
        start += count
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    return cache.storage, tables, seq_lens


class ArenaChunks:
    """storage.py's chunk allocation from one device arena: chunk 0 at its start, the others
    spacer_bytes later (torch's allocator, left to itself, may put them anywhere)."""

    def __init__(self, spacer_bytes: int, chunks: int, config: CacheConfig):
        self.stride = config.block_bytes * config.chunk_blocks + config.layer_block_elems * config.dtype_size
        self.arena = torch.empty(spacer_bytes + chunks * self.stride, dtype=torch.uint8, device="cuda")
        self.starts = iter([0] + [spacer_bytes + i * self.stride for i in range(1, chunks)])

    def __call__(self, shape, dtype, device, align_bytes):
        base = self.arena[next(self.starts):]
        skip = (-base.data_ptr()) % align_bytes
        return base[skip : skip + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


def reference(storage, layer, query, tables, seq_lens, query_lens, scale, window=None) -> torch.Tensor:
    """fp64 attention, one row at a time, K/V read block by block from the chunks; window: each
    query sees the last that many positions up to its own."""
    rows, heads, positions, head_dim = query.shape
    c = storage.config
    group = heads // c.num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float64, device="cuda")
    for b in range(rows):
        n = int(seq_lens[b])
        real = positions if query_lens is None else int(query_lens[b])
        if n == 0 or real == 0:
            continue
        ids = tables[b, : -(-n // c.block_size)].long()
        k = torch.stack([storage.chunks[i // storage.chunk_blocks][layer, 0, i % storage.chunk_blocks]
                         for i in ids.tolist()]).flatten(0, 1)[:n]  # [n, Hkv, D]
        v = torch.stack([storage.chunks[i // storage.chunk_blocks][layer, 1, i % storage.chunk_blocks]
                         for i in ids.tolist()]).flatten(0, 1)[:n]
        k = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n, D]
        v = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[b].double()  # [Hq, T, D]
        scores = q @ k.transpose(1, 2) * scale  # [Hq, T, n]
        j = torch.arange(positions, device="cuda")
        pos = n - positions + j
        keys = torch.arange(n, device="cuda")[None, :]
        allowed = (keys <= pos[:, None]) & (j >= positions - real)[:, None]
        if window is not None:
            allowed &= keys > pos[:, None] - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[b] = weights @ v
    return out


def rel(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def poison_like(shape, dtype):
    """Fill the allocator's next block of this size with NaN, so an unwritten element shows."""
    t = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    ptr = t.data_ptr()
    del t
    return ptr


def run_case(lengths, kv_heads, group, head_dim, dtype, positions=1, query_lens=None, block_size=16,
             seed=0, layer=1, launch=None, compare_fallback=True):
    storage, tables, seq_lens = make_batch(lengths, kv_heads, head_dim, dtype, block_size, seed=seed)
    heads = kv_heads * group
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    query = torch.randn(len(lengths), heads, positions, head_dim, generator=gen, device="cuda").to(dtype)
    if query_lens is not None:
        query_lens = torch.tensor(query_lens, dtype=torch.int32, device="cuda")
    scale = 1 / math.sqrt(head_dim)
    old = dict(decode.LAUNCH)
    decode.LAUNCH.update(launch or {})
    try:
        poisoned = poison_like(query.shape, dtype)
        with kernels("cupy"):
            out = paged_attention(storage, layer, query, tables, seq_lens, query_lens, scale)
        torch.cuda.synchronize()
    finally:
        decode.LAUNCH.clear()
        decode.LAUNCH.update(old)
    ref = reference(storage, layer, query, tables, seq_lens, query_lens, scale)
    err = rel(out, ref)
    max_abs = (out.double() - ref).abs().max().item()
    nans = int(torch.isnan(out).sum())
    line = (f"\n  {dtype} D={head_dim} kv={kv_heads} G={group} T={positions} bs={block_size} lengths={lengths} "
            f"out={tuple(out.shape)} rel={err:.2e} max_abs={max_abs:.2e} nan={nans} "
            f"poison_landed={out.data_ptr() == poisoned}")
    if compare_fallback:
        with kernels("torch"):
            fallback = paged_attention(storage, layer, query, tables, seq_lens, query_lens, scale)
        line += f" vs_fallback={rel(out, fallback.double()):.2e} fallback_vs_ref={rel(fallback, ref):.2e}"
    print(line, end="")
    assert nans == 0, f"{nans} output elements never written:{line}"
    assert err < TOLERANCE[dtype], line
    empty = torch.tensor([n == 0 for n in lengths], device="cuda")
    if query_lens is not None:
        empty |= query_lens == 0
    assert torch.all(out[empty] == 0), f"rows without tokens must be exactly zero:{line}"
    return out


LENGTHS = [0, 1, 15, 16, 17, 100, 1000, 3000]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_kernel_every_dtype_head_size_and_gqa_ratio(dtype, head_dim, group):
    run_case(LENGTHS, kv_heads=2, group=group, head_dim=head_dim, dtype=dtype, seed=head_dim + group)


@pytest.mark.parametrize("group", [1, 3, 4, 8, 12])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_long_rows_split_kv(group, dtype):
    run_case([32768, 20000, 5, 0, 4097], kv_heads=2, group=group, head_dim=128 if dtype != torch.float32 else 64,
             dtype=dtype, seed=group, compare_fallback=group in (1, 4))


@pytest.mark.parametrize("launch", [
    {"max_split_blocks": 4096, "min_split_tokens": 1 << 30},  # one split
    {"min_split_tokens": 16, "split_overhead_tokens": 0},  # as many splits as pay off
    {"decode_warps": 1}, {"decode_warps": 8}, {"max_heads_per_cta": 2},
])
def test_decode_launch_variants(launch):
    out = run_case([1, 700, 16, 2000, 0], kv_heads=4, group=4, head_dim=128, dtype=torch.bfloat16, launch=launch)
    same = run_case([1, 700, 16, 2000, 0], kv_heads=4, group=4, head_dim=128, dtype=torch.bfloat16)
    assert rel(out, same.double()) < 1e-2


@pytest.mark.parametrize("block_size", [1, 4, 32, 128])
def test_decode_block_sizes(block_size):
    run_case([1, 33, 500, 1500], kv_heads=2, group=4, head_dim=128, dtype=torch.float16, block_size=block_size)


def test_decode_can_be_captured_in_a_cuda_graph():
    storage, tables, seq_lens = make_batch([40, 3000, 0], kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    query = torch.randn(3, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    eager = paged_attention(storage, 0, query, tables, seq_lens, None, 0.1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_attention(storage, 0, query, tables, seq_lens, None, 0.1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = paged_attention(storage, 0, query, tables, seq_lens, None, 0.1)
    query.copy_(torch.randn_like(query))
    graph.replay()
    torch.cuda.synchronize()
    expected = paged_attention(storage, 0, query, tables, seq_lens, None, 0.1)
    print(f"\n  graph replay vs eager: rel={rel(captured, expected.double()):.2e}", end="")
    assert torch.equal(captured, expected) and not torch.equal(captured, eager)


def test_decode_padding_rows_via_query_lens():
    run_case([10, 200, 0, 64], kv_heads=2, group=4, head_dim=64, dtype=torch.bfloat16, query_lens=[0, 1, 1, 0])


@pytest.mark.parametrize("positions", [2, 64, 300])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_prefill_gather_and_sdpa(positions, group, dtype):
    lengths = [positions, positions + 1000, positions + 17, 0, 2 * positions]
    query_lens = [positions, positions, max(1, positions // 3), 0, positions - 1]
    run_case(lengths, kv_heads=2, group=group, head_dim=128 if dtype != torch.float32 else 64, dtype=dtype,
             positions=positions, query_lens=query_lens, seed=positions)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 256])
def test_prefill_other_head_sizes(head_dim):
    run_case([70, 300, 9], kv_heads=1, group=3, head_dim=head_dim, dtype=torch.bfloat16, positions=9)


def test_gather_matches_the_fallback_gather_bit_for_bit():
    storage, tables, seq_lens = make_batch([5, 300, 0, 64], kv_heads=4, head_dim=96, dtype=torch.float16)
    k, v = prefill_cupy.gather_padded(storage, 1, tables, seq_lens)
    k_ref, v_ref = torch_fallback.gather_torch(storage, 1, tables, seq_lens)
    assert torch.equal(k.view(torch.int16), k_ref.view(torch.int16))
    assert torch.equal(v.view(torch.int16), v_ref.view(torch.int16))


def test_decode_uses_the_custom_kernel_and_logs_it(caplog):
    storage, tables, seq_lens = make_batch([40], kv_heads=1, head_dim=128, dtype=torch.bfloat16)
    query = torch.randn(1, 2, 1, 128, device="cuda", dtype=torch.bfloat16)
    with caplog.at_level(logging.DEBUG, logger="ponytail.kernels"):
        paged_attention(storage, 0, query, tables, seq_lens, None, 0.1)
    assert any("paged_attention decode: custom kernel" in r.getMessage() for r in caplog.records)


def test_unsupported_head_size_falls_back_with_a_logged_reason(caplog):
    storage, tables, seq_lens = make_batch([40, 3], kv_heads=1, head_dim=72, dtype=torch.bfloat16)
    query = torch.randn(2, 2, 1, 72, device="cuda", dtype=torch.bfloat16)
    with caplog.at_level(logging.DEBUG, logger="ponytail.kernels"):
        out = paged_attention(storage, 0, query, tables, seq_lens, None, 0.1)
    ref = reference(storage, 0, query, tables, seq_lens, None, 0.1)
    assert rel(out, ref) < TOLERANCE[torch.bfloat16]
    assert any("head_dim=72 has no decode kernel" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------- prefill: packed gather + flash varlen
def test_prefill_positions_before_the_first_token_are_zero():
    out = run_case([5, 40], kv_heads=2, group=2, head_dim=128, dtype=torch.bfloat16, positions=9, seed=3)
    assert torch.all(out[0, :, :4] == 0) and torch.all(out[0, :, 4:].abs().sum(-1) > 0)


VARLEN_LENGTHS = [300, 17, 0, 1000, 64, 1, 2000]  # cached tokens per row, the row's new ones included
VARLEN_COUNTS = [300, 5, 0, 1, 64, 1, 700]  # of which new (queries): a whole prompt, chunks, decode rows


@dataclass
class VarlenCase:
    """Rows of queries packed end to end over a cache (the engine's varlen call), head_dim 128."""

    storage: object
    tables: torch.Tensor
    seq_lens: torch.Tensor
    query: torch.Tensor  # [rows, heads, width, 128]: row b's queries are its last counts[b] positions
    packed: torch.Tensor  # [sum(counts), heads, 128]
    cu: torch.Tensor  # [rows + 1] int32
    width: int
    num_keys: int = sum(VARLEN_LENGTHS)

    @staticmethod
    def counts_tensor() -> torch.Tensor:
        return torch.tensor(VARLEN_COUNTS, device="cuda")


def varlen_case(dtype, heads: int, seed: int, spacer_bytes: int = 0) -> VarlenCase:
    storage, tables, seq_lens = make_batch(VARLEN_LENGTHS, kv_heads=2, head_dim=128, dtype=dtype, seed=seed,
                                           chunk_blocks=16, spacer_bytes=spacer_bytes)
    width = max(VARLEN_COUNTS)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    query = torch.randn(len(VARLEN_LENGTHS), heads, width, 128, generator=gen, device="cuda").to(dtype)
    cu = torch.tensor([0, *itertools.accumulate(VARLEN_COUNTS)], dtype=torch.int32, device="cuda")
    return VarlenCase(storage, tables, seq_lens, query, unpack_rows(query, width).contiguous(), cu, width)


def unpack_rows(padded: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, heads, width, D] -> each row's last counts[b] positions end to end, [sum(counts), heads, D]."""
    return torch.cat([padded[b, :, width - n :].transpose(0, 1) for b, n in enumerate(VARLEN_COUNTS)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("varlen,keys_known", [("flash", False), ("fa4", False), ("fa4", True)])
def test_varlen_packed_rows_match_the_reference(dtype, group, varlen, keys_known, caplog):
    """keys_known: the caller passes sum(seq_lens) (the engine does), else the gather is sized
    by the tables (flash) or by reading the lengths back (fa4: its tile loads read past the last key)."""
    if varlen == "fa4" and (problem := fa4_problem(torch.device("cuda"), dtype, 128)):
        pytest.skip(f"FlashAttention-4 cannot run here: {problem}")
    case = varlen_case(dtype, heads=2 * group, seed=group)
    storage, tables, seq_lens, packed, cu, width = (case.storage, case.tables, case.seq_lens, case.packed, case.cu,
                                                    case.width)
    num_keys = case.num_keys if keys_known else 0
    scale = 1 / math.sqrt(128)
    with kernels("cupy"), caplog.at_level(logging.DEBUG, logger="ponytail.kernels"):
        out = paged_attention_varlen(storage, 1, packed, cu, width, tables, seq_lens, scale, varlen=varlen,
                                     num_keys=num_keys)
    ref = unpack_rows(reference(storage, 1, case.query, tables, seq_lens, case.counts_tensor(), scale), width)
    err = rel(out, ref)
    print(f"\n  varlen {dtype} G={group}: rel={err:.2e}", end="")
    assert out.shape == packed.shape and err < TOLERANCE[dtype]
    # out=: the rows land in the given tensor (a step's rows after its decode rows), the same values.
    step = torch.full((3 + packed.shape[0], *packed.shape[1:]), float("nan"), dtype=dtype, device="cuda")
    with kernels("cupy"):
        into = paged_attention_varlen(storage, 1, packed, cu, width, tables, seq_lens, scale, varlen=varlen,
                                      num_keys=num_keys, out=step[3:])
    assert into.data_ptr() == step[3:].data_ptr() and torch.equal(step[3:], out)
    assert torch.isnan(step[:3]).all()
    assert any(f"varlen prefill: custom kernel (CuPy packed gather + {varlen} varlen)" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("spacer_gib", [0, 6], ids=["chunks-near", "chunks-6GiB-apart"])
def test_fa4_reads_the_blocks_in_place_through_the_page_view(dtype, group, spacer_gib, caplog):
    """FlashAttention-4 through the pool's page view (kv/page_view.py; no gather) against the
    reference and the gather path. 6 GiB between the chunks puts pages past 2**31 elements from
    the view's start: the kernel's addresses must be 64-bit."""
    if problem := fa4_problem(torch.device("cuda"), dtype, 128) or fa4_pages_problem():
        pytest.skip(f"FlashAttention-4 cannot run here: {problem}")
    case = varlen_case(dtype, heads=2 * group, seed=group, spacer_bytes=spacer_gib << 30)
    view = case.storage.page_view()
    assert view is not None
    farthest = view.layer_pages * math.prod(view.grid.shape[1:]) * view.grid.element_size()
    assert (farthest > 2**32) is bool(spacer_gib), f"the allocator put the chunks {farthest} bytes apart"
    scale = 1 / math.sqrt(128)
    args = (case.storage, 1, case.packed, case.cu, case.width, case.tables, case.seq_lens, scale)
    with kernels("cupy"), caplog.at_level(logging.DEBUG, logger="ponytail.kernels"):
        out = paged_attention_varlen(*args, varlen="fa4", num_keys=case.num_keys,
                                     pages=view.pages_for(case.tables))
        gathered = paged_attention_varlen(*args, varlen="fa4", num_keys=case.num_keys)
    ref = unpack_rows(reference(case.storage, 1, case.query, case.tables, case.seq_lens, case.counts_tensor(),
                                scale), case.width)
    err, against_gather = rel(out, ref), rel(out, gathered)
    print(f"\n  fa4 pages {dtype} G={group}: rel={err:.2e}, against the gather {against_gather:.2e}", end="")
    assert out.shape == case.packed.shape and err < TOLERANCE[dtype] and against_gather < TOLERANCE[dtype] / 4
    assert "varlen prefill: custom kernel (fa4 varlen over the pool's pages)" in caplog.text


def test_packed_gather_matches_the_fallback_gather_bit_for_bit():
    lengths = [5, 300, 0, 64]
    storage, tables, seq_lens = make_batch(lengths, kv_heads=4, head_dim=96, dtype=torch.float16)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    k, v = prefill_cupy.gather_packed(storage, 1, tables, seq_lens, cu, capacity=sum(lengths))
    k_ref, v_ref = torch_fallback.gather_torch(storage, 1, tables, seq_lens)  # [B, H, L, D]
    for got, want in ((k, k_ref), (v, v_ref)):
        rows = torch.cat([want[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)])
        assert torch.equal(got[: sum(lengths)].view(torch.int16), rows.view(torch.int16))


def test_fp32_prefill_says_why_it_cannot_use_flash(caplog):
    storage, tables, seq_lens = make_batch([40, 3], kv_heads=1, head_dim=64, dtype=torch.float32)
    query = torch.randn(2, 2, 3, 64, device="cuda")
    with kernels("cupy"), caplog.at_level(logging.DEBUG, logger="ponytail.kernels"):
        paged_attention(storage, 0, query, tables, seq_lens, None, 0.1)
    assert any("masked SDPA: flash attention takes fp16/bf16" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------ the decode kernel's own write
def last_slots(tables, seq_lens, block_size) -> torch.Tensor:
    """Each row's slot for its seq_lens-th token (-1 for an empty row), as the engine maps them."""
    slots = []
    for b, n in enumerate(seq_lens.tolist()):
        slots.append(-1 if n == 0 else int(tables[b, (n - 1) // block_size]) * block_size + (n - 1) % block_size)
    return torch.tensor(slots, dtype=torch.int64, device="cuda")


def strided_new_kv(rows, kv_heads, head_dim, dtype, seed) -> tuple[torch.Tensor, torch.Tensor]:
    """keys and values [rows, kv_heads, head_dim] as views with strides of their own, as a model's
    q/k/v split hands them over."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    packed = torch.randn(rows, 2, kv_heads + 1, head_dim, generator=gen, device="cuda").to(dtype)
    return packed[:, 0, :kv_heads], packed[:, 1, 1:]


@pytest.mark.parametrize("launch", [
    {"max_split_blocks": 4096, "min_split_tokens": 1 << 30},  # one split
    {"min_split_tokens": 16, "split_overhead_tokens": 0},  # many: only the last one writes
])
@pytest.mark.parametrize("group", [1, 4, 12])  # 12: two CTAs of 8 and 4 query heads write the same bytes
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_kernel_writes_the_new_token_then_attends_it(launch, group, window, dtype):
    """new_kv: the cache ends bit for bit as cache_ops.write_slots leaves it, the output is the one
    attention over that cache gives, on the kernel and on the fallback."""
    from ponytail.attention.decode import NewTokenKV
    from ponytail.kv import cache_ops

    lengths, kv_heads, head_dim, layer = [1, 15, 16, 17, 700, 2000, 0], 2, 128 if dtype != torch.float32 else 64, 1
    storage, tables, seq_lens = make_batch(lengths, kv_heads, head_dim, dtype, seed=group)
    slots = last_slots(tables, seq_lens, storage.config.block_size)
    keys, values = strided_new_kv(len(lengths), kv_heads, head_dim, dtype, seed=group + 1)
    query = torch.randn(len(lengths), kv_heads * group, 1, head_dim, device="cuda").to(dtype)
    scale = 1 / math.sqrt(head_dim)
    before = [chunk.clone() for chunk in storage.chunks]
    old = dict(decode.LAUNCH)
    decode.LAUNCH.update(launch)
    try:
        with kernels("cupy"):
            fused = paged_attention(storage, layer, query, tables, seq_lens, None, scale, sliding_window=window,
                                    new_kv=NewTokenKV(keys, values, slots))
            written = [chunk.clone() for chunk in storage.chunks]
            for chunk, saved in zip(storage.chunks, before):
                chunk.copy_(saved)
            cache_ops.write_slots(storage, keys[None], values[None], slots, layer)
            plain = paged_attention(storage, layer, query, tables, seq_lens, None, scale, sliding_window=window)
    finally:
        decode.LAUNCH.clear()
        decode.LAUNCH.update(old)
    assert all(torch.equal(a, b) for a, b in zip(written, storage.chunks)), "the cache differs from write_slots'"
    assert not all(torch.equal(a, b) for a, b in zip(written, before)), "nothing was written"
    assert torch.equal(fused, plain)
    ref = reference(storage, layer, query, tables, seq_lens, None, scale, window)
    assert rel(fused, ref) < TOLERANCE[dtype]
    for chunk, saved in zip(storage.chunks, before):
        chunk.copy_(saved)
    with kernels("torch"):
        fallback = paged_attention(storage, layer, query, tables, seq_lens, None, scale, sliding_window=window,
                                   new_kv=NewTokenKV(keys, values, slots))
    assert all(torch.equal(a, b) for a, b in zip(written, storage.chunks)), "the fallback's cache differs"
    assert rel(fallback, ref) < TOLERANCE[dtype]


def test_decode_kernel_write_replays_in_a_cuda_graph_with_new_keys():
    from ponytail.attention.decode import NewTokenKV

    storage, tables, seq_lens = make_batch([40, 3000, 0], kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    slots = last_slots(tables, seq_lens, storage.config.block_size)
    keys, values = strided_new_kv(3, 2, 128, torch.bfloat16, seed=5)
    query = torch.randn(3, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    new_kv = NewTokenKV(keys, values, slots)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_attention(storage, 0, query, tables, seq_lens, None, 0.1, new_kv=new_kv)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = paged_attention(storage, 0, query, tables, seq_lens, None, 0.1, new_kv=new_kv)
    keys.copy_(torch.randn_like(keys))
    values.copy_(torch.randn_like(values))
    graph.replay()
    torch.cuda.synchronize()
    expected = paged_attention(storage, 0, query, tables, seq_lens, None, 0.1)  # the cache holds the new K/V now
    assert torch.equal(captured, expected)
    row = storage.read_tokens(tables[1].tolist()[: -(-3000 // 16)], 3000)  # [layers, 2, tokens, Hkv, D]
    assert torch.equal(row[0, 0, -1], keys[1]) and torch.equal(row[0, 1, -1], values[1])
