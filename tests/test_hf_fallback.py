"""After create_cache(model=model), the model without a Ponytail cache runs exactly as before (CPU, fp32)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import ponytail
from ponytail import ConfigError
from ponytail.attention import hf_fallback

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)


def make_model(kind: str, attn: str):
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SMALL, attn_implementation=attn))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=16, attn_implementation=attn))
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # sharp logits: greedy ties cannot flip tokens
    return model.eval()


def left_padded():
    ids = torch.tensor([[0, 0, 0, 5, 17, 99, 3], [11, 42, 7, 8, 9, 120, 64]])
    return ids, (ids != 0).long()


def run_plain(model):
    """Everything a user does without a Ponytail cache: forward (padded or not) and generate."""
    ids, mask = left_padded()
    with torch.no_grad():
        return {
            "forward": model(ids[1:]).logits,
            "forward_padded": model(ids, attention_mask=mask).logits,
            "generate": model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                       pad_token_id=0),
        }


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_plain_forward_and_generate_unchanged_after_create_cache(kind, attn):
    model = make_model(kind, attn)
    before = run_plain(model)
    cache = ponytail.create_cache(model=model, max_batch_size=2, max_seq_len=64, block_size=4)
    assert model.config._attn_implementation == "ponytail"
    assert hf_fallback.previous_implementation(model.config) == attn
    after = run_plain(model)
    for name in before:
        assert torch.equal(after[name], before[name]), name
    # The Ponytail cache still works, and the plain path keeps working after it.
    ids, mask = left_padded()
    with_cache = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                cache=cache)
    assert torch.equal(with_cache, before["generate"])
    again = run_plain(model)
    assert torch.equal(again["generate"], before["generate"])


def test_a_second_create_cache_keeps_the_first_recorded_implementation():
    model = make_model("llama", "eager")
    ponytail.create_cache(model=model, max_batch_size=1, max_seq_len=32)
    ponytail.create_cache(model=model, max_batch_size=1, max_seq_len=32)  # previous is "ponytail" now
    assert hf_fallback.previous_implementation(model.config) == "eager"


def test_without_a_recorded_implementation_the_error_says_what_to_pass():
    model = make_model("llama", "sdpa")
    model.set_attn_implementation("ponytail")  # by hand: nothing recorded
    with pytest.raises(ConfigError, match=r"needs a Ponytail cache: pass cache=ponytail.create_cache"):
        model(torch.tensor([[1, 2, 3]]))


def test_the_engine_forgets_the_fallback_it_does_not_use():
    model = make_model("llama", "sdpa")
    ponytail.create_cache(model=model, max_batch_size=1, max_seq_len=32)
    hf_fallback.switch_to_ponytail(model, "ponytail", keep_fallback=False)
    assert hf_fallback.previous_implementation(model.config) is None
