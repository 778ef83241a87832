"""Prompt logprobs come from the engine's own forward pass and equal plain transformers' (CPU, fp32)."""

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ponytail
from ponytail import ConfigError, SamplingParams

VOCAB = 256


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


def plain_log_softmax(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 log_softmax of a plain transformers forward (sdpa, no cache)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    finally:
        model.set_attn_implementation(previous)


def prompts(n, seed=0, low=2, high=40):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(low, high))] for _ in range(n)]


def check_against_plain(model, prompt, entries, k):
    reference = plain_log_softmax(model, prompt)
    assert len(entries) == len(prompt) and entries[0] is None
    for position, entry in enumerate(entries[1:]):
        token = prompt[position + 1]
        expected = reference[position]
        assert entry[token] == pytest.approx(expected[token].item(), abs=1e-4)
        top = expected.topk(k)
        assert set(top.indices.tolist()) <= set(entry)
        assert len(entry) in (k, k + 1)  # the prompt token, and the top k (it may be among them)
        for token_id, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[token_id] == pytest.approx(value, abs=1e-4)


@pytest.mark.parametrize("chunk_budget", [None, 7])  # whole prompts in one step; chunked prefill
def test_prompt_logprobs_equal_plain_log_softmax(model, chunk_budget):
    llm = ponytail.LLM(model, kv_cache_memory="4MiB", block_size=4, max_num_seqs=5, max_model_len=128,
                       max_num_batched_tokens=chunk_budget)
    batch = prompts(5)
    params = [SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=k, logprobs=1) for k in (0, 1, 3, 5, 2)]
    plain = SamplingParams(max_tokens=3, temperature=0)
    outputs = llm.generate(batch + batch[:1], params + [plain])
    for prompt, out, p in zip(batch, outputs, params):
        check_against_plain(model, prompt, out.prompt_logprobs, p.prompt_logprobs)
    assert outputs[-1].prompt_logprobs is None
    assert outputs[-1].token_ids == outputs[0].token_ids  # scoring the prompt changes no sample


def test_prompt_logprobs_skip_the_prefix_cache_but_fill_it(model):
    llm = ponytail.LLM(model, kv_cache_memory="4MiB", block_size=4, max_num_seqs=8, max_model_len=128)
    prompt = prompts(1, seed=3, low=30, high=30)[0]
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0))  # its full blocks are now cached
    out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))[0]
    assert out.metrics.num_cached_prompt_tokens == 0  # every prompt position had to be computed
    check_against_plain(model, prompt, out.prompt_logprobs, 2)
    again = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0))[0]
    assert again.metrics.num_cached_prompt_tokens == 28


def test_prompt_logprobs_with_a_one_token_prompt(model):
    llm = ponytail.LLM(model, kv_cache_memory="4MiB", block_size=4, max_num_seqs=8, max_model_len=128)
    out = llm.generate([[5]], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))[0]
    assert out.prompt_logprobs == [None]


@pytest.mark.parametrize("value, message", [
    (-1, "prompt_logprobs=-1 is invalid; allowed: None or an integer in [0, 20]"),
    (21, "prompt_logprobs=21 is invalid; allowed: None or an integer in [0, 20]"),
    (True, "prompt_logprobs=True (bool) is invalid"),
])
def test_bad_prompt_logprobs_name_the_field(value, message):
    with pytest.raises(ConfigError) as info:
        SamplingParams(prompt_logprobs=value)
    assert str(info.value).startswith(message)
