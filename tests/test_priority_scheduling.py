"""vLLM's scheduling_policy="priority": the queue runs lower priority values first, and a
preemption takes the least urgent running request; under "fcfs" (the default) a priority is refused."""

import pytest

import ponytail
from ponytail import ConfigError, SamplingParams
from test_engine import make_llm, plain_greedy, random_prompts

pytestmark = pytest.mark.network  # the default model's tokenizer

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
KV_64_BLOCKS = 64 * 4 * 2 * 2 * 2 * 16 * 4  # 64 blocks of 4 tokens for the default model (test_engine's budget)


def _first_token_order(outputs) -> list[int]:
    return sorted(range(len(outputs)), key=lambda i: outputs[i].metrics.first_token_time)


def test_one_seat_serves_the_queue_by_priority_then_arrival(small_model):
    prompts = random_prompts(4, seed=11)
    fcfs = make_llm(small_model, max_num_seqs=1).generate(prompts, GREEDY)
    assert _first_token_order(fcfs) == [0, 1, 2, 3]
    ranked = make_llm(small_model, max_num_seqs=1, scheduling_policy="priority").generate(
        prompts, GREEDY, priority=[5, 0, 1, 0])
    assert _first_token_order(ranked) == [1, 3, 2, 0]  # ties: first come, first served
    assert [o.token_ids for o in ranked] == [o.token_ids for o in fcfs]  # the order changes nothing else


def test_a_preemption_takes_the_least_urgent_request_not_the_newest(small_model):
    """Three sequences that outgrow 64 blocks: FCFS preempts the newest, the priority policy the one
    with the largest priority value (here the oldest); tokens as plain generate either way."""
    prompts = random_prompts(3, seed=12, low=30, high=40)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    settings = dict(kv_cache_memory=KV_64_BLOCKS, max_num_seqs=3, max_num_batched_tokens=256)
    fcfs = make_llm(small_model, **settings).generate(prompts, params)
    ranked_llm = make_llm(small_model, scheduling_policy="priority", **settings)
    ranked = ranked_llm.generate(prompts, params, priority=[2, 1, 0])
    assert fcfs[2].metrics.num_preemptions > 0 and fcfs[0].metrics.num_preemptions == 0
    assert ranked[0].metrics.num_preemptions > 0 and ranked[2].metrics.num_preemptions == 0
    for prompt, a, b in zip(prompts, fcfs, ranked):
        assert a.token_ids == b.token_ids == plain_greedy(small_model[0], prompt, 60)
    assert ranked_llm.stats().used_blocks == 0 and ranked_llm.engine.cache.invariants() == []


def test_bad_policies_and_priorities_are_refused_by_name(small_model):
    with pytest.raises(ConfigError, match=r"scheduling_policy='lottery' is not supported; allowed: fcfs, priority"):
        ponytail.LLM(small_model[0], scheduling_policy="lottery")
    llm = make_llm(small_model, scheduling_policy="priority")
    with pytest.raises(ConfigError, match=r"priority='high' is invalid; allowed: an integer \(lower runs first\)"):
        llm.generate(["Hello"], GREEDY, priority=["high"])
    with pytest.raises(ConfigError, match=r"got 1 sampling_params and 1 priorities for 2 prompts"):
        llm.generate(["Hello", "Hi"], [GREEDY], priority=[0])
    assert not llm.engine.requests
