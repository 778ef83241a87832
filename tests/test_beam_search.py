"""LLM.beam_search (vLLM's): plain transformers beam search where the two define the same search,
an independent reference where they differ (EOS, vLLM's length penalty), and clear refusals."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ponytail
from ponytail import BeamSearchParams, ConfigError

VOCAB = 128
EOS = 96  # a token the model below often ranks high, so some beams end on it


@pytest.fixture
def model():
    """A fresh model each test: LLM() switches the model it is given to its own attention for good."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10)  # sharper logits: no float near-ties between candidates
    return model


def prompts():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (21, 6)]


def engine(model, eos=None):
    model.generation_config.eos_token_id = eos
    return ponytail.LLM(model, kv_cache_memory="64MiB", max_num_seqs=32, block_size=4)


def test_without_eos_it_is_transformers_beam_search(model):
    """Every beam ends at max_tokens: both keep the beam_width best of all continuations a step."""
    plains = [model.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3, max_new_tokens=8,
                             do_sample=False, pad_token_id=0, eos_token_id=None, length_penalty=0.0,
                             return_dict_in_generate=True, output_scores=True) for prompt in prompts()]
    llm = engine(model)
    got = llm.beam_search(prompts(), BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
    for plain, output in zip(plains, got):
        assert [s.tokens for s in output.sequences] == plain.sequences.tolist()
        assert [s.cum_logprob for s in output.sequences] == pytest.approx(plain.sequences_scores.tolist(), abs=1e-4)
        assert {s.finish_reason for s in output.sequences} == {"length"}
        assert all(len(s.logprobs) == 8 and len(s.logprobs[0]) >= 6 for s in output.sequences)
    stats = llm.stats()
    assert stats.used_blocks == 0 and stats.num_running == 0  # nothing held after the search
    assert stats.prefix_cache_hits > 0  # the beams' steps found their prefixes cached


def reference(model, prompt, width, max_tokens, length_penalty):
    """The search as documented, over the model's full log-softmax (no engine, no cache)."""
    def score(tokens, total):
        return total / ((len(tokens) - (tokens[-1] == EOS)) ** length_penalty)

    live, done = [(prompt, 0.0)], []
    for _ in range(max_tokens):
        children = []
        for tokens, total in live:
            with torch.no_grad():
                logprobs = model(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
            top = logprobs.topk(2 * width)
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                (done if token == EOS else children).append((tokens + [token], total + value))
        live = sorted(children, key=lambda c: score(*c), reverse=True)[:width]
    return sorted(done + live, key=lambda c: score(*c), reverse=True)[:width]


@pytest.mark.parametrize("length_penalty", [1.0, 0.3])
def test_eos_ends_a_beam_and_the_length_penalty_ranks_them(model, length_penalty):
    references = [reference(model, prompt, 3, 10, length_penalty) for prompt in prompts()]
    llm = engine(model, eos=EOS)
    got = llm.beam_search(prompts(), BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=length_penalty))
    ended = 0
    for expected, output in zip(references, got):
        assert [s.tokens for s in output.sequences] == [tokens for tokens, _ in expected]
        assert [s.cum_logprob for s in output.sequences] == pytest.approx([t for _, t in expected], abs=1e-4)
        for sequence in output.sequences:
            assert (sequence.finish_reason, sequence.stop_reason) == (
                ("stop", EOS) if sequence.tokens[-1] == EOS else ("length", None))
            ended += sequence.tokens[-1] == EOS
    assert ended > 0  # EOS mattered here


def test_texts_concurrency_limit_and_cache_salt(tiny_model):
    model, tokenizer = tiny_model
    llm = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="64MiB", max_num_seqs=32)
    params = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True)
    asked = ["The capital of France is", {"prompt": "Hi", "cache_salt": "tenant-a"}]
    together = llm.beam_search(asked, params)
    one_at_a_time = llm.beam_search(asked, params, concurrency_limit=1, use_tqdm=True)
    assert [[s.tokens for s in o.sequences] for o in together] == [[s.tokens for s in o.sequences]
                                                                   for o in one_at_a_time]
    for text, output in zip(["The capital of France is", "Hi"], together):
        prompt_ids = tokenizer(text)["input_ids"]
        for sequence in output.sequences:
            assert sequence.tokens[: len(prompt_ids)] == prompt_ids
            assert sequence.text == tokenizer.decode(sequence.tokens[len(prompt_ids):], skip_special_tokens=True)
    assert llm.stats().used_blocks == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(beam_width=0, max_tokens=4), "beam_width=0 is not supported; allowed: an integer from 1 to 10"),
    (dict(beam_width=11, max_tokens=4), "beam_width=11 is not supported; allowed: an integer from 1 to 10"),
    (dict(beam_width=True, max_tokens=4), "beam_width=True is not supported"),
    (dict(beam_width=2, max_tokens=0), "max_tokens=0 is not supported; allowed: an integer from 1 up"),
    (dict(beam_width=2, max_tokens=4, length_penalty=math.nan), "length_penalty=nan is not supported"),
])
def test_bad_beam_search_params_are_refused_by_name(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        BeamSearchParams(**kwargs)


def test_bad_calls_are_refused_by_name_and_hold_nothing(model):
    llm = engine(model)
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    with pytest.raises(ConfigError, match="params must be a ponytail.BeamSearchParams, got SamplingParams"):
        llm.beam_search([[1, 2, 3]], ponytail.SamplingParams())
    with pytest.raises(ConfigError, match=r"a prompt of 254 tokens and max_tokens=4 exceed max_model_len=256"):
        llm.beam_search([[1] * 254], params)
    with pytest.raises(ConfigError, match="concurrency_limit=0 is not supported; allowed: an integer >= 1"):
        llm.beam_search([[1, 2, 3]], params, concurrency_limit=0)
    with pytest.raises(ConfigError, match="token ids outside the vocabulary"):
        llm.beam_search([[1, 2, VOCAB]], params)
    with pytest.raises(ConfigError, match="lora_request"):
        llm.beam_search([[1, 2, 3]], params, lora_request=object())
    assert llm.stats().used_blocks == 0 and llm.stats().num_waiting == 0


def test_a_failed_step_request_stops_the_search_naming_its_error():
    from types import SimpleNamespace

    from ponytail.engine.beam_search import beam_search

    def failing(beams, sampling):
        return [SimpleNamespace(error="the engine is shutting down", outputs=[]) for _ in beams]

    with pytest.raises(ConfigError, match="beam search: a step's request failed: the engine is shutting down"):
        beam_search(failing, [[1, 2, 3]], BeamSearchParams(beam_width=2, max_tokens=3), frozenset())
