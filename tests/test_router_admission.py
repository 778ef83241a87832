"""KVBlockRouter's admission "engine" (the default): a request counts its prompt and first token
against the blocks the engine would admit a prompt into now (startable_blocks), as the engine
itself admits, where admission "max_tokens" reserves prompt + max_tokens against the blocks left
once every request there finishes.

Same fakes as tests/test_router.py; pools of 64 blocks of 16 tokens.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray.serve")

from test_router import T0, FakeClock, FakeReplica, make_router, ranking, request, run  # noqa: E402

from deployments.app.builder import router_arguments  # noqa: E402
from deployments.app.args import AppArgs  # noqa: E402
from deployments.app.router import KVBlockRouter, request_tokens  # noqa: E402
from ponytail import SamplingParams  # noqa: E402


def reported(replica: FakeReplica, free: int, startable: int, at: float = T0, **kwargs) -> FakeReplica:
    replica.report(free, at, **kwargs)
    replica.stats["startable_blocks"] = startable
    return replica


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_the_default_counts_the_prompt_against_startable_blocks(clock):
    """100 prompt + 60 output tokens: 10 blocks reserved to max_tokens, 7 for the prompt and first
    token. "a" has 8 startable blocks but only 4 once its running requests reach max_tokens."""
    router = make_router(clock, admission="engine")
    a = reported(FakeReplica("a"), free=4, startable=8)
    b = reported(FakeReplica("b"), free=6, startable=6)

    async def body():
        router.update_replicas([a, b])
        # Engine admission: a fits (8 >= 7), b is a block short.
        assert await ranking(router, [a, b], request(100, 60)) == ["a", "b"]
        assert await router._choose_replica_for_request(request(100, 60)) is a
        # The ledger takes the 7 counted blocks off "a" at once: 1 left, the next one goes to b's deficit order.
        assert router._ledgers[a.replica_id].unreported_blocks == 7
        assert await ranking(router, [a, b], request(80, 60)) == ["b", "a"]  # 6 blocks: b fits, a has 1

    run(router, body)
    reserving = make_router(clock, admission="max_tokens", max_hold_s=0)

    async def reserved():
        reserving.update_replicas([a, b])
        # Reserving: 10 blocks fit neither (held, with a hold); b is the smaller deficit (4 against 6).
        assert await ranking(reserving, [a, b], request(100, 60)) == ["b", "a"]

    run(reserving, reserved)


def test_a_replica_without_startable_blocks_is_counted_by_its_free_blocks(clock):
    """An older replica reports free_blocks alone: the router reads them as startable."""
    router = make_router(clock, admission="engine")
    old, new = FakeReplica("old").report(9, T0), reported(FakeReplica("new"), free=2, startable=8)

    async def body():
        router.update_replicas([old, new])
        assert await ranking(router, [old, new], request(100, 60)) == ["old", "new"]  # 9 and 8 free for 7

    run(router, body)


def test_a_request_whose_whole_size_exceeds_every_pool_is_not_held(clock):
    """Its prompt fits now, but prompt + max_tokens (70 blocks) never fits a 64-block pool: no
    replica is worth holding it for, so it goes to the smallest deficit (the engine refuses it with
    a clear error) instead of waiting max_hold_s. One that does fit a pool waits."""
    router = make_router(clock, admission="engine", max_hold_s=10)
    a = reported(FakeReplica("a"), free=0, startable=2)

    async def body():
        router.update_replicas([a])
        too_big = request(100, 1020)  # 7 blocks now, 70 in all
        assert await ranking(router, [a], too_big) == ["a"]
        fits = request(100, 20)  # 7 blocks now, 8 in all
        assert await router.choose_replicas([a], fits) == []  # held: no replica starts it now
        router._claims.clear()

    run(router, body)


def test_a_completion_gives_back_its_output_blocks_so_a_held_request_goes_without_a_report(clock):
    """A request reserved for its prompt and first token (4 blocks for 50 + 1 tokens) held 7 when it
    completed (50 + 60 tokens): the router counts all 7 back at once, so the request held for want of
    room starts where the engine would start it, not a report (0.2-0.5 s) later."""
    router = make_router(clock, admission="engine")
    a, b = reported(FakeReplica("a"), free=2, startable=2), reported(FakeReplica("b"), free=1, startable=1)

    async def body():
        router.update_replicas([a, b])
        busy = request(50, 60)
        router.on_request_routed(busy, a.replica_id, result=None)
        reported(a, free=2, startable=2, at=T0 + 0.01)  # read after the send, with busy at 7 blocks
        clock.advance(0.1)
        pr = request(100, 20)  # 7 blocks for 100 + 1 tokens
        task = asyncio.ensure_future(router._choose_replica_for_request(pr))
        await asyncio.sleep(0.1)
        assert not task.done()
        router.on_request_completed(a.replica_id, busy.metadata.internal_request_id)
        assert router._ledgers[a.replica_id].unreported_blocks == -7  # a: 2 + 7 = 9
        assert await asyncio.wait_for(task, timeout=5) is a

    run(router, body)
    reserving = make_router(clock, admission="max_tokens")

    async def reserved():  # reserved to max_tokens already: nothing grows beyond the reservation
        reserving.update_replicas([a, b])
        busy = request(50, 60)
        reserving.on_request_routed(busy, a.replica_id, result=None)
        reserving.on_request_completed(a.replica_id, busy.metadata.internal_request_id)
        assert reserving._ledgers[a.replica_id].unreported_blocks == 0  # 7 sent, 7 back

    run(reserving, reserved)


def test_request_tokens_without_output_counts_each_samples_first_token():
    async def body():
        pr = request(100, 60)
        assert (request_tokens(pr), request_tokens(pr, output=False)) == (160, 101)
        pr.args[0].sampling = SamplingParams(max_tokens=60, n=3)
        assert (request_tokens(pr), request_tokens(pr, output=False)) == (280, 103)
        router = make_router(FakeClock(), admission="engine")
        assert router.uncounted_tokens(pr) == 280 - 103
        assert make_router(FakeClock(), admission="max_tokens").uncounted_tokens(pr) == 0

    asyncio.run(body())


def test_a_request_without_max_tokens_counts_its_first_token_unless_the_admission_reserves():
    """A chat without max_tokens runs to the end of the context: its sampling carries the bound
    (here a 4,096-token context). Admission "engine" and the affinity count its first token only;
    "max_tokens" reserves the bound, so it never under-counts."""
    clock = FakeClock()
    for admission, blocks in (("engine", 7), ("max_tokens", 263)):  # ceil(101 / 16), ceil(4196 / 16)
        router = make_router(clock, admission=admission)
        a = reported(FakeReplica("a"), free=300, startable=20)

        async def body():
            pr = request(100, 4096)
            pr.args[0].max_tokens_to_context = True
            assert (request_tokens(pr), request_tokens(pr, output=False)) == (101, 101)
            assert request_tokens(pr, reserve=True) == 100 + 4096
            assert router.uncounted_tokens(pr) == 0
            router.update_replicas([a])
            assert await router._choose_replica_for_request(pr) is a
            assert router._ledgers[a.replica_id].unreported_blocks == blocks
            assert router._grown_blocks(pr, None) == 0  # nothing counted for an output not known

        run(router, body)


def test_admission_is_checked_by_router_and_app_args():
    assert KVBlockRouter.ADMISSION == "engine"
    with pytest.raises(ValueError, match=r"admission='reserve'; allowed: engine, max_tokens"):
        make_router(FakeClock(), admission="reserve")
    with pytest.raises(ValueError, match=r"router_admission='reserve' is not supported; allowed: engine, max_tokens"):
        AppArgs.model_validate({"router_admission": "reserve"})
    assert AppArgs().router_admission == "engine"
    for router in ("kv_blocks", "prefix"):
        args = AppArgs.model_validate({"router": router, "router_admission": "max_tokens",
                                       "api_in_engines": False})
        assert router_arguments(args)["admission"] == "max_tokens"
    assert router_arguments(AppArgs.model_validate({"router": "power_of_two"})) == {}
