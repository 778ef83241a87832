"""Sliding-window models (Mistral, Gemma 3's local layers, Qwen 2 with use_sliding_window) past
their window, on the torch path: the plug-in's generate and the engine equal plain transformers
generate token for token (CPU, fp32). tests/test_gpu_sliding_window.py does the same on CUDA."""

import random

import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

import ponytail
from ponytail import SamplingParams

WINDOW = 16
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
             max_position_embeddings=512)


def window_models(shape: dict, window: int) -> dict:
    """Random-weight factories of the three windowed families at `shape` (tests/test_gpu_sliding_window.py's too)."""
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    return {
        "mistral": lambda: MistralForCausalLM(MistralConfig(**shape, num_hidden_layers=2, sliding_window=window)),
        # local, global, local: the global layer reads the whole row between two windowed ones
        "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
            **shape, num_hidden_layers=3, head_dim=head_dim, sliding_window=window, tie_word_embeddings=False,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
        # the first layer whole, the later ones windowed: layer 0 alone would not show the window
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**shape, num_hidden_layers=3, use_sliding_window=True,
                                                      sliding_window=window, max_window_layers=1)),
    }


MODELS = window_models(SMALL, WINDOW)


def make_model(name):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # no greedy near-ties on random weights (untied in every model here)
    return model


def without_window(model):
    """The same weights attending whole rows: the window moved past every length used here."""
    model.config.sliding_window = 10**6
    for layer in model.model.layers:
        if getattr(layer.self_attn, "sliding_window", None):
            layer.self_attn.sliding_window = 10**6
    return model


def plain_generate(model, ids, mask, new):
    model.set_attn_implementation("eager")
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None,
                          pad_token_id=0)


def left_padded(lengths, seed=1):
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(1, 128, (n,), generator=gen)
        mask[row, width - n:] = 1
    return ids, mask


@pytest.mark.parametrize("name", list(MODELS))
def test_plugin_generate_past_the_window_equals_plain_generate(name):
    ids, mask = left_padded([40, 5, 23, 2])  # prompts longer and shorter than the window, left padded
    expected = plain_generate(make_model(name), ids, mask, new=30)
    assert not torch.equal(plain_generate(without_window(make_model(name)), ids, mask, new=30), expected), \
        "the window changes nothing on these prompts: the test would not see it ignored"
    model = make_model(name)
    cache = ponytail.create_cache(model=model, max_batch_size=4, max_seq_len=96, block_size=4)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=None,
                         pad_token_id=0, cache=cache)
    assert torch.equal(got, expected), f"{name}: {got[:, ids.shape[1]:]} != {expected[:, ids.shape[1]:]}"


def engine_prompts():
    rng = random.Random(0)
    return [[rng.randrange(1, 128) for _ in range(n)] for n in (80, 3, 90, 17, 16, 33, 61, 8)]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 32, "max_num_seqs": 8},
                                      {"async_scheduling": True}], ids=["defaults", "chunked", "async"])
def test_engine_past_the_window_equals_plain_generate(name, settings):
    """Decode rows, chunks that start their sequence, chunks with context (a 32-token budget splits
    the prompts) and a prefix hit, each against the window."""
    prompts = engine_prompts()
    follow_up = prompts[0][:40] + [5, 6, 7]  # after the first batch: 40 tokens from the prefix cache
    reference = make_model(name)
    expected = [plain_generate(reference, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long),
                               new=30)[0, len(p):].tolist() for p in prompts + [follow_up]]
    llm = ponytail.LLM(make_model(name), kv_cache_memory="4MiB", max_model_len=256, block_size=4, **settings)
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, greedy) + llm.generate([follow_up], greedy)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert outputs[-1].num_cached_tokens == 40
