"""Argument checks and kernel-path selection of the cache ops (CPU)."""

import logging

import pytest
import torch

from ponytail import CacheConfig, ConfigError, KernelError, PagedKVCache
from ponytail.kernels import loader as kernel_loader
from ponytail.kv import cache_ops


@pytest.fixture
def cache():
    return PagedKVCache(CacheConfig(max_batch_size=2, max_seq_len=32, num_layers=2, num_kv_heads=2, head_dim=4,
                                    dtype="float32", device="cpu", block_size=4))


def kv(layers=2, tokens=3, heads=2, dim=4, dtype=torch.float32):
    return torch.randn(layers, tokens, heads, dim, dtype=dtype), torch.randn(layers, tokens, heads, dim, dtype=dtype)


@pytest.mark.parametrize("bad, message", [
    (dict(heads=3), r"keys must be \[layers, tokens, 2 kv heads, 4 head_dim\], got \(2, 3, 3, 4\)"),
    (dict(dim=8), r"keys must be \[layers, tokens, 2 kv heads, 4 head_dim\], got \(2, 3, 2, 8\)"),
    (dict(dtype=torch.float16), r"keys dtype torch.float16 does not match the cache dtype torch.float32"),
    (dict(layers=3), r"layers 0..2 are outside the cache's 2 layers"),
])
def test_write_rejects_mismatched_tensors(cache, bad, message):
    keys, values = kv(**bad)
    with pytest.raises(KernelError, match=message):
        cache.write(keys, values, [0, 1, 2])


def test_write_rejects_non_contiguous_head_dim_and_bad_slots(cache):
    keys, values = kv()
    with pytest.raises(KernelError, match="must have a contiguous head_dim"):
        cache.write(keys.transpose(2, 3).contiguous().transpose(2, 3), values, [0, 1, 2])
    with pytest.raises(KernelError, match=r"one slot per token \(3\), got shape \(2,\)"):
        cache.write(keys, values, [0, 1])
    with pytest.raises(KernelError, match="values \\(2, 3, 2, 4\\) differ in shape"):
        cache.write(keys[:, :2], values, [0, 1])


def test_strided_input_is_accepted_and_padding_slots_skipped(cache):
    result = cache.allocate("s", [1, 2, 3])
    base = torch.randn(2, 2, 3, 4)  # [layers, heads, tokens, dim], as attention lays it out
    keys = base.transpose(1, 2)  # a non-contiguous view [layers, tokens, heads, dim]
    cache.write(keys, keys, result.slots)
    torch.testing.assert_close(cache.read("s")[:, 0], keys, rtol=0, atol=0)
    cache.write(torch.zeros_like(keys), torch.zeros_like(keys), [-1, -1, -1])  # all padding
    torch.testing.assert_close(cache.read("s")[:, 0], keys, rtol=0, atol=0)


def test_copy_blocks_rejects_racing_or_out_of_range_pairs(cache):
    storage = cache.storage
    with pytest.raises(KernelError, match=r"block ids \[99\] are outside the pool's 2 blocks"):
        cache_ops.copy_blocks(storage, [(0, 99)])
    with pytest.raises(KernelError, match="both a source and a destination"):
        cache_ops.copy_blocks(storage, [(0, 1), (1, 0)])
    with pytest.raises(KernelError, match="a destination block appears twice"):
        cache.grow(2)
        cache_ops.copy_blocks(cache.storage, [(0, 2), (1, 2)])


def test_kernel_choice_is_logged_once_at_info_and_every_call_at_debug(cache, caplog, monkeypatch):
    monkeypatch.delenv("PONYTAIL_KERNELS", raising=False)
    monkeypatch.setattr(kernel_loader, "_logged", set())
    result = cache.allocate("s", [1, 2])
    keys, values = kv(tokens=2)
    with caplog.at_level(logging.DEBUG, logger="ponytail.kernels"):
        cache.write(keys, values, result.slots)
        cache.write(keys, values, result.slots)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    debugs = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert infos == ["write_slots: fallback (device is cpu, not CUDA)"]
    assert debugs == ["write_slots: fallback (device is cpu, not CUDA)"] * 2


def test_kernels_env_forces_or_rejects(monkeypatch):
    monkeypatch.setenv("PONYTAIL_KERNELS", "torch")
    assert kernel_loader.choose(torch.device("cpu")).reason == "PONYTAIL_KERNELS=torch"
    monkeypatch.setenv("PONYTAIL_KERNELS", "cupy")
    with pytest.raises(KernelError, match="PONYTAIL_KERNELS=cupy but the cache is on cpu, not a CUDA device"):
        kernel_loader.choose(torch.device("cpu"))
    monkeypatch.setenv("PONYTAIL_KERNELS", "triton")
    with pytest.raises(ConfigError, match="PONYTAIL_KERNELS='triton' is not supported; allowed: auto, cupy, torch"):
        kernel_loader.choose(torch.device("cpu"))


def test_every_cu_file_is_found_with_a_line_directive():
    source = kernel_loader.kernel_source("cache_ops.cu")
    assert source.startswith('#line 1 "') and 'cache_ops.cu"' in source.splitlines()[0]
    assert "PONYTAIL_CACHE_OPS(v16, uint4)" in source
