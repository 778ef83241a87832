"""FP8 pools on CUDA: the write kernels store exactly the torch rounding, the decode kernel (with its
fused write) and the prefill gathers attend as the torch path does over the same bytes, and the
engine serves from an FP8 pool (marked gpu: skipped without CUDA)."""

from __future__ import annotations

import math

import pytest
import torch

import ponytail
from ponytail import CacheConfig, PagedKVCache, SamplingParams
from ponytail.attention.decode import NewTokenKV
from ponytail.attention.paged import paged_attention, paged_attention_varlen
from ponytail.kv.scales import quantize
from cache_machine import kernels
from test_fp8_kv import fill

pytestmark = pytest.mark.gpu
LAYERS = 2


def fp8_pool(kv_heads, head_dim, dtype=torch.bfloat16, blocks=512, block_size=16):
    config = CacheConfig(num_layers=LAYERS, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, max_batch_size=1,
                         max_seq_len=blocks * block_size, block_size=block_size, chunk_blocks=128, device="cuda",
                         kv_cache_dtype="fp8")
    cache = PagedKVCache(config)
    cache.storage.scales.set(torch.tensor([0.03, 0.2]), torch.tensor([0.01, 0.05]))
    return cache


def spread(shape, gen, dtype):
    """Random values over several decades: some need the scale, some sit near FP8's subnormals."""
    base = torch.randn(shape, generator=gen, device="cuda")
    return (base * 10 ** (torch.rand(shape[:-1] + (1,), generator=gen, device="cuda") * 3 - 2)).to(dtype)


def fill_rows(cache, lengths, gen, dtype):
    """Rows of random K/V appended in turn so their blocks interleave; tables and seq_lens on CUDA."""
    c = cache.config
    shapes = [(LAYERS, n, c.num_kv_heads, c.head_dim) for n in lengths]
    keys, values = [spread(s, gen, dtype) for s in shapes], [spread(s, gen, dtype) for s in shapes]
    tables, seq_lens = fill(cache, lengths, keys, values)
    return tables.cuda(), seq_lens.cuda()


def rel_error(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_write_kernel_stores_the_torch_rounding_bit_for_bit(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache = fp8_pool(4, 128, dtype)
    assert cache.allocate(0, [])
    slots = cache.append(0, list(range(300))).slots
    wide = spread((LAYERS, 300, 8, 128), gen, dtype)
    keys, values = wide[:, :, ::2], wide[:, :, 1::2]  # strided heads, as the model's views are
    keys[0, 0, 0, :4] = torch.tensor([1e4, -1e4, float("nan"), 0.0], dtype=dtype)  # saturation, NaN, zero
    cache.write(keys, values, slots)
    with kernels("torch"):
        reference = fp8_pool(4, 128, dtype)
        assert reference.allocate(0, [])
        reference.write(keys, values, reference.append(0, list(range(300))).slots)
    got = cache.storage.chunks[0].view(torch.uint8)
    want = reference.storage.chunks[0].view(torch.uint8)
    blocks = -(-300 // 16)
    assert torch.equal(got[:, :, :blocks], want[:, :, :blocks])


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("window", [None, 100])
def test_decode_kernel_equals_the_torch_path_over_the_same_fp8_bytes(head_dim, group, window):
    gen = torch.Generator(device="cuda").manual_seed(1)
    cache = fp8_pool(2, head_dim)
    lengths = [1, 17, 300, 2100]  # the long row is split across CTAs
    tables, seq_lens = fill_rows(cache, lengths, gen, torch.bfloat16)
    query = torch.randn(len(lengths), 2 * group, 1, head_dim, generator=gen, device="cuda").to(torch.bfloat16)
    scale = 1 / math.sqrt(head_dim)
    for layer in range(LAYERS):
        out = paged_attention(cache.storage, layer, query, tables, seq_lens, None, scale, sliding_window=window)
        with kernels("torch"):
            ref = paged_attention(cache.storage, layer, query, tables, seq_lens, None, scale, sliding_window=window)
        assert rel_error(out, ref) < 1e-2, f"layer {layer}"


def test_decode_kernel_writes_the_new_token_as_write_slots_does():
    gen = torch.Generator(device="cuda").manual_seed(2)
    cache = fp8_pool(2, 128)
    fill_rows(cache, [40, 9], gen, torch.bfloat16)
    slots = [cache.append(row, [7]).slots[0] for row in range(2)]
    width = max(len(cache.block_table(r)) for r in range(2))
    tables = torch.tensor([cache.block_table(r) + [-1] * (width - len(cache.block_table(r))) for r in range(2)],
                          dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([41, 10], dtype=torch.int32, device="cuda")
    new_k, new_v = spread((2, 2, 128), gen, torch.bfloat16), spread((2, 2, 128), gen, torch.bfloat16)
    query = torch.randn(2, 4, 1, 128, generator=gen, device="cuda").to(torch.bfloat16)
    slot_tensor = torch.tensor(slots, dtype=torch.int64, device="cuda")
    paged_attention(cache.storage, 1, query, tables, seq_lens, None, 0.1, new_kv=NewTokenKV(new_k, new_v, slot_tensor))
    stored = cache.read(0)[1], cache.read(1)[1]  # layer 1: [2, tokens, heads, dim], dequantized
    scales = cache.storage.scales.values[1]
    for row in range(2):
        want_k = quantize(new_k[row], scales[0]).float() * scales[0]
        want_v = quantize(new_v[row], scales[1]).float() * scales[1]
        assert torch.equal(stored[row][0, -1].float(), want_k.to(torch.bfloat16).float())
        assert torch.equal(stored[row][1, -1].float(), want_v.to(torch.bfloat16).float())


def test_prefill_gathers_dequantize_as_the_torch_path_does():
    gen = torch.Generator(device="cuda").manual_seed(3)
    cache = fp8_pool(2, 128)
    lengths = [5, 70, 333]
    tables, seq_lens = fill_rows(cache, lengths, gen, torch.bfloat16)
    counts = [5, 16, 33]
    cu = torch.tensor([0, 5, 21, 54], dtype=torch.int32, device="cuda")
    query = torch.randn(sum(counts), 8, 128, generator=gen, device="cuda").to(torch.bfloat16)
    for layer in range(LAYERS):
        out = paged_attention_varlen(cache.storage, layer, query, cu, max(counts), tables, seq_lens, 0.088)
        with kernels("torch"):
            ref = paged_attention_varlen(cache.storage, layer, query, cu, max(counts), tables, seq_lens, 0.088)
        assert rel_error(out, ref) < 1e-2
        padded = torch.randn(3, 8, 4, 128, generator=gen, device="cuda").to(torch.bfloat16)
        out = paged_attention(cache.storage, layer, padded, tables, seq_lens, None, 0.088)
        with kernels("torch"):
            ref = paged_attention(cache.storage, layer, padded, tables, seq_lens, None, 0.088)
        assert rel_error(out, ref) < 1e-2


def test_engine_serves_from_an_fp8_pool_with_twice_the_blocks():
    prompts = ["The capital of France is", "List three primes:", "def fib(n):", "Water boils at"]
    params = SamplingParams(max_tokens=48, temperature=0)
    results = {}
    for kv_dtype in ("auto", "fp8"):
        llm = ponytail.LLM(None, device="cuda", kv_cache_memory="256MiB", kv_cache_dtype=kv_dtype,
                           calculate_kv_scales=True)
        results[kv_dtype] = ([o.outputs[0].token_ids for o in llm.generate(prompts, params)],
                             llm.engine.cache.config.max_num_blocks)
        # The same prompts again, their prefixes from the cache: a bf16 pool hands back the very K/V,
        # so the answers stay; an FP8 one its rounding of them, which the first pass's prompt did not
        # attend (a prompt's own chunk attends its unrounded K/V), so only most tokens must stay.
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        same = sum(a == b for x, y in zip(again, results[kv_dtype][0]) for a, b in zip(x, y))
        assert same == sum(map(len, again)) if kv_dtype == "auto" else same >= 0.5 * sum(map(len, again))
        del llm
    assert results["fp8"][1] >= 1.95 * results["auto"][1]
    agree = sum(a == b for x, y in zip(results["auto"][0], results["fp8"][0]) for a, b in zip(x, y))
    assert agree >= 0.5 * sum(len(x) for x in results["auto"][0])
