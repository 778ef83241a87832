"""Prompts that would compute the same uncached prefix in one step (engine/shared_prefill.py): the
first is admitted, the others wait a step and find the prefix cached, unless what they share is
under half of what they have left to compute."""

import pytest
from scheduled_steps import add, engine_on, run_steps, tiny_llama

import ponytail
from ponytail import SamplingParams

SYSTEM = list(range(1, 65))  # 4 blocks of 16


def asking(name: str, length: int = 8) -> list[int]:
    first = 100 + 20 * (ord(name) - ord("a"))
    return SYSTEM + list(range(first, first + length))


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def test_prompts_on_one_uncached_prefix_wait_a_step_and_find_it_cached(model):
    e = engine_on(model, max_num_batched_tokens=256)
    for name in "abc":
        add(e, name, asking(name), 2)
    seen = run_steps(e)
    assert seen[0] == [("a", 72)]  # b and c would compute the same 64 tokens again
    assert seen[1] == [("a", 1), ("b", 8), ("c", 8)]  # a's prefix is cached now: only their own tokens
    assert [e.requests[n].metrics.num_cached_prompt_tokens for n in "bc"] == [64, 64]


def test_a_held_prompt_keeps_its_place_and_prompts_behind_it_that_share_nothing_go_in(model):
    e = engine_on(model, max_num_batched_tokens=256)
    add(e, "a", asking("a"), 2)
    add(e, "b", asking("b"), 2)
    add(e, "z", list(range(300, 340)), 2)
    add(e, "c", asking("c"), 2)
    seen = run_steps(e)
    assert seen[0] == [("a", 72), ("z", 40)]
    assert seen[1] == [("a", 1), ("z", 1), ("b", 8), ("c", 8)]  # b and c in their order


def test_a_short_common_opening_holds_nobody_back(model):
    """One shared block against 40 own tokens each: under half of what they compute."""
    e = engine_on(model, max_num_batched_tokens=256)
    opening = SYSTEM[:16]
    for i, name in enumerate("abc"):
        add(e, name, opening + list(range(200 + 50 * i, 240 + 50 * i)), 2)
    assert run_steps(e)[0] == [("a", 56), ("b", 56), ("c", 56)]


def test_a_prefix_still_prefilling_in_chunks_holds_a_new_prompt_back(model):
    e = engine_on(model, max_num_batched_tokens=48)
    add(e, "a", asking("a"), 2)
    e.step()  # a's first 48 tokens: 3 blocks cached
    add(e, "b", asking("b"), 2)
    seen = run_steps(e)
    assert seen[0] == [("a", 24)]  # b would compute the 4th block again beside a: it waits
    assert seen[1] == [("a", 1), ("b", 8)]  # then finds all 64 tokens cached
    assert e.requests["b"].metrics.num_cached_prompt_tokens == 64


def test_requests_that_do_not_use_the_cache_are_not_held_back(model):
    """Prompt logprobs score every prompt position: those prompts compute them anyway."""
    e = engine_on(model, max_num_batched_tokens=256)
    add(e, "a", asking("a"), 2)
    add(e, "b", asking("b"), 2, prompt_logprobs=0)
    assert run_steps(e)[0] == [("a", 72), ("b", 72)]

    e = engine_on(model, max_num_batched_tokens=256, enable_prefix_caching=False)
    for name in "ab":
        add(e, name, asking(name), 2)
    assert run_steps(e)[0] == [("a", 72), ("b", 72)]


def test_outputs_are_those_of_prompts_computed_apart(model):
    prompts = [asking(name, 8 + 3 * i) for i, name in enumerate("abcd")]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outputs = []
    for caching in (True, False):
        llm = ponytail.LLM(model, kv_cache_memory="16MiB", max_num_seqs=4, max_model_len=512,
                           enable_prefix_caching=caching)
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outputs[0] == outputs[1]
