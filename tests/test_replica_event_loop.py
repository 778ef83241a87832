"""A huge prompt cannot stall the engine replica's event loop (which sends every stream's deltas):
it is tokenized in a worker thread, and one certainly over the context is refused before that."""

import asyncio
import dataclasses
import re
import time

import pytest

pytest.importorskip("ray.serve")

import ponytail  # noqa: E402
from deployments.api.protocol import GenerateRequest  # noqa: E402
from ponytail import SamplingParams  # noqa: E402
from deployments.app.replica import EngineReplica  # noqa: E402

pytestmark = pytest.mark.network  # the default model

HUGE = "lorem ipsum dolor sit amet " * 200_000  # 5.4 MB


async def run_with_ticker(replica, request):
    """(the error generate raised, seconds it took, longest pause of a 5 ms ticker meanwhile)."""
    gaps, done = [], asyncio.Event()

    async def ticker():
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    started = time.perf_counter()
    error = None
    try:
        async for _ in replica.generate(request):
            pass
    except ponytail.ContextLengthError as exc:
        error = exc
    took = time.perf_counter() - started
    done.set()
    await task
    return error, took, max(gaps, default=0.0)


def test_a_5mb_prompt_is_tokenized_off_the_event_loop_or_refused_before(default_model):
    replica = EngineReplica(engine=dict(device="cpu", kv_cache_memory="64MiB", max_num_seqs=4, max_model_len=2048))

    async def main():
        bound = replica.bounds
        replica.bounds = dataclasses.replace(bound, max_token_bytes=None)  # tokenize it all, to see the loop while that runs
        tokenized = await run_with_ticker(replica, GenerateRequest(prompt=HUGE, sampling=SamplingParams(max_tokens=4),
                                                                   request_id="huge-1"))
        replica.bounds = bound
        refused = await run_with_ticker(replica, GenerateRequest(
            messages=[{"role": "user", "content": HUGE}], sampling=SamplingParams(max_tokens=4), request_id="huge-2"))
        ok = [d async for d in replica.generate(GenerateRequest(prompt="Hello", sampling=SamplingParams(max_tokens=2),
                                                                 request_id="small"))]
        return tokenized, refused, ok

    (error, took, longest_pause), (refusal, refused_in, _), ok = asyncio.run(main())
    assert re.fullmatch(r"prompt has \d{7} tokens; allowed: at most 2048 \(max_prompt_tokens, max_model_len=2048\)",
                        str(error)), str(error)
    assert error.too_many_tokens == "prompt"
    # The loop kept ticking through seconds of tokenizing: its longest pause is a small share of it.
    assert longest_pause < took / 10, (longest_pause, took)
    least = len(HUGE.encode()) // replica.bounds.max_token_bytes
    assert str(refusal) == (f"prompt has at least {least} tokens ({len(HUGE)} bytes of text, at most "
                            f"{replica.bounds.max_token_bytes} per token); allowed: at most 2048 (max_model_len=2048)")
    assert refused_in < took / 10, (refused_in, took)
    assert ok[-1].finished and ok[-1].completion_tokens == 2
    assert replica.llm.stats().used_blocks == 0
