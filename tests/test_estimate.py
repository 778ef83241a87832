"""KV-cache estimates: exact totals, block rounding, what fits in a GPU, and input checks."""

import dataclasses

import pytest
import torch

from ponytail.kv.config import CacheConfig
from ponytail.errors import ConfigError
from ponytail.kv.estimate import KVEstimate, describe_bytes, estimate_from_config, estimate_kv_cache

LLAMA_7B = dict(num_layers=32, num_kv_heads=32, head_dim=128, dtype="float16")


def test_llama_7b_eight_sequences_of_2048():
    est = estimate_kv_cache(**LLAMA_7B, max_batch_size=8, max_seq_len=2048)
    assert est.total_bytes == 8_589_934_592 == 2 * 32 * 32 * 128 * 2048 * 8 * 2
    assert est.total_bytes_blocks == est.total_bytes  # 2048 is a whole number of blocks
    assert est.bytes_per_token == 524_288
    assert est.tokens_per_seq_rounded == 2048
    assert est.dtype == "float16"
    assert (est.gpu_memory, est.max_concurrent_seqs) == (None, None)
    assert "total:               8,589,934,592 bytes (8.6 GB, 8.0 GiB)" in est.summary()
    assert describe_bytes(est.total_bytes) == "8,589,934,592 bytes (8.6 GB, 8.0 GiB)"


def test_sequences_round_up_to_whole_blocks():
    est = estimate_kv_cache(**LLAMA_7B, max_batch_size=2, max_seq_len=2049, block_size=16)
    assert est.tokens_per_seq_rounded == 2064
    assert est.total_bytes == 524_288 * 2049 * 2
    assert est.total_bytes_blocks == 524_288 * 2064 * 2
    assert "2 x 2,049 tokens (2,064 in blocks of 16)" in est.summary()


def test_gpu_memory_answers_concurrent_sequences():
    est = estimate_kv_cache(**LLAMA_7B, max_batch_size=1, max_seq_len=2048, gpu_memory="80GB")
    assert est.gpu_memory == 80 * 10**9
    assert est.max_concurrent_seqs == 80 * 10**9 // 2**30 == 74
    assert est.summary().splitlines()[-2] == (
        "  gpu memory:          80,000,000,000 bytes (80.0 GB, 74.5 GiB) holds 74 sequences "
        "of 2,048 tokens")
    # FP8 beside it: one byte an element, twice the tokens in the same memory.
    assert est.summary().splitlines()[-1] == (
        "  kv_cache_dtype=fp8: 262,144 bytes (262.1 KB, 256.0 KiB) per token, 2.00x the tokens, "
        "149 sequences in the same memory")
    fp8 = estimate_kv_cache(**LLAMA_7B, max_batch_size=1, max_seq_len=2048, gpu_memory="80GB", kv_cache_dtype="fp8")
    assert fp8.max_concurrent_seqs == 149 and fp8.bytes_per_token == 262_144
    assert "FP8 (kv_cache_dtype=fp8) for a float16 model (1 bytes)" in fp8.summary()
    assert fp8.summary().splitlines()[-1].startswith("  kv_cache_dtype=auto: 524,288 bytes")
    # Rounded sequences are what the pool holds: 2049 tokens take 2064 tokens of blocks.
    odd = estimate_kv_cache(**LLAMA_7B, max_batch_size=1, max_seq_len=2049,
                            gpu_memory=524_288 * 2064 * 3 - 1)
    assert odd.max_concurrent_seqs == 2
    assert estimate_kv_cache(**LLAMA_7B, max_batch_size=1, max_seq_len=2048,
                             gpu_memory="1MiB").max_concurrent_seqs == 0


def test_gqa_and_dtype_size():
    est = estimate_kv_cache(num_layers=2, num_kv_heads=3, head_dim=64, dtype=torch.float32,
                            max_batch_size=1, max_seq_len=10, block_size=8)
    assert est.bytes_per_token == 2 * 2 * 3 * 64 * 4
    assert (est.tokens_per_seq_rounded, est.total_bytes_blocks) == (16, 16 * 3072)
    assert est.summary().splitlines()[0] == (
        "KV cache: 2 layers x 3 KV heads x head_dim 64, float32 (4 bytes), K and V")


def test_estimate_from_config_matches_config():
    config = CacheConfig(**LLAMA_7B, max_batch_size=8, max_seq_len=2048, device="cpu",
                         num_heads=32)
    est = estimate_from_config(config, gpu_memory=2**34)
    assert est == estimate_kv_cache(**LLAMA_7B, max_batch_size=8, max_seq_len=2048,
                                    gpu_memory="16GiB")
    assert est.total_bytes_blocks == config.memory_budget
    assert est.max_concurrent_seqs == 16


def test_estimate_is_frozen_and_json_ready():
    est = estimate_kv_cache(**LLAMA_7B, max_batch_size=1, max_seq_len=16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        est.total_bytes = 0
    fields = [f.name for f in dataclasses.fields(KVEstimate)]
    assert list(est.to_dict()) == fields
    assert all(isinstance(v, (int, str, type(None))) for v in est.to_dict().values())


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(num_layers=0), "num_layers=0 is not positive; allowed: a positive int"),
        (dict(head_dim="128"), "head_dim='128' (str) is not an int; allowed: a positive int"),
        (dict(dtype="float17"), "dtype='float17' is not supported; allowed: bfloat16, float16"),
        (dict(block_size=12), "block_size=12 is not a power of two"),
        (dict(max_seq_len=-1), "max_seq_len=-1 is not positive"),
        (dict(gpu_memory="80 gigs"), "gpu_memory='80 gigs' is not a byte size; allowed:"),
        (dict(gpu_memory=0), "gpu_memory=0 is not positive"),
    ],
)
def test_invalid_inputs(changes, message):
    args = {**LLAMA_7B, "max_batch_size": 1, "max_seq_len": 2048, **changes}
    with pytest.raises(ConfigError) as err:
        estimate_kv_cache(**args)
    assert str(err.value).startswith(message)


def test_keyword_only():
    with pytest.raises(TypeError):
        estimate_kv_cache(32, 32, 128, "float16", 1, 2048)  # type: ignore[misc]


def test_a_device_capacity_and_a_kv_size_together_are_refused_by_name():
    from ponytail.kv.capacity import DeviceCapacity

    config = CacheConfig(**LLAMA_7B, max_batch_size=1, max_seq_len=2048, device="cpu")
    capacity = DeviceCapacity(device_memory=80 << 30, gpu_memory_utilization=None, num_parameters=1, weight_bytes=2,
                              step_headroom=0, kv_budget=1 << 30, kv_blocks=1, kv_tokens=16, max_concurrency=0.0)
    with pytest.raises(ConfigError, match=r"gpu_memory='40GiB' and a device's capacity were both given; allowed: one"):
        estimate_from_config(config, gpu_memory="40GiB", device=capacity)


def test_parameters_of_a_config_without_a_causal_lm_are_refused_by_name():
    from transformers import ViTConfig

    from ponytail.kv.capacity import count_parameters

    with pytest.raises(ConfigError, match=r"cannot count the model's parameters from its config \(ViTConfig\): "):
        count_parameters(ViTConfig())
