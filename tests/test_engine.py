"""The continuous-batching engine on the CPU: equality with plain generate, preemption,
defragmentation, prefix reuse, aborts, seeds and refused input."""

import asyncio
import logging
import random
import shutil
import threading

import pytest
import torch

import ponytail
from tiny_models import sharp_llama
from ponytail import ConfigError, SamplingParams

pytestmark = pytest.mark.network  # the default model's tokenizer


def plain_greedy(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    finally:
        model.set_attn_implementation(previous)
    return out[0, len(prompt_ids):].tolist()


def random_prompts(n, seed=0, low=3, high=60, vocab=49152, shared_prefix=()):
    rng = random.Random(seed)
    return [list(shared_prefix) + [rng.randrange(10, vocab) for _ in range(rng.randint(low, high))] for _ in range(n)]


def make_llm(small_model, **kwargs):
    model, tokenizer = small_model
    # 2048 tokens a step, as on CUDA (the CPU default is 256): whole prompts per step unless a test
    # asks for chunking, so the sync and async engines split prompts alike and agree bit for bit.
    settings = dict(kv_cache_memory="4MiB", block_size=4, max_num_seqs=8, max_model_len=256,
                    max_num_batched_tokens=2048)
    return ponytail.LLM(model, tokenizer=tokenizer, **{**settings, **kwargs})


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def walked_promised_blocks(engine) -> int:
    """Blocks promised, by walking the scheduler's lists (what the Serve replica computed before
    the engine kept the count): a waiting request still takes all of prompt + max_tokens, a
    running one what its tokens so far do not fill."""
    block_size = engine.cache.config.block_size
    promised = 0
    for requests, running in ((engine.scheduler.waiting, False), (engine.scheduler.running, True)):
        for r in requests:
            need = -(-(len(r.prompt_token_ids) + r.params.max_tokens) // block_size)
            held = -(-r.num_tokens // block_size) if running else 0
            promised += max(0, need - held)
    return promised


def test_greedy_batch_of_mixed_lengths_equals_plain_generate(small_model):
    llm = make_llm(small_model)
    prompts = random_prompts(10)
    outputs = llm.generate(prompts, GREEDY)
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == plain_greedy(small_model[0], prompt, 12)
        assert output.finish_reason == "length"
    stats = llm.stats()
    assert stats.used_blocks == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert llm.engine.cache.invariants() == []


def test_a_small_budget_forces_preemption_and_defragmentation_without_changing_outputs(small_model):
    # 64 blocks of 4 tokens; 8 sequences growing to ~70 tokens each need ~140: preemption is certain.
    # kv_release_after_s=0: the pool also shrinks (and so compacts) as soon as load falls
    llm = make_llm(small_model, kv_cache_memory=64 * 4 * 2 * 2 * 2 * 16 * 4, max_num_batched_tokens=64,
                   kv_release_after_s=0)
    llm.engine.cache.config.defrag_threshold = 0.05
    prompts = random_prompts(8, seed=1, low=20, high=40)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    stats = llm.stats()
    assert stats.num_preemptions > 0
    assert stats.num_defragmentations > 0
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == plain_greedy(small_model[0], prompt, 40)
    assert stats.used_blocks == 0 and llm.engine.cache.invariants() == []


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_output_built_later_is_the_output_at_its_step(small_model, async_scheduling):
    import copy

    # Tight memory (preemptions recompute) and logprobs on half the requests.
    llm = make_llm(small_model, kv_cache_memory=64 * 4 * 2 * 2 * 2 * 16 * 4, max_num_batched_tokens=64,
                   async_scheduling=async_scheduling)
    engine = llm.engine
    for i, prompt in enumerate(random_prompts(8, seed=3, low=20, high=40)):
        engine.add_request(prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                  logprobs=2 if i % 2 else None))
    pairs = []
    while engine.has_unfinished():
        for out in engine.step():
            if not out.done:
                pairs.append((engine.output_later(out.request), copy.deepcopy(engine.output(out.request))))
    assert engine.stats().num_preemptions > 0 and len(pairs) > 100
    for later, then in pairs:
        built = later()
        assert built.request_id == then.request_id and built.finished is then.finished is False
        assert built.prompt_token_ids == then.prompt_token_ids and built.error == then.error
        assert len(built.outputs) == 1
        (b,), (t,) = built.outputs, then.outputs
        assert (b.index, b.text, b.token_ids, b.finish_reason, b.cumulative_logprob) == \
            (t.index, t.text, t.token_ids, t.finish_reason, t.cumulative_logprob)
        assert b.logprobs == (None if t.logprobs is None else t.logprobs[:len(t.token_ids)])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engine_counts_promised_blocks_through_preemption(small_model, async_scheduling):
    # 64 blocks of 4 tokens; 8 sequences growing to ~70 tokens each need ~140: preemption is certain.
    llm = make_llm(small_model, kv_cache_memory=64 * 4 * 2 * 2 * 2 * 16 * 4, max_num_batched_tokens=64,
                   async_scheduling=async_scheduling)
    engine = llm.engine
    for prompt in random_prompts(8, seed=1, low=20, high=40):
        engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    cache = engine.cache
    while engine.has_unfinished():
        engine.step()
        stats = engine.stats()
        assert stats.promised_blocks == walked_promised_blocks(engine)
        growable = (cache.max_chunks - cache.num_chunks) * cache.storage.chunk_blocks
        assert stats.admissible_blocks == cache.allocator.num_free + growable
        assert stats.max_blocks == cache.max_chunks * cache.storage.chunk_blocks == 64
    assert engine.stats().num_preemptions > 0 and engine.stats().promised_blocks == 0


def test_hundreds_of_requests_with_random_aborts_leave_no_blocks_behind(small_model):
    llm = make_llm(small_model, max_num_seqs=16)
    engine = llm.engine
    rng = random.Random(3)
    prompts = random_prompts(300, seed=3, low=1, high=30)
    requests = [engine.add_request(p, SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.8, seed=i))
                for i, p in enumerate(prompts)]
    assert engine.stats().promised_blocks == walked_promised_blocks(engine) > 0
    steps = 0
    while engine.has_unfinished():
        engine.step()
        assert engine.stats().promised_blocks == walked_promised_blocks(engine)
        steps += 1
        for request in rng.sample(requests, 3):
            if rng.random() < 0.2:
                engine.abort(request.request_id)
        assert engine.stats().promised_blocks == walked_promised_blocks(engine)
        assert engine.cache.invariants() == [] if steps % 25 == 0 else True
    assert engine.stats().promised_blocks == 0
    assert all(r.finished for r in requests)
    assert {r.finish_reason for r in requests} <= {"length", "stop", "abort"}
    assert any(r.finish_reason == "abort" for r in requests)
    assert engine.stats().used_blocks == 0
    assert engine.cache.invariants() == []


def test_prefix_reuse_hits_and_keeps_outputs(small_model, caplog):
    llm = make_llm(small_model)
    prefix = random_prompts(1, seed=5, low=32, high=32)[0]
    prompts = random_prompts(6, seed=6, low=2, high=9, shared_prefix=prefix)
    with caplog.at_level(logging.DEBUG, logger="ponytail.kernels"):
        first = llm.generate(prompts[:1], GREEDY)
        rest = llm.generate(prompts[1:], GREEDY)
    # The first prompt has no context: its own K/V; the others start after cached blocks: paged.
    assert "prefill without context: torch SDPA" in caplog.text
    assert "paged attention of an engine step: fallback (torch, unpadded" in caplog.text
    stats = llm.stats()
    assert stats.prefix_cache_hits >= 5 * 32 - 4  # every later prompt reuses the cached prefix blocks
    assert 0 < stats.prefix_hit_rate < 1
    for prompt, output in zip(prompts, first + rest):
        assert output.token_ids == plain_greedy(small_model[0], prompt, 12)
    assert rest[0].metrics.num_cached_prompt_tokens == rest[0].num_cached_tokens == 32


def test_seeded_sampling_is_reproducible_whatever_the_batch(small_model):
    llm = make_llm(small_model)
    prompts = random_prompts(4, seed=7)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate(prompts[:1], seeded)[0].token_ids
    mixed = llm.generate(prompts, [seeded] + [SamplingParams(max_tokens=10, temperature=1.0)] * 3)[0].token_ids
    assert alone == mixed


def test_stop_strings_stop_tokens_and_max_tokens(small_model):
    llm = make_llm(small_model)
    prompt = random_prompts(1, seed=8)[0]
    full = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    stop_token = full.token_ids[3]
    by_token = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                      stop_token_ids=[stop_token]))[0]
    assert by_token.finish_reason == "stop" and by_token.outputs[0].stop_reason == stop_token
    assert by_token.token_ids == full.token_ids[: full.token_ids.index(stop_token) + 1]
    stop_text = full.text[len(full.text) // 2:][:3]
    if stop_text.strip():
        by_string = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                           stop=[stop_text]))[0]
        assert by_string.finish_reason == "stop" and stop_text not in by_string.text
        assert full.text.startswith(by_string.text)


def test_detokenize_false_returns_the_same_tokens_without_text(small_model):
    """vLLM's detokenize=False (token ids only, as RL rollouts ask): the same tokens and logprobs, no text,
    stop_token_ids still end it."""
    llm = make_llm(small_model)
    prompts = random_prompts(3, seed=11)
    params = dict(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    texts = llm.generate(prompts, SamplingParams(**params))
    ids = llm.generate(prompts, SamplingParams(**params, detokenize=False))
    for with_text, only_ids in zip(texts, ids):
        assert with_text.text and only_ids.text == ""
        assert only_ids.token_ids == with_text.token_ids and len(only_ids.outputs[0].logprobs) == 12
        assert [sorted(step) for step in only_ids.outputs[0].logprobs] == [
            sorted(step) for step in with_text.outputs[0].logprobs]
    stop_token = texts[0].token_ids[4]
    stopped = llm.generate([prompts[0]], SamplingParams(**params, detokenize=False, stop_token_ids=[stop_token]))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == texts[0].token_ids[:texts[0].token_ids.index(
        stop_token) + 1] and stopped.text == ""


def test_truncate_prompt_tokens_runs_only_the_prompts_last_tokens(small_model):
    llm = make_llm(small_model)
    prompt = random_prompts(1, seed=12, low=40, high=40)[0]
    greedy = dict(max_tokens=6, temperature=0, ignore_eos=True)
    cut = llm.generate([prompt], SamplingParams(**greedy, truncate_prompt_tokens=10))[0]
    tail = llm.generate([prompt[-10:]], SamplingParams(**greedy))[0]
    assert cut.prompt_token_ids == prompt[-10:] and cut.token_ids == tail.token_ids
    whole = llm.generate([prompt], SamplingParams(**greedy, truncate_prompt_tokens=-1))[0]  # -1: max_model_len's worth
    assert whole.prompt_token_ids == prompt
    with pytest.raises(ConfigError, match=r"prompt \(256 tokens\) \+ max_tokens \(6\) = 262 exceeds max_model_len=256"):
        llm.generate([[7] * 300], SamplingParams(**greedy, truncate_prompt_tokens=-1))


@pytest.mark.parametrize("prompt, params, message", [
    ("", None, "prompt='' is empty"),
    ([], None, "prompt must be a non-empty string or list of token ids"),
    ([1, 99999999], None, r"prompt=\[99999999\]: token ids outside the vocabulary; allowed: token ids in \[0, 49152\)"),
    ([3, -1], None, r"prompt=\[-1\]: token ids outside the vocabulary"),
    ([True, 2], None, r"prompt=\[True\]: token ids outside the vocabulary"),
    ([1, 2.0], None, r"prompt=\[2.0\]: token ids outside the vocabulary"),
    ([1, 2], SamplingParams(stop_token_ids=[10**12]),
     r"stop_token_ids=\[1000000000000\] are outside the vocabulary: allowed: token ids in \[0, 49152\)"),
    ([1] * 250, SamplingParams(max_tokens=10), r"prompt \(250 tokens\) \+ max_tokens \(10\) = 260 exceeds max_model_len=256"),
    ([1, 2], {"max_tokens": 3}, "params must be a ponytail.SamplingParams, got dict"),
])
def test_invalid_requests_are_refused_with_a_clear_message(small_model, prompt, params, message):
    llm = make_llm(small_model)
    with pytest.raises(ConfigError, match=message):
        llm.engine.add_request(prompt, params)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": "hi", "prompt_token_ids": [1]}, r"keys \['prompt', 'prompt_token_ids'\]: allowed: exactly one of"),
    ({}, r"prompt dict with keys \[\]: allowed: exactly one of \['prompt', 'prompt_token_ids'\]"),
    ({"prompt_token_ids": [1], "multi_modal_data": {}}, r"\(multi_modal_data not supported\)"),
    ({"prompt_token_ids": []}, "prompt must be a non-empty string or list of token ids"),
    ({"prompt": "hi", "cache_salt": ""}, r"cache_salt='' is invalid; allowed: a non-empty string, or None"),
    ({"prompt": "hi", "cache_salt": 7}, r"cache_salt=7 is invalid"),
])
def test_vllm_prompt_dicts_are_checked(small_model, prompt, message):
    llm = make_llm(small_model)
    with pytest.raises(ConfigError, match=message):
        llm.generate(prompt, GREEDY)


def test_vllm_prompt_dicts_give_what_their_text_or_ids_give(small_model):
    llm = make_llm(small_model)
    text, ids = "The capital of France is", random_prompts(1, seed=3)[0]
    plain = llm.generate([text, ids], GREEDY)
    dicts = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], GREEDY)
    assert [o.token_ids for o in dicts] == [o.token_ids for o in plain]
    assert dicts[0].prompt == text and dicts[1].prompt_token_ids == ids
    assert llm.generate({"prompt_token_ids": ids}, GREEDY)[0].token_ids == plain[1].token_ids  # one prompt, no list


def test_a_cache_salt_shares_cached_prefixes_only_with_the_same_salt(small_model):
    """vLLM's prompt-dict cache_salt: a prompt cached under one salt is a miss under another (and
    without one), a hit under the same; the tokens do not depend on it."""
    llm = make_llm(small_model)
    ids = random_prompts(1, seed=6, low=40, high=40)[0]
    first = llm.generate({"prompt_token_ids": ids, "cache_salt": "a"}, GREEDY)[0]
    others = llm.generate([{"prompt_token_ids": ids, "cache_salt": "b"}, ids], GREEDY)
    again = llm.generate({"prompt_token_ids": ids, "cache_salt": "a"}, GREEDY)[0]
    assert first.num_cached_tokens == 0 and [o.num_cached_tokens for o in others] == [0, 0]
    assert again.num_cached_tokens > 0
    assert {tuple(o.token_ids) for o in [first, again, *others]} == {tuple(first.token_ids)}


def test_a_refused_prompt_takes_back_the_prompts_added_before_it(small_model):
    llm = make_llm(small_model)
    good = random_prompts(2, seed=4)
    with pytest.raises(ConfigError, match="prompt='' is empty"):
        llm.generate(good + [""], GREEDY)
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    assert len(llm.generate(good[:1], GREEDY)) == 1 and not llm.engine.requests


def test_a_request_larger_than_the_whole_cache_is_refused_at_once(small_model):
    llm = make_llm(small_model, kv_cache_memory=8 * 4 * 2 * 2 * 2 * 16 * 4)  # 8 blocks of 4 tokens
    with pytest.raises(ConfigError, match=r"needs 13 KV blocks, but the whole cache holds 8"):
        llm.engine.add_request([5] * 40, SamplingParams(max_tokens=10))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_async_engine_streams_deltas_and_aborts(small_model, async_scheduling):
    llm = make_llm(small_model, async_scheduling=async_scheduling)
    engine = ponytail.AsyncLLM(llm)
    prompts = random_prompts(3, seed=9)

    async def collect(prompt, params, stop_after=None):
        deltas = []
        async for delta in engine.generate(prompt, params):
            assert -1 not in delta.new_token_ids and -1 not in delta.output.token_ids  # no placeholder leaks
            deltas.append(delta)
            if stop_after is not None and len(deltas) == stop_after:
                break
        return deltas

    async def main():
        return await asyncio.gather(collect(prompts[0], GREEDY), collect(prompts[1], GREEDY, stop_after=2),
                                    collect(prompts[2], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)))

    full, cut, short = asyncio.run(main())
    assert full[-1].finished and full[-1].output.token_ids == plain_greedy(small_model[0], prompts[0], 12)
    assert sum(len(d.new_token_ids) for d in full) == 12
    assert [t for d in full for t in d.new_token_ids] == full[-1].output.token_ids
    assert "".join(d.delta_text for d in full) == full[-1].output.text
    assert len(cut) == 2 and not cut[-1].finished
    assert short[-1].finished and len(short[-1].output.token_ids) == 5
    assert engine.stats().used_blocks == 0 and llm.engine.cache.invariants() == []


def test_a_slow_consumer_gets_the_waiting_deltas_merged(small_model):
    llm = make_llm(small_model)
    engine = ponytail.AsyncLLM(llm)
    prompt = random_prompts(1, seed=13)[0]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    async def slow():
        deltas = []
        async for delta in engine.generate(prompt, params):
            deltas.append(delta)
            await asyncio.sleep(0.3)  # the engine keeps stepping meanwhile
        return deltas

    deltas = asyncio.run(slow())
    assert len(deltas) < 12 and any(len(d.new_token_ids) > 1 for d in deltas)
    assert [t for d in deltas for t in d.new_token_ids] == plain_greedy(small_model[0], prompt, 12)
    assert "".join(d.delta_text for d in deltas) == deltas[-1].output.text
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert engine.stats().used_blocks == 0


def test_a_stream_interval_merges_deltas_but_never_holds_the_first_token_or_the_end(small_model):
    llm = make_llm(small_model)
    prompt = random_prompts(1, seed=14)[0]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    async def timed(engine):
        loop = asyncio.get_running_loop()
        start, deltas, times = loop.time(), [], []
        async for delta in engine.generate(prompt, params):
            deltas.append(delta)
            times.append(loop.time() - start)
        return deltas, times, loop.time() - start

    unbatched, _, _ = asyncio.run(timed(ponytail.AsyncLLM(llm)))
    deltas, times, total = asyncio.run(timed(ponytail.AsyncLLM(llm, stream_interval_s=60.0)))
    assert len(unbatched) == 12 and len(deltas[0].new_token_ids) == 1  # the first token came alone
    # an interval longer than the whole request: the rest is one delta, sent as it finished, not 60 s later
    assert len(deltas) == 2 and deltas[1].finished and total < 30
    assert [t for d in deltas for t in d.new_token_ids] == unbatched[-1].output.token_ids
    assert "".join(d.delta_text for d in deltas) == unbatched[-1].output.text
    assert llm.engine.stats().used_blocks == 0


def test_a_stream_interval_is_checked():
    with pytest.raises(ConfigError, match=r"stream_interval_s=-0.1 is not supported; allowed: seconds >= 0"):
        ponytail.AsyncLLM(object.__new__(ponytail.LLM), stream_interval_s=-0.1)
    with pytest.raises(ConfigError, match=r"max_deltas_per_s=0 is not supported; allowed: a number > 0, or None"):
        ponytail.AsyncLLM(object.__new__(ponytail.LLM), max_deltas_per_s=0)


def test_a_delta_rate_bound_stretches_every_streams_interval_with_more_streams_open(small_model):
    """4 streams at 0.1 deltas/s in all: each waits 40 s after a delta (stream_interval_s is only
    the floor), so each gets its first token alone and the rest as one delta when it finishes."""
    llm = make_llm(small_model)
    engine = ponytail.AsyncLLM(llm, stream_interval_s=0.01, max_deltas_per_s=0.1)
    assert engine.stream_interval() == 0.01  # no stream open: the floor
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    async def one(prompt, intervals):
        deltas = []
        async for delta in engine.generate(prompt, params):
            deltas.append(delta)
            intervals.append(engine.stream_interval())
        return deltas

    async def main():
        intervals = []
        streams = await asyncio.gather(*(one(p, intervals) for p in random_prompts(4, seed=17)))
        return streams, intervals

    streams, intervals = asyncio.run(asyncio.wait_for(main(), 30))
    assert max(intervals) == 40.0 and engine.stream_interval() == 0.01  # all ended: none counts
    for deltas in streams:
        assert len(deltas) == 2 and len(deltas[0].new_token_ids) == 1 and deltas[1].finished
        assert len(deltas[0].new_token_ids) + len(deltas[1].new_token_ids) == 12
    assert llm.engine.stats().used_blocks == 0


def test_an_abort_ends_a_stream_waiting_out_its_interval(small_model):
    llm = make_llm(small_model)
    engine = ponytail.AsyncLLM(llm, stream_interval_s=60.0)
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def main():
        deltas = []
        async for delta in engine.generate(random_prompts(1, seed=15)[0], params, request_id="r"):
            deltas.append(delta)
            if len(deltas) == 1:
                asyncio.get_running_loop().call_later(0.2, lambda: asyncio.ensure_future(engine.abort("r")))
        return deltas

    deltas = asyncio.run(asyncio.wait_for(main(), 30))
    assert deltas[-1].finished and deltas[-1].output.finish_reason == "abort"
    assert llm.engine.stats().used_blocks == 0


def test_asyncio_run_ends_after_a_stream_while_spare_kv_memory_waits_for_its_release(small_model):
    """The idle loop waits out the release delay. When asyncio.run ends right after a stream, that
    stream's last hand-over wakes the loop as it is cancelled: wait_for (Python < 3.12) returned
    normally then, the loop went back to waiting, and asyncio.run never returned."""
    llm = make_llm(small_model, kv_release_after_s=60.0)
    engine = ponytail.AsyncLLM(llm)
    prompt = random_prompts(1, seed=3, low=200, high=200)[0]

    async def main():
        return [d async for d in engine.generate(prompt, GREEDY)]

    result = {}
    runner = threading.Thread(target=lambda: result.update(deltas=asyncio.run(main())), daemon=True)
    runner.start()
    runner.join(timeout=60)
    assert not runner.is_alive(), "asyncio.run did not return: the engine's loop outlived its cancellation"
    assert result["deltas"][-1].finished
    assert llm.engine.cache.seconds_until_release() is not None  # a release was pending: the case above


@pytest.mark.parametrize("keep_prefix_cache", [False, True])
def test_an_idle_async_engine_gives_spare_kv_memory_back_after_the_release_delay(small_model, keep_prefix_cache):
    llm = make_llm(small_model, kv_release_after_s=0.5, keep_prefix_cache=keep_prefix_cache)
    engine = ponytail.AsyncLLM(llm)
    cache = llm.engine.cache
    prompts = random_prompts(4, seed=16)

    async def main():
        async def one(prompt):
            async for _ in engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)):
                pass
        await asyncio.gather(*(one(p) for p in prompts))
        grown = cache.num_chunks
        await asyncio.sleep(0.1)
        held = cache.num_chunks  # spare, but not for long enough yet
        await asyncio.sleep(1.5)  # no request and no step: only the idle loop can release it
        return grown, held, cache.num_chunks

    grown, held, after = asyncio.run(main())
    assert grown > 1 and held == grown and after < grown
    assert cache.spare_chunks(cache.KEEP_FREE_CHUNKS * cache.chunk_blocks) == 0
    assert cache.invariants() == []


def test_keep_prefix_cache_finds_an_earlier_prompt_after_others_filled_the_pool(small_model):
    llm = make_llm(small_model, keep_prefix_cache=True)
    assert llm.engine.cache.keep_prefixes
    first, *others = random_prompts(9, seed=21, low=100, high=120)
    params = SamplingParams(max_tokens=4, temperature=0)
    llm.generate([first], params)
    for prompt in others:  # one at a time: each would take the first prompt's blocks without the setting
        llm.generate([prompt], params)
    before = llm.engine.stats().prefix_cache_hits
    llm.generate([first], params)
    assert llm.engine.stats().prefix_cache_hits - before == (len(first) - 1) // 4 * 4
    assert llm.engine.cache.invariants() == []


def test_keep_prefix_cache_is_checked(small_model):
    with pytest.raises(ConfigError, match=r"keep_prefix_cache='yes' is not supported; allowed: True or False"):
        ponytail.LLM(small_model[0], kv_cache_memory="4MiB", keep_prefix_cache="yes")


def test_kv_release_after_s_is_checked(small_model):
    with pytest.raises(ConfigError, match=r"kv_release_after_s=-1 is not supported; allowed: seconds >= 0"):
        ponytail.LLM(small_model[0], kv_cache_memory="4MiB", kv_release_after_s=-1)


def test_replica_metrics_take_engine_stats_and_finished_outputs(small_model):
    pytest.importorskip("ray.serve")
    from deployments.app.metrics import ReplicaMetrics

    llm = make_llm(small_model)
    metrics = ReplicaMetrics("test")
    metrics.on_stats(llm.stats())  # counters start from the engine's totals
    outputs = llm.generate(random_prompts(2, seed=11), GREEDY)
    metrics.on_stats(llm.stats())
    observed = {}

    class Recorder:  # stands in for a Ray histogram: what on_finished observes, by metric
        def __init__(self, name):
            self.name = name

        def observe(self, value):
            observed.setdefault(self.name, []).append(value)

    for name in ("ttft", "tpot", "queue_time", "prefill_time"):
        setattr(metrics, name, Recorder(name))
    for output in outputs:
        metrics.on_finished(output)
    assert metrics._last == llm.stats()
    for output, ttft, queue, prefill in zip(outputs, observed["ttft"], observed["queue_time"],
                                            observed["prefill_time"], strict=True):
        m = output.metrics
        assert ttft == m.first_token_time - m.arrival_time and queue >= 0 and prefill > 0
        scheduled = m.first_scheduled_time
        assert (queue, prefill) == (scheduled - m.arrival_time, m.first_token_time - scheduled)


def test_replica_metrics_count_engine_steps_and_busy_seconds(small_model):
    pytest.importorskip("ray.serve")
    from deployments.app.metrics import ReplicaMetrics

    engine = ponytail.AsyncLLM(make_llm(small_model))
    metrics = ReplicaMetrics("test")

    async def run():
        async for _ in engine.generate(random_prompts(1, seed=17)[0], GREEDY):
            pass

    asyncio.run(run())
    assert engine.num_steps >= 12 and engine.step_seconds > 0  # a step per token at least
    metrics.on_engine_loop(engine.num_steps, engine.step_seconds)
    assert metrics._last_loop == (engine.num_steps, engine.step_seconds)


def test_cuda_graph_batch_sizes_cover_every_batch():
    from ponytail.runner.cuda_graphs import graph_batch_sizes

    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    sizes = graph_batch_sizes(100)
    assert sizes[-1] == 100 and all(any(s >= n for s in sizes) for n in range(1, 101))


def test_cuda_graphs_on_a_cpu_model_is_a_clear_error(small_model):
    with pytest.raises(ConfigError, match="cuda_graphs=True needs a CUDA device; the model is on cpu"):
        ponytail.LLM(small_model[0], kv_cache_memory="4MiB", cuda_graphs=True)


def test_token_slice_matches_all_token_ids():
    from ponytail.engine.request import Request

    request = Request(request_id="r", prompt=None, prompt_token_ids=[1, 2, 3], params=SamplingParams(),
                      eos_token_ids=frozenset(), output_token_ids=[4, 5])
    for start in range(6):
        for end in range(start, 6):
            assert request.token_slice(start, end) == request.all_token_ids[start:end]
        assert request.token_slice(start) == request.all_token_ids[start:]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on the CPU needs a C++ compiler (g++ or c++ on PATH)")
def test_compiled_decoder_layers_keep_greedy_output(default_model):
    from ponytail.attention.hf_cache_base import LAYER_INDEX_ATTR
    from ponytail.runner.compile import restore_decoder_layers

    tokenizer = default_model[1]
    model = sharp_llama(tokenizer, layers=8)
    layers = model.model.layers
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 1000) for _ in range(rng.randint(4, 40))] for _ in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = [plain_greedy(model, p, 6) for p in prompts]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        llm = ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="4MiB", max_num_seqs=4, max_model_len=128,
                           compile_model=True)
        assert all("forward" in vars(layer) for layer in layers)  # compiled in place
        # Every layer traces the same index; its own waits where only Ponytail's attention reads it.
        assert [(layer.self_attn.layer_idx, getattr(layer.self_attn, LAYER_INDEX_ATTR)) for layer in layers] == \
            [(0, i) for i in range(len(layers))]
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        # One trace serves every layer: graphs per step shape, not per layer and step shape.
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert 0 < graphs < len(layers), graphs
        # ... and the attention is an op in that graph (attention/compiled_op.py), not a break.
        assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
        # Plain generate on the compiled model (its DynamicCache files K/V by the traced layer_idx,
        # 0 in every layer) runs each layer eagerly with its own index: the same tokens.
        assert [plain_greedy(model, p, 6) for p in prompts] == expected
        assert [layer.self_attn.layer_idx for layer in layers] == [0] * len(layers)
    finally:
        restore_decoder_layers(model)
        torch._dynamo.reset()
    assert not any("forward" in vars(layer) for layer in layers)
    assert [layer.self_attn.layer_idx for layer in layers] == list(range(len(layers)))
    assert not any(hasattr(layer.self_attn, LAYER_INDEX_ATTR) for layer in layers)


def test_compile_defaults_to_off_on_the_cpu(small_model):
    model, tokenizer = small_model
    ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="4MiB", max_num_seqs=4, max_model_len=128)
    assert not any("forward" in vars(layer) for layer in model.model.layers)
    with pytest.raises(ConfigError, match=r"compile_model='yes' is not supported; allowed: True, False or None"):
        ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="4MiB", compile_model="yes")


def test_compile_model_names_what_it_needs():
    from ponytail.runner.compile import can_compile, decoder_layers

    assert not can_compile(torch.nn.Linear(2, 2))  # compile_model=None leaves such a model eager

    with pytest.raises(ConfigError, match="compile_model=True needs a decoder with a `layers` list; Linear"):
        decoder_layers(torch.nn.Linear(2, 2))
