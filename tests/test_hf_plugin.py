"""The transformers plug-in: model.generate with a Ponytail cache equals plain generate (CPU, fp32)."""

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

import ponytail
from ponytail import ConfigError

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SMALL)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SMALL, sliding_window=None)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=16)),
    "llama-mha": lambda: LlamaForCausalLM(LlamaConfig(**{**SMALL, "num_key_value_heads": 4})),
}


def make_model(name, seed=0):
    torch.manual_seed(seed)
    model = MODELS[name]().eval()
    # Random weights give nearly flat logits; sharpen them so greedy ties cannot flip tokens.
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    return model


def prompts(batch, seed=1, lengths=(9, 5, 13, 2)):
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths[:batch])
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for row, n in enumerate(lengths[:batch]):
        ids[row, width - n:] = torch.randint(1, 128, (n,), generator=gen)  # left padded
        mask[row, width - n:] = 1
    return ids, mask


def generate(model, ids, mask, cache=None, new=12):
    kwargs = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    if cache is not None:
        kwargs["cache"] = cache
    return model.generate(ids, **kwargs)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_generate_equals_plain_generate(name, batch):
    model = make_model(name)
    ids, mask = prompts(batch)
    expected = generate(model, ids, mask)
    cache = ponytail.create_cache(model=model, max_batch_size=4, max_seq_len=64, block_size=4)
    got = generate(model, ids, mask, cache)
    assert torch.equal(got, expected), f"{name}: {got[:, ids.shape[1]:]} != {expected[:, ids.shape[1]:]}"
    # Padding is never stored: each row holds its own prompt plus the tokens fed back so far.
    lengths = [cache.paged.seq_len(r) for r in range(batch)]
    assert lengths == [int(n) + got.shape[1] - ids.shape[1] - 1 for n in mask.sum(dim=1)]
    assert cache.stats().used_blocks == sum(-(-n // 4) for n in lengths)
    assert cache.paged.invariants() == []


def test_logits_match_plain_forward_in_decode():
    model = make_model("llama")
    ids, mask = prompts(4)
    cache = ponytail.create_cache(model=model, max_batch_size=4, max_seq_len=64, block_size=4)
    ours = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                          cache=cache, output_logits=True, return_dict_in_generate=True)
    model.set_attn_implementation("sdpa")
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                           output_logits=True, return_dict_in_generate=True)
    for a, b in zip(ours.logits, plain.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_cache_reset_allows_a_new_batch_and_returns_blocks():
    model = make_model("llama")
    expected = generate(model, *prompts(4))
    cache = ponytail.create_cache(model=model, max_batch_size=4, max_seq_len=64, block_size=4)
    generate(model, *prompts(2), cache)
    with pytest.raises(ConfigError, match="the cache holds 2 rows but this call has 4; call cache.reset()"):
        generate(model, *prompts(4), cache)
    cache.reset()
    assert cache.stats().used_blocks == 0
    assert torch.equal(generate(model, *prompts(4), cache), expected)


@pytest.mark.parametrize("field, value, message", [
    ("num_layers", 2, "num_layers=2 does not match the model"),
    ("num_kv_heads", 4, "num_kv_heads=4 does not match the model"),
    ("head_dim", 32, "head_dim=32 does not match the model"),
    ("dtype", "bfloat16", "dtype=bfloat16 does not match the model"),
    ("num_heads", 8, "num_heads=8 does not match the model"),
])
def test_create_cache_refuses_values_that_disagree_with_the_model(field, value, message):
    model = make_model("llama")
    with pytest.raises(ConfigError, match=message):
        ponytail.create_cache(model=model, max_batch_size=2, max_seq_len=64, **{field: value})


@pytest.mark.parametrize("other, message", [
    (dict(num_layers=2), "this cache was built with num_layers=2, but the model has num_layers=3"),
    (dict(num_kv_heads=4), "this cache was built with num_kv_heads=4, but the model has num_kv_heads=2"),
    (dict(head_dim=8), "this cache was built with head_dim=8, but the model has head_dim=16"),
    (dict(dtype="bfloat16"), "this cache was built with dtype=torch.bfloat16, but the model computes K/V in torch.float32"),
])
def test_a_cache_for_another_model_fails_before_any_token(other, message):
    model = make_model("llama")
    shape = dict(num_layers=3, num_kv_heads=2, head_dim=16, dtype="float32")
    cache = ponytail.create_cache(max_batch_size=2, max_seq_len=64, device="cpu", **{**shape, **other})
    model.set_attn_implementation("ponytail")
    ids, mask = prompts(2)
    with pytest.raises(ConfigError, match=message):
        generate(model, ids, mask, cache)
    assert cache.stats().used_blocks == 0  # refused before anything was allocated


def test_a_model_not_using_ponytail_attention_is_refused():
    model = make_model("llama")
    cache = ponytail.create_cache(max_batch_size=2, max_seq_len=64, num_layers=3, num_kv_heads=2, head_dim=16,
                                  dtype="float32", device="cpu")
    with pytest.raises(ConfigError, match="needs attn_implementation='ponytail'"):
        generate(model, *prompts(2), cache)


def test_ponytail_attention_without_a_ponytail_cache_is_refused():
    model = make_model("llama")
    model.set_attn_implementation("ponytail")
    with pytest.raises(ConfigError, match="attn_implementation='ponytail' needs a Ponytail cache"):
        generate(model, *prompts(2))


def test_limits_are_clear_errors():
    model = make_model("llama")
    cache = ponytail.create_cache(model=model, max_batch_size=2, max_seq_len=16, block_size=4)
    with pytest.raises(ConfigError, match="batch of 4 rows exceeds the cache's max_batch_size=2"):
        generate(model, *prompts(4), cache)
    cache = ponytail.create_cache(model=model, max_batch_size=2, max_seq_len=16, block_size=4)
    with pytest.raises(ConfigError, match=r"exceed the cache's max_seq_len=16"):
        generate(model, *prompts(2), cache, new=20)


def test_create_cache_shapes():
    cache = ponytail.create_cache(max_batch_size=8, max_seq_len=4096, num_layers=32, num_heads=32, head_dim=128,
                                  dtype="bfloat16", device="cpu", memory_budget="64MiB")
    c = cache.config
    assert (c.num_layers, c.num_kv_heads, c.head_dim, c.dtype) == (32, 32, 128, torch.bfloat16)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=576, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=9, num_key_value_heads=3, vocab_size=64))
    cache = ponytail.create_cache(model=model, max_batch_size=4, max_seq_len=256)
    c = cache.config
    assert (c.num_layers, c.num_kv_heads, c.head_dim, c.device) == (2, 3, 64, torch.device("cpu"))
    assert model.config._attn_implementation == "ponytail"
    with pytest.raises(ConfigError, match=r"num_heads=8 does not match the model .*num_attention_heads=9"):
        ponytail.create_cache(model=model, max_batch_size=4, max_seq_len=256, num_heads=8)
    with pytest.raises(ConfigError, match=r"dtype=float16 does not match the model .*float32"):
        ponytail.create_cache(model=model, max_batch_size=4, max_seq_len=256, dtype="float16")


def test_a_failed_call_leaves_the_cache_usable():
    model = make_model("llama")
    expected = generate(model, *prompts(2))
    cache = ponytail.create_cache(model=model, max_batch_size=2, max_seq_len=64, block_size=4)
    with pytest.raises(ConfigError, match="max_batch_size=2"):
        generate(model, *prompts(4), cache)
    assert torch.equal(generate(model, *prompts(2), cache), expected)


@pytest.mark.parametrize("name, words", [("gemma2", "softcapping"), ("gpt_oss", "attention sinks")])
def test_softcapping_and_attention_sinks_are_refused_not_ignored(name, words):
    """Both change the softmax; answering without them would be garbage that looks like text."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    if name == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(**SMALL, head_dim=16, attn_logit_softcapping=50.0,
                                               sliding_window=64))
    else:
        model = GptOssForCausalLM(GptOssConfig(**SMALL, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                               sliding_window=64))
    cache = ponytail.create_cache(model=model.eval(), max_batch_size=2, max_seq_len=64)
    with pytest.raises(NotImplementedError, match=words):
        generate(model, *prompts(2), cache)
    assert cache.stats().used_blocks == 0


@pytest.mark.network
def test_default_model_greedy_equals_plain_generate_single_and_left_padded(default_model):
    model, tokenizer = default_model
    questions = ["What is the capital of France?", "Name three colors.", "Hi"]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in questions]
    single = tokenizer(chats[:1], return_tensors="pt")
    batch = tokenizer(chats, return_tensors="pt", padding=True)  # left padded
    assert (batch["attention_mask"] == 0).any()
    settings = dict(max_new_tokens=16, do_sample=False)
    original = model.config._attn_implementation
    try:
        expected = [model.generate(**single, **settings), model.generate(**batch, **settings)]
        for inputs, want in zip((single, batch), expected):
            cache = ponytail.create_cache(model=model, max_batch_size=4, max_seq_len=256)
            got = model.generate(**inputs, cache=cache, **settings)
            assert torch.equal(got, want), tokenizer.batch_decode(got[:, inputs["input_ids"].shape[1]:])
        answer = tokenizer.decode(got[0, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        assert "Paris" in answer
    finally:
        model.set_attn_implementation(original)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize("batch", [1, 2])
def test_beam_search_equals_plain_generate(name, batch):
    """num_beams and num_return_sequences: the same sequences and scores as plain generate."""
    model = make_model(name)
    ids, mask = prompts(batch)
    settings = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, num_beams=3,
                    num_return_sequences=2, return_dict_in_generate=True, output_scores=True)
    expected = model.generate(ids, **settings)
    cache = ponytail.create_cache(model=model, max_batch_size=3 * batch, max_seq_len=64, block_size=4)
    got = model.generate(ids, cache=cache, **settings)
    assert torch.equal(got.sequences, expected.sequences), f"{got.sequences} != {expected.sequences}"
    torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, rtol=1e-4, atol=1e-4)
    assert len(set(map(tuple, got.sequences.tolist()))) > 1  # the beams went different ways
    cache.reset()
    assert cache.stats().used_blocks == 0 and cache.paged.invariants() == []


def test_beams_hold_their_shared_prompt_once():
    model = make_model("llama")
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 128, (1, 40), generator=gen)
    cache = ponytail.create_cache(model=model, max_batch_size=4, max_seq_len=64, block_size=4)
    model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False, pad_token_id=0, num_beams=4)
    # 4 rows of 51 tokens would need 4 x 13 blocks apart; the 10 full prompt blocks are held once,
    # and each beam owns at most its 11 new tokens' blocks (3) and one the prompt's end shares.
    assert cache.stats().used_blocks <= 10 + 4 * 4 < 4 * 13
    assert [cache.paged.seq_len(row) for row in range(4)] == [51] * 4
    assert cache.paged.invariants() == []


def test_rows_are_repeated_and_selected_with_their_kv():
    model = make_model("llama")
    ids, mask = prompts(2)
    cache = ponytail.create_cache(model=model, max_batch_size=6, max_seq_len=64, block_size=4)
    generate(model, ids, mask, cache, new=5)
    held = [cache.paged.read(row) for row in range(2)]
    cache.batch_repeat_interleave(3)
    assert cache.batch_size == 6
    for row in range(6):
        assert torch.equal(cache.paged.read(row), held[row // 3])
    cache.batch_select_indices(torch.tensor([5, 0]))
    assert cache.batch_size == 2
    assert torch.equal(cache.paged.read(0), held[1]) and torch.equal(cache.paged.read(1), held[0])
    assert cache.stats().used_blocks == sum(-(-cache.paged.seq_len(row) // 4) for row in range(2))
    assert cache.paged.invariants() == []


@pytest.mark.parametrize("call, message", [
    (lambda c: c.reorder_cache(torch.tensor([0, 2])),
     r"beam_idx=\[0, 2\] is not supported; allowed: row numbers in \[0, 2\) of the cache's 2 rows, at least one"),
    (lambda c: c.batch_select_indices([]), r"indices=\[\] is not supported; allowed: row numbers in \[0, 2\)"),
    (lambda c: c.batch_repeat_interleave(4), r"repeats asks for 8 rows; the cache's max_batch_size is 4: raise it"),
    (lambda c: c.batch_repeat_interleave(0), r"repeats=0 is not supported; allowed: an integer >= 1"),
    (lambda c: c.crop(2), r"tokens_to_remove=2 is not supported; allowed: 0 or a negative integer"),
    (lambda c: c.crop(-99), r"tokens_to_remove=-99 asks to forget more than the rows hold"),
    (lambda c: (c.batch_select_indices([1, 0]), c.crop(-1)),
     r"assisted decoding \(crop\) after rows were forked \(beam search, repeated rows\) is not supported"),
])
def test_row_changes_that_cannot_work_are_refused_and_change_nothing(call, message):
    model = make_model("llama")
    cache = ponytail.create_cache(model=model, max_batch_size=4, max_seq_len=64, block_size=4)
    generate(model, *prompts(2), cache, new=3)
    before = [cache.paged.read(row) for row in range(2)]
    with pytest.raises((ConfigError, NotImplementedError), match=message):
        call(cache)
    assert cache.batch_size == 2 and sorted(cache.paged.read(r).sum().item() for r in range(2)) == \
        sorted(b.sum().item() for b in before)  # rows as they were (a refused crop after a swap keeps the swap)


def test_assisted_decoding_equals_plain_generate():
    """Prompt lookup and a draft model propose tokens the model checks in one pass; crop() forgets
    the ones it rejects, and their slots take the next tokens: greedy output unchanged."""
    model, draft = make_model("llama"), make_model("llama", seed=7)
    gen = torch.Generator().manual_seed(4)
    motif = torch.randint(1, 128, (6,), generator=gen)
    ids = torch.cat([motif, torch.randint(1, 128, (5,), generator=gen), motif, motif[:3]])[None]
    expected = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    for assist in (dict(prompt_lookup_num_tokens=4), dict(assistant_model=draft)):
        cache = ponytail.create_cache(model=model, max_batch_size=1, max_seq_len=64, block_size=4)
        crops = []
        original = cache.crop
        cache.crop = lambda n: (crops.append(n), original(n))[1]
        got = model.generate(ids, cache=cache, max_new_tokens=24, do_sample=False, pad_token_id=0, **assist)
        assert torch.equal(got, expected), f"{assist}: {got[0, ids.shape[1]:]} != {expected[0, ids.shape[1]:]}"
        assert any(n < 0 for n in crops), f"{assist}: no candidate was ever rejected ({crops})"
        assert cache.paged.invariants() == []
