"""thinking_token_budget (vLLM's): a thought (between <think> and </think>) gets at most that many
tokens, then the engine writes </think> and the answer goes on from it (CPU, a random model whose
tokenizer has the reasoning models' tags)."""

import copy

import pytest
from tiny_models import sharp_llama

import ponytail
from ponytail import ConfigError, SamplingParams
from ponytail.sampling.thinking import ThinkingBudget, ThinkingTags

pytestmark = pytest.mark.network  # the default model's tokenizer


@pytest.fixture(scope="module")
def thinking(default_model):
    """(model, tokenizer, start id, end id): the default tokenizer with <think> and </think> added."""
    tokenizer = copy.deepcopy(default_model[1])
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=True)
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    return sharp_llama(tokenizer), tokenizer, start, end


def make(thinking, **kwargs):
    model, tokenizer, *_ = thinking
    return ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="8MiB", block_size=4, max_num_seqs=8,
                        max_model_len=256, **kwargs)


def greedy(max_tokens, **kwargs):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_thought_opened_by_the_prompt_is_closed_after_the_budget(thinking, async_scheduling):
    _, tokenizer, start, end = thinking
    llm = make(thinking, async_scheduling=async_scheduling)
    prompt = tokenizer("Why is the sky blue?", add_special_tokens=False)["input_ids"] + [start]
    free = llm.generate([prompt], greedy(10))[0].token_ids
    assert end not in free  # the random model never closes its thought alone
    budgets = [0, 1, 3, 7]
    outs = llm.generate([prompt] * len(budgets), [greedy(10, thinking_token_budget=b) for b in budgets])
    for budget, out in zip(budgets, outs):
        ids = out.token_ids
        assert ids[:budget] == free[:budget] and ids[budget] == end, (budget, ids)
        assert end not in ids[budget + 1:]  # once out of the thought, nothing is forced
        # The answer after the forced tag is what the model says with that tag in its context.
        follow = llm.generate([prompt + ids[:budget + 1]], greedy(10 - budget - 1))[0].token_ids
        assert ids[budget + 1:] == follow
    alone = llm.generate([prompt], greedy(10, thinking_token_budget=-1))[0].token_ids
    assert alone == free  # -1: no limit, as in vLLM


def test_a_closed_thought_or_none_is_left_alone(thinking):
    _, tokenizer, start, end = thinking
    llm = make(thinking)
    text = tokenizer("Sky?", add_special_tokens=False)["input_ids"]
    for prompt in (text, text + [start, 11, 12, end]):
        free = llm.generate([prompt], greedy(8))[0].token_ids
        assert llm.generate([prompt], greedy(8, thinking_token_budget=0))[0].token_ids == free


def test_a_thought_that_began_in_the_prompt_counts_its_tokens_there(thinking):
    _, tokenizer, start, end = thinking
    llm = make(thinking)
    prompt = tokenizer("Sky?", add_special_tokens=False)["input_ids"] + [start, 11, 12, 13]
    ids = llm.generate([prompt], greedy(6, thinking_token_budget=5))[0].token_ids
    assert ids[2] == end and end not in ids[:2]  # 3 thought in the prompt, 2 more, then the tag


def test_every_sample_of_a_request_keeps_its_own_budget(thinking):
    _, tokenizer, start, end = thinking
    llm = make(thinking)
    prompt = tokenizer("Sky?", add_special_tokens=False)["input_ids"] + [start]
    out = llm.generate([prompt], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=1, ignore_eos=True,
                                                thinking_token_budget=2))[0]
    assert [sample.token_ids[2] for sample in out.outputs] == [end] * 3
    assert all(end not in sample.token_ids[:2] for sample in out.outputs)


def test_a_thought_opened_in_the_output_and_multi_token_tags():
    tags = ThinkingTags(start=(7,), end=(8, 9))
    budget = ThinkingBudget(tags, 2, [1, 2, 3])
    assert budget.forced_token([]) == -1  # not thinking
    assert budget.forced_token([5, 7, 4]) == -1  # thinking 1 token
    assert budget.forced_token([5, 7, 4, 4]) == 8  # 2 thought: the end tag's first token
    assert budget.forced_token([5, 7, 4, 4, 8]) == 9  # then its second
    assert budget.forced_token([5, 7, 4, 4, 8, 9]) == -1  # closed
    assert budget.forced_token([5, 7, 4, 4, 8, 9, 7]) == -1  # a new thought gets the budget again
    assert budget.forced_token([5, 7, 4, 4, 8, 9, 7, 1, 1]) == 8


def test_the_budget_is_refused_where_it_cannot_be_kept(thinking, tiny_model):
    model, tokenizer = tiny_model
    llm = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="4MiB", block_size=4, max_num_seqs=2,
                       max_model_len=64)
    with pytest.raises(ConfigError, match=r"thinking_token_budget=4 needs a reasoning model whose tokenizer has "
                                          r"<think> and </think> tokens, and this model has none; allowed: None or "
                                          r"-1 \(no limit\)"):
        llm.generate(["hi"], SamplingParams(max_tokens=2, thinking_token_budget=4))
    with pytest.raises(ConfigError, match=r"thinking_token_budget=-2 is invalid; allowed: None, -1 \(no limit\) "
                                          r"or an integer >= 0"):
        SamplingParams(thinking_token_budget=-2)
    with pytest.raises(ConfigError, match=r"thinking_token_budget=1.5 \(float\) is invalid"):
        SamplingParams(thinking_token_budget=1.5)
    with pytest.raises(ConfigError, match=r"thinking_token_budget=3 is invalid; allowed: None with "
                                          r"structured_outputs"):
        SamplingParams(thinking_token_budget=3, structured_outputs={"choice": ["a", "b"]})
    assert llm.generate(["hi"], SamplingParams(max_tokens=2))[0].token_ids  # the engine is left usable


def test_through_the_api_the_thought_stops_at_the_budget_and_the_answer_follows(thinking, tmp_path):
    """A chat with thinking_token_budget on a checkpoint whose tokenizer has the tags, under R1's
    template (it opens the thought): reasoning holds the budget's tokens, content the rest."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from deployments.app.local_server import local_server
    from test_reasoning import R1_TEMPLATE

    model, tokenizer, *_ = thinking
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with local_server(model=str(tmp_path), chat_template=R1_TEMPLATE,
                      engine=dict(kv_cache_memory="16MiB", max_model_len=256, compile_model=False)) as (replica, url):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
            ask = dict(model=replica.info.model_id, messages=[{"role": "user", "content": "Sky?"}], max_tokens=8,
                       temperature=0, extra_body={"ignore_eos": True})
            free = client.chat.completions.create(**ask)
            capped = client.chat.completions.create(**{**ask, "extra_body": {"ignore_eos": True,
                                                                              "thinking_token_budget": 3}})
            streamed = [c.usage for c in client.chat.completions.create(
                **{**ask, "extra_body": {"ignore_eos": True, "thinking_token_budget": 3}}, stream=True,
                stream_options={"include_usage": True}) if c.usage]
    assert free.choices[0].message.content is None  # never closed alone: all thought
    assert free.usage.completion_tokens_details.reasoning_tokens == 8
    message = capped.choices[0].message
    assert message.reasoning and message.content  # the thought, then the answer after the forced tag
    # The template's "<think>\n": the newline is the thought's first token, in the prompt (as vLLM counts it)
    assert capped.usage.completion_tokens == 8 and capped.usage.completion_tokens_details.reasoning_tokens == 2
    assert streamed[-1].completion_tokens_details.reasoning_tokens == 2
