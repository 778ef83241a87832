"""ProcessAsyncLLM: the engine's step loop in a child process gives what AsyncLLM gives in-process
(tokens, text, aborts, refusals with their messages, counters, prefix events), and a dead child
fails every stream with a clear error instead of hanging it."""

import asyncio
import os
import signal
import time

import pytest
import ponytail
from ponytail import ConfigError, ContextLengthError, EngineDeadError, SamplingParams
from tiny_models import sharp_llama

pytestmark = pytest.mark.network  # the default model's tokenizer

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm_kwargs(default_model):
    """A random 2-layer Llama with the default model's tokenizer (both pickle into the child)."""
    _, tokenizer = default_model
    return dict(model=sharp_llama(tokenizer), tokenizer=tokenizer, kv_cache_memory="4MiB", block_size=4, max_num_seqs=8,
                max_model_len=256, max_num_batched_tokens=2048)


@pytest.fixture(scope="module")
def engine(llm_kwargs):
    engine = ponytail.ProcessAsyncLLM(llm_kwargs, prefix_log_capacity=4096)
    yield engine
    engine.shutdown()


def collect(engine, prompt, params, stop_after=None):
    async def run():
        deltas = []
        async for delta in engine.generate(prompt, params):
            deltas.append(delta)
            if stop_after is not None and len(deltas) == stop_after:
                break
        return deltas
    return run()


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the engine process's counters never got there"
        time.sleep(0.02)


def test_streams_give_the_in_process_engines_tokens_and_text(engine, llm_kwargs):
    prompts = ["The capital of France is", [11, 12, 13, 14, 15, 16], "Once upon a time"]
    short = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)

    async def main(llm):
        return await asyncio.gather(collect(llm, prompts[0], GREEDY), collect(llm, prompts[1], GREEDY),
                                    collect(llm, prompts[2], short))

    remote = asyncio.run(main(engine))
    local = asyncio.run(main(ponytail.AsyncLLM(ponytail.LLM(**llm_kwargs))))
    for got, want in zip(remote, local):
        assert [t for d in got for t in d.new_token_ids] == want[-1].output.token_ids
        assert "".join(d.delta_text for d in got) == want[-1].output.text
        assert got[-1].finished and not any(d.finished for d in got[:-1])
        assert got[-1].output.token_ids == want[-1].output.token_ids
        assert got[-1].output.outputs[0].finish_reason == "length"
    assert len(remote[2][-1].output.token_ids) == 5
    assert remote[0][-1].output.prompt_token_ids == local[0][-1].output.prompt_token_ids
    wait_for(lambda: engine.stats().num_running == 0)
    assert engine.stats().used_blocks == 0
    assert engine.num_steps > 0 and engine.step_seconds > 0


def test_a_stream_left_early_is_aborted_and_its_blocks_go_back(engine):
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    cut = asyncio.run(collect(engine, "a prompt whose answer nobody reads to the end", params, stop_after=2))
    assert len(cut) == 2 and not cut[-1].finished
    wait_for(lambda: engine.stats().used_blocks == 0 and engine.stats().num_running == 0)

    async def aborted():
        deltas = []
        async for delta in engine.generate("abort me from outside", params, request_id="outside"):
            deltas.append(delta)
            if len(deltas) == 1:
                assert await engine.abort("outside")
        return deltas

    deltas = asyncio.run(aborted())
    assert deltas[-1].finished and deltas[-1].output.outputs[0].finish_reason == "abort"
    assert len(deltas[-1].output.token_ids) < 200
    wait_for(lambda: engine.stats().used_blocks == 0)


@pytest.mark.parametrize("prompt, params, error, message", [
    ([10**9], GREEDY, ConfigError, r"prompt=\[1000000000\]: token ids outside the vocabulary; allowed: token ids in"),
    ("hi", SamplingParams(max_tokens=1000), ContextLengthError, r"max_tokens \(1000\) = \d+ exceeds max_model_len=256"),
])
def test_a_refused_request_raises_its_error_from_the_stream_and_others_run_on(engine, prompt, params, error, message):
    async def main():
        good = asyncio.ensure_future(collect(engine, "still served", GREEDY))
        with pytest.raises(error, match=message):
            await collect(engine, prompt, params)
        return await good

    assert len(asyncio.run(main())[-1].output.token_ids) == 12


def test_priority_salt_and_bad_words_cross_into_the_engine_process(engine, llm_kwargs):
    """The request's priority and cache_salt (its prompt dict) and bad words (tokenized in the child)
    reach the child's engine: under fcfs a priority is refused from the stream; a salted prompt
    misses the unsalted prefix it repeats; bad words change the greedy tokens as in process."""
    async def last(prompt, params=GREEDY, **kwargs):
        async for delta in engine.generate(prompt, params, **kwargs):
            final = delta
        return final

    async def main():
        with pytest.raises(ConfigError, match=r"priority=3 needs scheduling_policy='priority'"):
            await last("hi", priority=3)
        words = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
        await last(words)
        salted = await last({"prompt": words, "cache_salt": "tenant"})
        again = await last(words)
        plain = await last("The cat sat")
        word = llm_kwargs["tokenizer"].decode(plain.output.outputs[0].token_ids[:1]).strip()
        banned = await last("The cat sat", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                          bad_words=[word]))
        return salted, again, plain, banned

    salted, again, plain, banned = asyncio.run(main())
    assert salted.output.metrics.num_cached_prompt_tokens == 0 < again.output.metrics.num_cached_prompt_tokens
    assert banned.output.token_ids != plain.output.token_ids


def test_a_duplicate_request_id_is_refused(engine):
    async def main():
        first = engine.generate("one", SamplingParams(max_tokens=50, ignore_eos=True), request_id="same")
        await first.__anext__()
        with pytest.raises(ConfigError, match="request_id='same' is already in use"):
            await _one(engine.generate("two", GREEDY, "same"))
        await first.aclose()

    asyncio.run(main())


async def _one(stream):
    async for delta in stream:
        return delta


def test_prefix_events_and_hits_reach_this_process(engine):
    shared = list(range(100, 164))  # 16 full blocks of 4
    asyncio.run(collect(engine, shared + [7, 8], GREEDY))
    before = engine.stats().prefix_cache_hits
    asyncio.run(collect(engine, shared + [9, 10], GREEDY))
    wait_for(lambda: engine.stats().prefix_cache_hits >= before + 64)
    log = engine.publish_prefix_events(4096)
    hashes = {e.block_hash for e in log.since(0) if e.stored}
    assert set(ponytail.prefix_block_hashes(shared, 4)) <= hashes
    with pytest.raises(ConfigError, match=r"capacity=10: this engine records prefix events only as asked"):
        engine.publish_prefix_events(10)


def test_a_bad_engine_argument_fails_the_constructor_with_its_message(llm_kwargs):
    with pytest.raises(ConfigError, match=r"kv_cache_memory"):
        ponytail.ProcessAsyncLLM({**llm_kwargs, "kv_cache_memory": "lots"})


def test_a_dead_engine_process_fails_open_streams_and_later_requests(llm_kwargs):
    engine = ponytail.ProcessAsyncLLM(llm_kwargs)
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def main():
        stream = engine.generate("a long answer", params)
        await stream.__anext__()
        os.kill(engine._process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=r"the engine process stopped \(it exited with code -9"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await _one(engine.generate("after", GREEDY))

    asyncio.run(main())
    assert engine.dead is not None
    engine.shutdown()  # nothing left to stop: no error


def test_shutdown_stops_the_process_and_is_idempotent(llm_kwargs):
    engine = ponytail.ProcessAsyncLLM(llm_kwargs)
    assert asyncio.run(collect(engine, "hello", GREEDY))[-1].finished
    engine.shutdown()
    engine.shutdown()
    assert not engine._process.is_alive() and engine._process.exitcode == 0
    with pytest.raises(EngineDeadError, match="it was shut down"):
        asyncio.run(_one(engine.generate("after", GREEDY)))


def test_beam_search_in_the_engine_process_equals_the_in_process_one(engine, llm_kwargs):
    """The child sends its EOS ids with its tokenizer: beams end and rank there as in LLM.beam_search."""
    params = ponytail.BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5)
    prompt = engine.tokenizer("Name a fruit.")["input_ids"]
    assert engine.eos_token_ids and engine.eos_token_ids == ponytail.LLM(**llm_kwargs).engine.eos_token_ids
    remote = asyncio.run(engine.beam_search(prompt, params, "beams"))
    local = ponytail.LLM(**llm_kwargs).beam_search([prompt], params)[0]
    assert [(s.tokens, s.text, s.finish_reason) for s in remote.sequences] == \
        [(s.tokens, s.text, s.finish_reason) for s in local.sequences]
    wait_for(lambda: engine.stats().used_blocks == 0)
