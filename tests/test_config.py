"""CacheConfig: normalization, derived sizes, every validation message, and from_model."""

import math

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from ponytail.kv.config import CacheConfig
from ponytail.errors import ConfigError

SMALL = dict(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float16", max_batch_size=3,
             max_seq_len=40, device="cpu")


def make(**changes):
    return CacheConfig(**{**SMALL, **changes})


def error(**changes) -> str:
    with pytest.raises(ConfigError) as err:
        make(**changes)
    return str(err.value)


# --- normalization and derived sizes -------------------------------------------------------


def test_derived_sizes():
    config = make()
    assert config.dtype is torch.float16
    assert config.num_heads == 4  # None -> num_kv_heads
    assert config.device == torch.device("cpu")
    assert config.dtype_size == 2
    assert config.bytes_per_token == 2 * 2 * 4 * 8 * 2 == 256
    assert config.block_bytes == 256 * 16
    assert config.blocks_per_seq == 3  # ceil(40 / 16)
    assert config.memory_budget == 3 * 3 * 256 * 16  # max_batch_size full sequences
    assert config.max_num_blocks == 9
    assert config.pool_chunk_blocks == 1  # 9 // 8: nine chunks of one block fill the budget (ceil(9 / 8) left one out)
    assert config.layer_block_elems == 16 * 4 * 8


def test_strings_are_normalized():
    config = make(dtype="bf16", memory_budget="1MiB", device=torch.device("cpu", 0))
    assert config.dtype is torch.bfloat16
    assert config.memory_budget == 1024 * 1024
    assert config.max_num_blocks == 1024 * 1024 // (256 * 16)
    assert config.device == torch.device("cpu")


def test_default_device_is_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert make(device=None).device == torch.device("cpu")


def test_chunk_blocks_given_and_capped():
    assert make(chunk_blocks=4).pool_chunk_blocks == 4
    assert make(chunk_blocks=100).pool_chunk_blocks == 9  # capped at max_num_blocks
    one_block = make(memory_budget=256 * 16)
    assert (one_block.max_num_blocks, one_block.pool_chunk_blocks) == (1, 1)


def test_defrag_threshold_int_becomes_float():
    assert make(defrag_threshold=1).defrag_threshold == 1.0
    assert isinstance(make(defrag_threshold=0).defrag_threshold, float)


# --- validation messages --------------------------------------------------------------------


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "max_batch_size",
                                   "max_seq_len", "block_size", "num_heads", "chunk_blocks"])
def test_sizes_must_be_positive_ints(field):
    assert error(**{field: 0}) == f"{field}=0 is not positive; allowed: a positive int"
    assert error(**{field: -3}) == f"{field}=-3 is not positive; allowed: a positive int"
    assert error(**{field: True}) == f"{field}=True (bool) is not an int; allowed: a positive int"
    assert error(**{field: "8"}) == f"{field}='8' (str) is not an int; allowed: a positive int"
    assert error(**{field: 8.0}) == f"{field}=8.0 (float) is not an int; allowed: a positive int"


def test_block_size_power_of_two():
    assert error(block_size=24) == (
        "block_size=24 is not a power of two; allowed: 1, 2, 4, 8, 16, 32, ...")
    assert make(block_size=1).blocks_per_seq == 40


def test_num_heads_multiple_of_num_kv_heads():
    assert make(num_heads=12).num_heads == 12
    assert error(num_heads=6) == (
        "num_heads=6 is not a multiple of num_kv_heads=4; allowed: a positive multiple of 4 "
        "(4, 8, 12, ...)")


def test_dtype_error():
    assert error(dtype="float17").startswith(
        "dtype='float17' is not supported; allowed: bfloat16, float16, float32")


def test_memory_budget_smaller_than_one_block():
    assert error(memory_budget="1KiB") == (
        "memory_budget='1KiB' (1,024 bytes) is smaller than one block of 4,096 bytes (16 tokens "
        "x 2 (K and V) x 2 layers x 4 KV heads x 8 head_dim x 2 bytes); "
        "allowed: at least 4096 bytes")
    assert error(memory_budget=0).startswith("memory_budget=0 is not positive")
    assert error(memory_budget="lots").startswith("memory_budget='lots' is not a byte size")


@pytest.mark.parametrize("value", [0, -1])
def test_chunk_blocks_non_positive(value):
    assert error(chunk_blocks=value).startswith(f"chunk_blocks={value} is not positive")


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), True, "0.2"])
def test_defrag_threshold_outside_unit_interval(value):
    assert error(defrag_threshold=value) == (
        f"defrag_threshold={value!r} is outside [0, 1]; allowed: a number from 0 to 1")


@pytest.mark.parametrize("value", ["tpu", "cuda:x", "mps", "meta", 0])
def test_unknown_device(value):
    assert error(device=value) == (
        f'device={value!r} is not a supported device; allowed: "cpu", "cuda", "cuda:N"')


def test_cuda_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert error(device="cuda") == (
        "device='cuda' but CUDA is not available here (torch.cuda.is_available() is False); "
        'allowed: "cpu"')


@pytest.fixture
def two_gpus(monkeypatch):
    """Pretend this machine has cuda:0 and cuda:1, cuda:1 current (nothing is allocated)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


def test_cuda_gets_an_index(two_gpus):
    assert make(device="cuda").device == torch.device("cuda", 1)
    assert make(device=None).device == torch.device("cuda", 1)
    assert make(device="cuda:0").device == torch.device("cuda", 0)
    assert error(device="cuda:5") == (
        "device='cuda:5' does not exist: this machine has 2 CUDA device(s); "
        'allowed: "cpu", "cuda", "cuda:0" to "cuda:1"')


# --- from_model -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol():
    """A SmolLM2-shaped Llama: 9 query heads, 3 KV heads of 64, random weights."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=2,
        intermediate_size=64, vocab_size=128, max_position_embeddings=512))


def test_from_llama_model(smol):
    config = CacheConfig.from_model(smol)
    shape = (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim)
    assert shape == (2, 9, 3, 64)
    assert config.dtype is torch.float32
    assert config.device == torch.device("cpu")
    assert (config.max_seq_len, config.max_batch_size, config.block_size) == (512, 1, 16)
    assert config.memory_budget == 32 * config.block_bytes


def test_from_model_free_overrides_apply(smol):
    config = CacheConfig.from_model(
        smol, max_batch_size=4, max_seq_len=100, block_size=32, memory_budget="1MiB",
        chunk_blocks=2, defrag_threshold=0.5, device="cpu")
    assert (config.max_batch_size, config.max_seq_len, config.block_size) == (4, 100, 32)
    assert (config.memory_budget, config.chunk_blocks, config.defrag_threshold) == (2**20, 2, 0.5)


def test_from_model_agreeing_shape_overrides_and_none(smol):
    config = CacheConfig.from_model(smol, num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64,
                                    dtype="fp32", max_seq_len=None)
    assert config.max_seq_len == 512


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (dict(num_heads=8), "num_heads=8 does not match the model (LlamaForCausalLM): "
                            "it has num_attention_heads=9"),
        (dict(dtype="float16"), "dtype=float16 does not match the model (LlamaForCausalLM): "
                                "its weights are float32"),
        (dict(dtype=torch.bfloat16), "dtype=bfloat16 does not match the model "
                                     "(LlamaForCausalLM): its weights are float32"),
        (dict(head_dim=128), "head_dim=128 does not match the model (LlamaForCausalLM): "
                             "it has head_dim=64"),
        (dict(num_layers=32), "num_layers=32 does not match the model (LlamaForCausalLM): "
                              "it has num_hidden_layers=2"),
        (dict(num_kv_heads=9), "num_kv_heads=9 does not match the model (LlamaForCausalLM): "
                               "it has num_key_value_heads=3"),
        (dict(num_kv_heads="3"), "num_kv_heads='3' (str) is not an int; allowed: a positive int"),
        (dict(dtype="fp8"), "dtype='fp8' is not supported; allowed: bfloat16"),
        (dict(max_seq_len=0), "max_seq_len=0 is not positive"),
    ],
)
def test_from_model_disagreeing_overrides(smol, override, message):
    with pytest.raises(ConfigError) as err:
        CacheConfig.from_model(smol, **override)
    assert str(err.value).startswith(message)


def test_from_model_unknown_override(smol):
    with pytest.raises(ConfigError) as err:
        CacheConfig.from_model(smol, max_tokens=5, layers=2)
    assert str(err.value) == (
        "unknown override layers=2, max_tokens=5; allowed: num_layers, num_heads, num_kv_heads, "
        "head_dim, dtype, max_batch_size, max_seq_len, block_size, memory_budget, device, "
        "chunk_blocks, defrag_threshold, kv_cache_dtype")


def test_from_model_device_must_match(smol, two_gpus):
    with pytest.raises(ConfigError) as err:
        CacheConfig.from_model(smol, device="cuda:0")
    assert str(err.value) == (
        "device='cuda:0' does not match the model (LlamaForCausalLM): its weights are on cpu, "
        "and the cache must live on the model's device")


def test_from_model_takes_dtype_from_weights():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
        intermediate_size=32, vocab_size=64, max_position_embeddings=256)).to(torch.bfloat16)
    config = CacheConfig.from_model(model, dtype="bf16")
    assert config.dtype is torch.bfloat16
    shape = (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim)
    assert shape == (3, 4, 2, 16)
    with pytest.raises(ConfigError, match=r"^dtype=fp32 does not match the model "
                                          r"\(Qwen2ForCausalLM\): its weights are bfloat16$"):
        CacheConfig.from_model(model, dtype="fp32")


def test_from_model_unsupported_or_split_weights():
    model = Qwen2ForCausalLM(Qwen2Config(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
        intermediate_size=16, vocab_size=32))
    with pytest.raises(ConfigError) as err:
        CacheConfig.from_model(model.to(torch.float64))
    assert str(err.value) == ("the model (Qwen2ForCausalLM) has weights of dtype float64, which "
                              "ponytail does not support; allowed: bfloat16, float16, float32")
    model.lm_head.to("meta")
    with pytest.raises(ConfigError, match=r"has weights on several devices \(cpu, meta\)"):
        CacheConfig.from_model(model)


def test_mistral_explicit_head_dim():
    config = MistralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           num_hidden_layers=2, intermediate_size=32, vocab_size=64, head_dim=32,
                           max_position_embeddings=1024)
    model = MistralForCausalLM(config)
    assert CacheConfig.from_model(model).head_dim == 32  # not hidden_size // heads = 16
    with pytest.raises(ConfigError) as err:
        CacheConfig.from_model(model, head_dim=16)
    assert str(err.value) == ("head_dim=16 does not match the model (MistralForCausalLM): "
                              "it has head_dim=32")


def test_from_pretrained_config():
    qwen = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=2, max_position_embeddings=300, dtype="bfloat16")
    config = CacheConfig.from_model(qwen, device="cpu")
    assert (config.head_dim, config.dtype, config.max_seq_len) == (16, torch.bfloat16, 300)
    assert config.blocks_per_seq == math.ceil(300 / 16)
    with pytest.raises(ConfigError) as err:
        CacheConfig.from_model(qwen, head_dim=64)
    assert str(err.value) == ("head_dim=64 does not match the model (Qwen2Config): it has "
                              "head_dim=16 (hidden_size=64 // num_attention_heads=4)")
    with pytest.raises(ConfigError, match=r"its config has dtype bfloat16$"):
        CacheConfig.from_model(qwen, dtype="float16")


def test_config_without_dtype_defaults_to_float32_and_takes_override():
    llama = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                        architectures=["LlamaForCausalLM"])
    assert llama.dtype is None
    assert CacheConfig.from_model(llama, device="cpu").dtype is torch.float32
    config = CacheConfig.from_model(llama, device="cpu", dtype="fp16")
    assert config.dtype is torch.float16
    assert config.num_kv_heads == 4  # num_key_value_heads defaults to num_attention_heads
    with pytest.raises(ConfigError, match=r"^num_heads=2 does not match the model "
                                          r"\(LlamaForCausalLM\): it has num_attention_heads=4$"):
        CacheConfig.from_model(llama, num_heads=2)


def test_multimodal_config_uses_text_config():
    text = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                       num_hidden_layers=5, max_position_embeddings=128)
    config = CacheConfig.from_model(LlavaConfig(text_config=text.to_dict()), device="cpu")
    assert (config.num_layers, config.num_kv_heads, config.head_dim, config.max_seq_len) == (
        5, 1, 16, 128)


def test_missing_attributes():
    empty = PretrainedConfig()
    with pytest.raises(ConfigError) as err:
        CacheConfig.from_model(empty)
    assert str(err.value) == (f"the model ({type(empty).__name__}) has no num_hidden_layers in "
                              "its config; CacheConfig.from_model needs it")
    bare = PretrainedConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64)
    with pytest.raises(ConfigError, match=r"has no max_position_embeddings .*; pass max_seq_len="):
        CacheConfig.from_model(bare, device="cpu")
    assert CacheConfig.from_model(bare, device="cpu", max_seq_len=64).head_dim == 16
    odd = PretrainedConfig(num_hidden_layers=2, num_attention_heads=3, hidden_size=64)
    with pytest.raises(ConfigError, match=r"hidden_size=64 is not a multiple of "
                                          r"num_attention_heads=3"):
        CacheConfig.from_model(odd, max_seq_len=64)


def test_from_model_rejects_other_objects():
    with pytest.raises(ConfigError) as err:
        CacheConfig.from_model({"num_hidden_layers": 2})
    assert str(err.value) == ("model_or_config=dict object is not supported; allowed: a "
                              "transformers PreTrainedModel or PretrainedConfig")


def test_the_pools_chunks_leave_less_than_their_count_of_the_budget_unused():
    """Chunks sized by rounding down: what fits of the budget in whole chunks misses fewer blocks than
    there are chunks (rounding up missed up to a chunk: 1.6% of an 80 GB card's pool at 64)."""
    from ponytail.kv.config import growth_chunk_blocks

    for steps in (8, 64):
        for blocks in range(1, 9000):
            chunk = growth_chunk_blocks(blocks, steps)
            fitted = blocks // chunk * chunk
            assert blocks - steps < fitted <= blocks and blocks // chunk < 2 * steps
    assert growth_chunk_blocks(7060, 64) == 110  # the H100 7B pool of lease 63: 64 chunks, 7,040 blocks
