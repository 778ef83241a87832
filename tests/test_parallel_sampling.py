"""n > 1 and best_of in the engine (CPU): one prefill, the prompt's KV blocks shared copy-on-write,
one sampling stream per sample, nothing left behind after the end or an abort."""

import asyncio

import pytest
import torch

import ponytail
from ponytail import ConfigError, SamplingParams

from test_engine import make_llm, plain_greedy

pytestmark = pytest.mark.network  # the default model's tokenizer

BLOCK = 4


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def run_watching_blocks(llm, prompt, params) -> tuple[list, int, int]:
    """Run one request; returns (its output, the most blocks in use, prompt tokens the model computed).
    Blocks are read right after each schedule, when a step's slots are reserved: the peak of the step."""
    engine = llm.engine
    peak, computed = [0], [0]
    schedule, execute = engine.scheduler.schedule, engine.runner.execute

    def scheduled(*args, **kwargs):
        out = schedule(*args, **kwargs)
        peak[0] = max(peak[0], llm.stats().used_blocks)
        return out

    def executed(chunks, *args, **kwargs):
        computed[0] += sum(max(0, min(c.start + c.num_tokens, len(prompt)) - c.start) for c in chunks)
        return execute(chunks, *args, **kwargs)

    engine.scheduler.schedule, engine.runner.execute = scheduled, executed
    try:
        out = llm.generate(prompt, params)[0]
    finally:
        engine.scheduler.schedule, engine.runner.execute = schedule, execute
    return out, peak[0], computed[0]


@pytest.mark.parametrize("prompt_len", [16, 18])  # whole blocks; a partial last block copied on write
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_n4_kv_use_is_one_prompt_plus_four_outputs(small_model, prompt_len, async_scheduling):
    llm = make_llm(small_model, block_size=BLOCK, async_scheduling=async_scheduling, enable_prefix_caching=False)
    prompt = list(range(100, 100 + prompt_len))
    max_tokens = 10
    params = SamplingParams(n=4, max_tokens=max_tokens, temperature=1.0, seed=7, ignore_eos=True)
    out, peak, prompt_computed = run_watching_blocks(llm, prompt, params)
    assert [len(o.token_ids) for o in out.outputs] == [max_tokens] * 4
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    # One prompt's full blocks, shared; each sample holds the rest of its sequence (its copy of a
    # shared partial block, then its outputs' blocks). Four independent requests would each hold
    # their own prompt.
    shared = prompt_len // BLOCK
    own = cdiv(prompt_len + max_tokens, BLOCK) - shared
    assert peak == shared + 4 * own
    assert peak < 4 * cdiv(prompt_len + max_tokens, BLOCK)
    # The prompt was prefilled once: the samples began with its tokens already computed.
    assert prompt_computed == prompt_len
    assert llm.stats().used_blocks == 0 and llm.engine.cache.invariants() == []
    assert llm.engine.scheduler.promises.total == 0


def test_samples_share_one_prefill_and_differ_by_seed(small_model):
    llm = make_llm(small_model)
    prompt = list(range(200, 230))
    params = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    first = llm.generate(prompt, params)[0]
    again = llm.generate(prompt, params)[0]
    texts = [o.token_ids for o in first.outputs]
    assert texts == [o.token_ids for o in again.outputs]  # reproducible
    assert len({tuple(t) for t in texts}) == 4  # distinct streams
    # Sample i is exactly what a one-sample request seeded seed + i samples.
    for i, tokens in enumerate(texts):
        alone = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=3 + i, ignore_eos=True))
        assert alone[0].token_ids == tokens


def test_greedy_samples_are_all_equal_to_plain_generate(small_model):
    llm = make_llm(small_model)
    prompt = list(range(300, 321))
    out = llm.generate(prompt, SamplingParams(n=3, max_tokens=8, temperature=0, ignore_eos=True))[0]
    expected = plain_greedy(small_model[0], prompt, 8)
    assert [o.token_ids for o in out.outputs] == [expected] * 3


def test_best_of_returns_the_n_of_highest_cumulative_logprob(small_model):
    llm = make_llm(small_model)
    prompt = list(range(400, 420))
    args = dict(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    all5 = llm.generate(prompt, SamplingParams(n=5, logprobs=0, **args))[0].outputs
    best = llm.generate(prompt, SamplingParams(n=2, best_of=5, **args))[0].outputs
    ranked = sorted(all5, key=lambda o: sum(next(iter(e.values())) for e in o.logprobs), reverse=True)
    assert [o.token_ids for o in best] == [o.token_ids for o in ranked[:2]]
    assert [o.index for o in best] == [0, 1]
    assert best[0].cumulative_logprob >= best[1].cumulative_logprob
    assert best[0].logprobs is None  # not asked for: computed for the ranking only
    assert llm.stats().used_blocks == 0


def test_abort_mid_generation_frees_every_sample(small_model):
    llm = make_llm(small_model)
    engine = llm.engine
    request = engine.add_request(list(range(500, 530)), SamplingParams(n=4, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert len(engine.scheduler.running) == 4 and llm.stats().used_blocks > 0
    assert engine.abort(request.request_id)
    assert not engine.abort(request.request_id)
    assert not engine.has_unfinished() and llm.stats().used_blocks == 0
    out = engine.output(request)
    assert out.finished and [o.finish_reason for o in out.outputs] == ["abort"] * 4
    engine.forget(request.request_id)
    assert engine._detokenizers == {} and engine._generators == {}
    assert engine.cache.invariants() == [] and engine.scheduler.promises.total == 0


def test_async_stream_gives_each_sample_its_index_and_ends_once(small_model):
    llm = make_llm(small_model)

    async def main():
        front = ponytail.AsyncLLM(llm)
        texts, finished = {}, []
        async for delta in front.generate(list(range(600, 620)), SamplingParams(n=3, max_tokens=5, seed=1,
                                                                                 ignore_eos=True)):
            texts.setdefault(delta.index, []).extend(delta.new_token_ids)
            finished.append(delta.finished)
        return texts, finished, delta.output

    texts, finished, output = asyncio.run(main())
    assert finished[-1] and not any(finished[:-1])
    assert texts == {o.index: o.token_ids for o in output.outputs} and len(texts) == 3
    assert llm.stats().used_blocks == 0


def test_samples_survive_preemption_with_the_same_tokens(small_model):
    prompt = list(range(700, 740))
    params = SamplingParams(n=4, max_tokens=30, temperature=1.0, seed=5, ignore_eos=True)
    roomy = make_llm(small_model).generate(prompt, params)[0]
    tight_llm = make_llm(small_model, kv_cache_memory=40 * 2 * 2 * 2 * 16 * 4 * 4)  # ~40 blocks: forces preemption
    tight = tight_llm.generate([prompt, prompt], [params, params])
    assert tight_llm.stats().num_preemptions > 0
    for out in tight:
        assert [o.token_ids for o in out.outputs] == [o.token_ids for o in roomy.outputs]
    assert tight_llm.stats().used_blocks == 0


@pytest.mark.parametrize("params, message", [
    (dict(n=0), "n=0 is invalid; allowed: an integer in [1, 128]"),
    (dict(n=3, best_of=2), "best_of=2 is invalid; allowed: None or an integer in [n=3, 128]"),
    (dict(n=2, seed=2**64 - 1), "seed=18446744073709551615 is invalid; allowed: None or an integer in "
                                "[-2**63, 2**64 - 2] (sample i is seeded with seed + i)"),
])
def test_bad_n_and_best_of_name_the_field(params, message):
    with pytest.raises(ConfigError) as info:
        SamplingParams(**params)
    assert str(info.value) == message


def test_more_samples_than_running_slots_are_refused(small_model):
    llm = make_llm(small_model, max_num_seqs=4)
    with pytest.raises(ConfigError, match=r"best_of=6 is more sequences than this engine runs at once; "
                                          r"allowed: at most max_num_seqs=4"):
        llm.generate([1, 2, 3], SamplingParams(n=2, best_of=6))


@pytest.mark.parametrize("prompt_len", [16, 18])
def test_a_queued_parent_is_promised_its_samples_blocks_too(small_model, prompt_len):
    """What a replica reports free (admissible - promised) must cover all n samples before the fork,
    or a router would send it more than fits and the engine would preempt."""
    llm = make_llm(small_model, block_size=BLOCK, enable_prefix_caching=False)
    engine, max_tokens = llm.engine, 10
    params = SamplingParams(n=4, max_tokens=max_tokens, temperature=1.0, seed=7, ignore_eos=True)
    engine.add_request(list(range(100, 100 + prompt_len)), params)
    shared = prompt_len // BLOCK
    own = cdiv(prompt_len + max_tokens, BLOCK)
    assert engine.scheduler.promises.total == own + 3 * (own - shared)  # what run_watching_blocks peaks at
    forked_steps = 0
    while engine.scheduler.has_work:
        engine.step()
        members = list(engine.scheduler.running)
        if len(members) == 4:  # forked: each sample is promised what its own tokens do not fill yet
            forked_steps += 1
            assert engine.scheduler.promises.total == sum(own - cdiv(r.num_tokens, BLOCK) for r in members)
    assert forked_steps >= max_tokens - 2
    assert engine.scheduler.promises.total == 0 and llm.stats().used_blocks == 0
