"""prefill_attention: which varlen kernel attends prompt chunks, and the errors for what cannot run."""

import pytest
import torch

import ponytail
from ponytail.attention.fa4 import choose_prefill_attention, fa4_problem
from transformers import LlamaConfig, LlamaForCausalLM

CPU = torch.device("cpu")


def test_unset_and_flash_take_torch_flash_on_the_cpu():
    assert choose_prefill_attention(None, CPU, torch.bfloat16, 128) == "flash"
    assert choose_prefill_attention("flash", CPU, torch.bfloat16, 128) == "flash"


def test_an_unknown_kernel_names_the_parameter_and_the_choices():
    with pytest.raises(ponytail.ConfigError) as caught:
        choose_prefill_attention("fa3", CPU, torch.bfloat16, 128)
    assert str(caught.value).startswith("prefill_attention='fa3' is not supported; allowed: 'flash', 'fa4' or None")


def test_fa4_where_it_cannot_run_says_why():
    with pytest.raises(ponytail.ConfigError) as caught:
        choose_prefill_attention("fa4", CPU, torch.bfloat16, 128)
    assert "prefill_attention='fa4' cannot run here: device is cpu, not CUDA" in str(caught.value)
    assert "pip install 'ponytail[fa4]'" in str(caught.value)


def test_fa4_problems_name_dtype_and_head_dim(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fa4_problem(cuda, torch.float32, 128) == "FlashAttention-4 takes fp16/bf16, got torch.float32"
    assert "head_dim a multiple of 8 from 8 to 256, got 100" in fa4_problem(cuda, torch.bfloat16, 100)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert fa4_problem(cuda, torch.bfloat16, 128).endswith("this device is sm8x")


def test_llm_refuses_fa4_on_the_cpu_before_building_its_pool():
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100)).eval()
    with pytest.raises(ponytail.ConfigError, match="prefill_attention='fa4' cannot run here"):
        ponytail.LLM(model, kv_cache_memory="4MiB", max_num_seqs=2, max_model_len=64, prefill_attention="fa4")


def test_app_args_take_only_the_kernels_there_are():
    from deployments.args import AppArgs

    assert AppArgs(prefill_attention="fa4").prefill_attention == "fa4"
    with pytest.raises(ValueError, match="prefill_attention") as caught:
        AppArgs(prefill_attention="fa3")
    assert "Input should be 'flash' or 'fa4'" in str(caught.value) and "'fa3'" in str(caught.value)
