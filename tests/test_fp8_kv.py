"""FP8 KV pools on the CPU: storage and scales, the torch paths' rounding, attention over FP8 blocks,
capacity, copy-on-write and defragmentation, and the errors bad settings get."""

from __future__ import annotations

import logging
import math

import pytest
import torch

import ponytail
from ponytail import CacheConfig, ConfigError, PagedKVCache
from ponytail.attention.paged import paged_attention, paged_attention_varlen
from ponytail.kv import cache_ops
from ponytail.kv.estimate import estimate_kv_cache
from ponytail.kv.scales import KVScales, dequantize, quantize
from cache_machine import kernels

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 2, 2, 32, 16
SCALES = torch.tensor([[0.02, 0.01], [0.05, 0.004]])  # [layer, K/V]: not 1.0, so a missed scale shows


def make_cache(kv_cache_dtype: str, dtype=torch.bfloat16, blocks: int = 64) -> PagedKVCache:
    config = CacheConfig(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype,
                         max_batch_size=1, max_seq_len=blocks * BLOCK, block_size=BLOCK, chunk_blocks=16,
                         device="cpu", kv_cache_dtype=kv_cache_dtype)
    cache = PagedKVCache(config)
    if cache.storage.scales is not None:
        cache.storage.scales.set(SCALES[:, 0], SCALES[:, 1])
    return cache


def fill(cache: PagedKVCache, lengths: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]):
    """Rows appended in turn (their blocks interleave); returns block tables and seq_lens."""
    for row in range(len(lengths)):
        assert cache.allocate(row, [])
    written = [0] * len(lengths)
    while any(w < n for w, n in zip(written, lengths)):
        for row, n in enumerate(lengths):
            take = min(n - written[row], 7 + row)
            if take <= 0:
                continue
            result = cache.append(row, [row * 10_000 + written[row] + i for i in range(take)])
            part = slice(written[row], written[row] + take)
            cache.write(keys[row][:, part], values[row][:, part], result.slots)
            written[row] += take
    width = max(len(cache.block_table(r)) for r in range(len(lengths))) + 1
    tables = torch.full((len(lengths), width), -1, dtype=torch.int32)
    for row in range(len(lengths)):
        table = cache.block_table(row)
        tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
    return tables, torch.tensor(lengths, dtype=torch.int32)


def random_kv(lengths, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    # Magnitudes spread over decades: values that need the scale and values near FP8's subnormals.
    make = lambda n: (torch.randn(LAYERS, n, KV_HEADS, HEAD_DIM, generator=gen)  # noqa: E731
                      * 10 ** (torch.rand(LAYERS, n, KV_HEADS, 1, generator=gen) * 3 - 2)).to(dtype)
    return [make(n) for n in lengths], [make(n) for n in lengths]


def rounded(tensors, column: int):
    """What an FP8 pool hands back for these K (column 0) or V (1): quantized, then dequantized."""
    scale = SCALES[:, column][:, None, None, None]
    return [dequantize(quantize(t, scale), scale, t.dtype) for t in tensors]


def test_writes_store_the_scaled_rounding_and_read_back_dequantized():
    cache = make_cache("fp8")
    keys, values = random_kv([37])
    fill(cache, [37], keys, values)
    assert cache.storage.chunks[0].dtype == torch.float8_e4m3fn
    stored = cache.read(0)  # [layers, 2, tokens, heads, dim], dequantized into the model's dtype
    assert stored.dtype == torch.bfloat16
    assert torch.equal(stored[:, 0], rounded(keys, 0)[0])
    assert torch.equal(stored[:, 1], rounded(values, 1)[0])


def test_quantize_saturates_rounds_to_nearest_even_and_keeps_nan():
    scale = torch.tensor(2.0)
    x = torch.tensor([1000.0, -1000.0, 896.0, 2 ** -9, 3 * 2 ** -9, 0.0, float("nan")])
    got = quantize(x, scale).float()
    # 1000/2 = 500 saturates to 448; 2^-10 is half way to E4M3's smallest subnormal and rounds to even (0);
    # 1.5 * 2^-9 rounds to 2 * 2^-9.
    assert got[:6].tolist() == [448.0, -448.0, 448.0, 0.0, 2 ** -8, 0.0]
    assert math.isnan(got[6])


@pytest.mark.parametrize("lengths", [[1, 40, 17], [64, 3]])
@pytest.mark.parametrize("heads", [2, 8])
def test_attention_over_fp8_blocks_equals_attention_over_their_dequantized_values(lengths, heads):
    keys, values = random_kv(lengths, seed=3)
    fp8 = make_cache("fp8")
    tables, seq_lens = fill(fp8, lengths, keys, values)
    reference = make_cache("auto")
    fill(reference, lengths, rounded(keys, 0), rounded(values, 1))
    gen = torch.Generator().manual_seed(4)
    scale = 1 / math.sqrt(HEAD_DIM)
    with kernels("torch"):
        for positions in (1, 5):
            query = torch.randn(len(lengths), heads, positions, HEAD_DIM, generator=gen).to(torch.bfloat16)
            real = torch.tensor([min(positions, n) for n in lengths], dtype=torch.int32)
            for layer in range(LAYERS):
                got = paged_attention(fp8.storage, layer, query, tables, seq_lens, real, scale)
                want = paged_attention(reference.storage, layer, query, tables, seq_lens, real, scale)
                assert torch.equal(got, want)
        counts = [min(3, n) for n in lengths]
        cu = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32)
        packed = torch.randn(sum(counts), heads, HEAD_DIM, generator=gen).to(torch.bfloat16)
        got = paged_attention_varlen(fp8.storage, 1, packed, cu, max(counts), tables, seq_lens, scale)
        want = paged_attention_varlen(reference.storage, 1, packed, cu, max(counts), tables, seq_lens, scale)
        assert torch.equal(got, want)


def test_copy_on_write_and_defragmentation_move_fp8_bytes_unchanged():
    cache = make_cache("fp8")
    keys, values = random_kv([40, 40, 40], seed=5)
    fill(cache, [40, 40, 40], keys, values)
    before = cache.read(2)
    cache.free(0)
    cache.free(1)
    result = cache.defragment()
    assert result.blocks_moved > 0
    assert torch.equal(cache.read(2), before)
    cache.fork(2, 3)  # shares every block; the append copies the shared last block first
    appended = cache.append(3, [1, 2])
    extra_k, extra_v = random_kv([2], seed=6)
    cache.write(extra_k[0], extra_v[0], appended.slots)
    assert torch.equal(cache.read(2), before)
    assert torch.equal(cache.read(3)[:, :, :40], before)


def test_fp8_holds_twice_the_tokens_of_bf16_in_the_same_memory():
    budget = "64MiB"
    shape = dict(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16", max_batch_size=8,
                 max_seq_len=4096, memory_budget=budget, device="cpu")
    bf16, fp8 = CacheConfig(**shape), CacheConfig(**shape, kv_cache_dtype="fp8")
    assert fp8.max_num_blocks >= 1.95 * bf16.max_num_blocks
    assert fp8.bytes_per_token * 2 == bf16.bytes_per_token
    estimate = {dt: estimate_kv_cache(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16", max_batch_size=1,
                                      max_seq_len=4096, gpu_memory=budget, kv_cache_dtype=dt) for dt in ("auto", "fp8")}
    assert estimate["fp8"].max_concurrent_seqs >= 1.95 * estimate["auto"].max_concurrent_seqs
    assert estimate["fp8"].bytes_per_token == fp8.bytes_per_token


@pytest.mark.parametrize("value", ["int8", "fp8_e5m2", 8, None])
def test_an_unknown_kv_cache_dtype_is_named(value):
    with pytest.raises(ConfigError, match=r"kv_cache_dtype=.* is not supported; allowed: auto, fp8, fp8_e4m3"):
        CacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, dtype="bf16", max_batch_size=1, max_seq_len=16,
                    device="cpu", kv_cache_dtype=value)


@pytest.mark.parametrize("k, message", [
    (torch.ones(3), r"k_scale has shape \(3,\); allowed: a number, or a tensor of shape \(\), \(1,\) or \(2,\)"),
    (torch.ones(2, 2), r"k_scale has shape \(2, 2\)"),
    (torch.tensor([1.0, 0.0]), r"k_scale=\[1.0, 0.0\] has a scale that is not finite and positive"),
    (float("inf"), r"not finite and positive"),
])
def test_scales_of_the_wrong_shape_or_value_are_named(k, message):
    scales = KVScales(2, torch.device("cpu"))
    with pytest.raises(ConfigError, match=message):
        scales.set(k, 1.0)
    assert torch.equal(scales.values, torch.ones(2, 2))  # nothing half-set


def test_calculated_scales_follow_vllms_rule_from_the_first_written_tokens():
    cache = make_cache("fp8", dtype=torch.float32)
    cache.storage.scales.calculate_on_first_write()
    keys, values = random_kv([20], seed=7, dtype=torch.float32)
    assert cache.allocate(0, [])
    first = cache.append(0, list(range(20)))
    skipped = torch.full((LAYERS, 1, KV_HEADS, HEAD_DIM), 1e6)  # a padding token (slot -1) is not counted
    cache.write(torch.cat([keys[0], skipped], 1), torch.cat([values[0], skipped], 1), list(first.slots) + [-1])
    got = cache.storage.scales.values
    assert torch.allclose(got[:, 0], keys[0].abs().amax(dim=(1, 2, 3)) / 200)
    assert torch.allclose(got[:, 1], values[0].abs().amax(dim=(1, 2, 3)) / 100)
    later = cache.append(0, [99])
    cache.write(keys[0][:, :1] * 1000, values[0][:, :1] * 1000, later.slots)  # set once: later tokens saturate
    assert torch.equal(cache.storage.scales.values, got)


def test_fp8_on_cuda_with_a_float32_model_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ConfigError, match=r"kv_cache_dtype='fp8' with dtype=float32 on cuda:0: .* allowed: a "
                                          r"bfloat16 or float16 model"):
        CacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", max_batch_size=1, max_seq_len=16,
                    device="cuda", kv_cache_dtype="fp8")


def test_write_checks_still_name_a_wrong_dtype():
    cache = make_cache("fp8")
    assert cache.allocate(0, [])
    slots = cache.append(0, [1]).slots
    wrong = torch.zeros(LAYERS, 1, KV_HEADS, HEAD_DIM, dtype=torch.float8_e4m3fn)
    with pytest.raises(Exception, match="does not match the cache dtype"):
        cache_ops.write_slots(cache.storage, wrong, wrong, torch.tensor(slots), 0)


def test_an_fp8_pool_without_scales_warns(caplog):
    from ponytail.models.kv_scales import set_kv_scales

    scales = KVScales(2, torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="ponytail.kv"):
        assert set_kv_scales(scales, model=None) == "default"
    assert "every scale is 1.0" in caplog.text


def test_every_entry_point_names_a_bad_kv_cache_dtype():
    from deployments.app.args import AppArgs

    message = r"kv_cache_dtype='fp4' is not supported; allowed: auto, fp8, fp8_e4m3"
    with pytest.raises(ConfigError, match=message):
        ponytail.LLM(None, kv_cache_dtype="fp4")  # refused before any model loads
    with pytest.raises(ValueError, match="engine: " + message):
        AppArgs(engine={"kv_cache_dtype": "fp4"})


def test_serve_and_estimate_take_the_flag(capsys):
    from ponytail.cli import main

    assert main(["estimate", "--num-layers", "30", "--num-kv-heads", "3", "--head-dim", "64", "--dtype", "bfloat16",
                 "--max-seq-len", "4096", "--gpu-memory", "1GiB", "--kv-cache-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "FP8 (kv_cache_dtype=fp8) for a bfloat16 model (1 bytes)" in out
    assert "kv_cache_dtype=auto: 23,040 bytes" in out and "0.50x the tokens" in out


def tiny_checkpoint(tmp_path, scales: dict[str, torch.Tensor]):
    """A 2-layer Llama saved to tmp_path with extra tensors (the scales a quantization tool writes)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    if scales:
        save_file(scales, str(tmp_path / "kv_scales.safetensors"))
    return LlamaForCausalLM.from_pretrained(tmp_path)


def test_checkpoint_scales_are_read_from_its_safetensors(tmp_path):
    names = {f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor(0.01 * (i + 1) * (2 if kind == "v" else 1))
             for i in range(2) for kind in ("k", "v")}
    model = tiny_checkpoint(tmp_path, names)
    cache = ponytail.create_cache(model=model, max_batch_size=1, max_seq_len=64, kv_cache_dtype="fp8")
    scales = cache.paged.storage.scales
    assert scales.source == "checkpoint"
    assert torch.allclose(scales.values, torch.tensor([[0.01, 0.02], [0.02, 0.04]]))


@pytest.mark.parametrize("names, message", [
    ({"model.layers.0.self_attn.k_scale": torch.ones(2), "model.layers.0.self_attn.v_scale": torch.ones(())},
     r"model.layers.0.self_attn.k_scale has shape \(2,\); allowed: one scale per layer for K and for V"),
    ({"model.layers.0.self_attn.k_scale": torch.ones(()), "model.layers.0.self_attn.v_scale": torch.ones(())},
     r"has K/V scales for some layers but not k_scale of layer 1, v_scale of layer 1"),
])
def test_checkpoint_scales_of_the_wrong_shape_or_incomplete_are_named(tmp_path, names, message):
    model = tiny_checkpoint(tmp_path, names)
    with pytest.raises(ConfigError, match=message):
        ponytail.create_cache(model=model, max_batch_size=1, max_seq_len=64, kv_cache_dtype="fp8")


def test_create_cache_names_a_calculate_kv_scales_that_is_not_a_bool():
    with pytest.raises(ConfigError, match=r"calculate_kv_scales='yes' is not supported; allowed: True or False"):
        ponytail.create_cache(num_layers=1, num_heads=1, head_dim=8, max_batch_size=1, max_seq_len=16,
                              kv_cache_dtype="fp8", calculate_kv_scales="yes")
    with pytest.raises(ConfigError, match=r"calculate_kv_scales='yes' is not supported; allowed: True or False"):
        ponytail.LLM(None, calculate_kv_scales="yes")  # refused before any model loads
