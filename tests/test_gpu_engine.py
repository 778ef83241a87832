"""The engine on a GPU (CuPy kernels forced): greedy output equals plain generate in fp32."""

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ponytail
from ponytail import SamplingParams

pytestmark = pytest.mark.gpu


def test_engine_greedy_equals_plain_generate_on_gpu(monkeypatch):
    monkeypatch.setenv("PONYTAIL_KERNELS", "cupy")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).to("cuda").eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 1000) for _ in range(rng.randint(5, 300))] for _ in range(12)]
    expected = []
    for p in prompts:
        out = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    llm = ponytail.LLM(model, kv_cache_memory="64MiB", max_num_seqs=8, max_model_len=512,
                       max_num_batched_tokens=512)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected
    assert llm.stats().used_blocks == 0 and llm.engine.cache.invariants() == []
