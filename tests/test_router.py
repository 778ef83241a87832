"""KVBlockRouter without a cluster: fake replicas, an injected clock, Ray's own routing loop.

Built the way Ray's router tests build theirs (test_pow_2_request_router.py): a RunningReplica
subclass that answers queue-length probes from memory, a fake clock, and a check after every test
that no routing task or pending request is left behind.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata  # noqa: E402
from ray.serve.config import RequestRouterConfig  # noqa: E402
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica  # noqa: E402

from deployments.api.protocol import GenerateRequest  # noqa: E402
from ponytail import SamplingParams  # noqa: E402
from deployments.app.router import KVBlockRouter, blocks_needed, request_tokens  # noqa: E402

DEPLOYMENT_ID = DeploymentID(name="EngineReplica", app_name="ponytail")
MAX_ONGOING = 8
T0 = 1_000.0
_ids = itertools.count()


class FakeClock:
    def __init__(self, now: float = T0):
        self.now = now

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeReplica(RunningReplica):
    """What the router reads of a replica: its id, its last stats report and its queue length."""

    def __init__(self, name: str, queue_len: int = 0, probe_delay_s: float = 0.0):
        self._replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT_ID)
        self.stats: dict = {}
        self.queue_len = queue_len
        self.num_probes = 0
        self.probe_delay_s = probe_delay_s  # how long its queue-length probe takes to answer

    def report(self, free_blocks: int, at: float, running: int = 0, waiting: int = 0, block_size: int = 16,
               total_blocks: int = 64):
        self.stats = {"free_blocks": free_blocks, "total_blocks": total_blocks, "num_running": running,
                      "num_waiting": waiting, "block_size": block_size, "time": at}
        return self

    @property
    def replica_id(self) -> ReplicaID:
        return self._replica_id

    @property
    def routing_stats(self) -> dict:
        return self.stats

    @property
    def max_ongoing_requests(self) -> int:
        return MAX_ONGOING

    @property
    def node_id(self) -> str:
        return ""

    @property
    def availability_zone(self):
        return None

    @property
    def multiplexed_model_ids(self) -> set:
        return set()

    def push_proxy_handle(self, handle) -> None:
        pass

    async def get_queue_len(self, *, deadline_s: float) -> int:
        self.num_probes += 1
        if self.probe_delay_s:
            await asyncio.sleep(self.probe_delay_s)
        return self.queue_len

    def try_send_request(self, pr, with_rejection):
        raise NotImplementedError


def make_router(clock: FakeClock, **kwargs) -> KVBlockRouter:
    router = KVBlockRouter(deployment_id=DEPLOYMENT_ID, handle_source=DeploymentHandleSource.REPLICA,
                           self_actor_id="fake-actor-id", self_actor_handle=None,
                           use_replica_queue_len_cache=True, get_curr_time_s=clock.time,
                           initial_backoff_s=0.001, backoff_multiplier=1, max_backoff_s=0.001)
    # These tests pin the reservation arithmetic (prompt + max_tokens against free_blocks);
    # test_router_admission.py covers the default, admission "engine".
    kwargs.setdefault("admission", "max_tokens")
    router.initialize_state(clock=clock.time, **kwargs)
    return router


def run(router: KVBlockRouter, body) -> None:
    """Runs `body()` on a fresh event loop, then checks no routing work is left behind."""

    async def main():
        await body()
        for _ in range(3):  # routing tasks that were just fulfilled exit on their next turn
            await asyncio.sleep(0)
        assert router.curr_num_routing_tasks == 0
        assert router.num_pending_requests == 0

    asyncio.run(main())


def request(prompt_tokens: int = 100, max_tokens: int | None = 20, request_id: str | None = None) -> PendingRequest:
    """A pending generate call (create inside a running loop: PendingRequest makes a Future)."""
    sampling = SamplingParams() if max_tokens is None else SamplingParams(max_tokens=max_tokens)
    internal_id = request_id or f"req-{next(_ids)}"
    return PendingRequest(args=[GenerateRequest(prompt=list(range(prompt_tokens)), sampling=sampling)],
                          kwargs={}, metadata=RequestMetadata(request_id=internal_id, internal_request_id=internal_id,
                                                              is_streaming=True))


async def ranking(router: KVBlockRouter, replicas, pr: PendingRequest | None = None) -> list[str]:
    ranks = await router.choose_replicas(replicas, pr if pr is not None else request())
    assert all(len(rank) == 1 for rank in ranks)  # one replica per rank: Ray keeps our order
    return [rank[0].replica_id.unique_id for rank in ranks]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_request_size_in_blocks():
    async def body():
        assert request_tokens(request(prompt_tokens=100, max_tokens=20)) == 120
        assert blocks_needed(128, 16) == 8 and blocks_needed(129, 16) == 9
        assert request_tokens(request(prompt_tokens=100, max_tokens=None)) == 116  # default max_tokens 16
        samples = request(prompt_tokens=100, max_tokens=20)
        samples.args[0].sampling = SamplingParams(max_tokens=20, n=3)
        assert request_tokens(samples) == 100 + 3 * 20  # n samples share the prompt, each has its outputs
        samples.args[0].sampling = SamplingParams(max_tokens=20, n=3, best_of=5)
        assert request_tokens(samples) == 100 + 5 * 20
        text = PendingRequest(args=[GenerateRequest(prompt="x" * 300)], kwargs={},
                              metadata=RequestMetadata(request_id="t", internal_request_id="t"))
        assert request_tokens(text) == 300 // 3 + 16 + 16
        other = PendingRequest(args=[{"prompt": "hi"}], kwargs={},
                               metadata=RequestMetadata(request_id="o", internal_request_id="o"))
        assert request_tokens(other) is None and blocks_needed(None, 16) == 0
        assert request_tokens(None) is None

    asyncio.run(body())


def test_more_free_blocks_wins(clock):
    router = make_router(clock)
    small = FakeReplica("small").report(10, T0)
    big = FakeReplica("big").report(40, T0)
    mid = FakeReplica("mid").report(25, T0)
    replicas = [small, big, mid]

    async def body():
        router.update_replicas(replicas)
        assert await ranking(router, replicas) == ["big", "mid", "small"]
        # Through Ray's routing loop: the first rank is taken when its queue has room.
        assert await router._choose_replica_for_request(request()) is big

    run(router, body)


def test_ties_go_to_fewer_running_and_waiting(clock):
    router = make_router(clock)
    busy = FakeReplica("busy").report(30, T0, running=5, waiting=2)
    idle = FakeReplica("idle").report(30, T0, running=1, waiting=1)

    async def body():
        router.update_replicas([busy, idle])
        assert await ranking(router, [busy, idle]) == ["idle", "busy"]

    run(router, body)


def test_a_fresh_report_outranks_rays_queue_length_cache(clock):
    """Ray's cache takes a replica's accept reply, which counts every call running there (another
    handle's `report`), and only this router's completions count it down: it can say 1 for an idle
    replica for 10 s. A fresh report and this router's own calls in flight say what runs there."""
    router = make_router(clock)
    a, b = FakeReplica("a").report(40, T0), FakeReplica("b").report(30, T0)

    async def body():
        router.update_replicas([a, b])
        router.on_new_queue_len_info(a.replica_id, 2)  # our call and a monitoring call were running
        router.decrement_queue_len_cache(a.replica_id)  # ours completed; the cache still says 1
        assert router.replica_queue_len_cache.get(a.replica_id) == 1
        assert await ranking(router, [a, b]) == ["a", "b"]  # idle both: more free blocks
        router.on_request_routed(request(), a.replica_id, result=None)  # ours, in flight: load 1
        assert await ranking(router, [a, b]) == ["b", "a"]

    run(router, body)


def test_large_request_goes_to_the_replica_that_fits(clock):
    router = make_router(clock)
    four, eight = FakeReplica("four").report(4, T0), FakeReplica("eight").report(8, T0)
    silent = FakeReplica("silent")  # no report yet
    replicas = [four, silent, eight]

    async def body():
        router.update_replicas(replicas)
        # 108 + 20 tokens = 8 blocks: only "eight" has room; "four" is short, below the unknown one.
        assert await ranking(router, replicas, request(108, 20)) == ["eight", "silent", "four"]
        # 9 blocks fit nowhere known: the unreported replica first, then the smallest deficit.
        assert await ranking(router, replicas, request(109, 20)) == ["silent", "eight", "four"]
        # A small request fits both; most free first.
        assert await ranking(router, replicas, request(10, 5)) == ["eight", "four", "silent"]
        assert await router._choose_replica_for_request(request(108, 20)) is eight
        # Chosen, its 8 blocks are reserved there at once: "eight" has none left for the next one.
        assert await ranking(router, replicas, request(10, 5)) == ["four", "silent", "eight"]

    run(router, body)


def test_ledger_subtracts_sends_until_a_newer_report(clock):
    router = make_router(clock)
    a, b = FakeReplica("a").report(10, T0), FakeReplica("b").report(7, T0, running=5)
    seven = lambda: request(100, 12)  # noqa: E731  (7 blocks: fits b, and a while a has 7 free)

    async def body():
        router.update_replicas([a, b])
        pr = request(50, 14)  # 64 tokens = 4 blocks
        clock.advance(0.1)
        assert await router._choose_replica_for_request(pr) is a  # reserved at once, before a accepts it
        assert await ranking(router, [a, b], seven()) == ["b", "a"]  # a: 10 - 4 = 6 < 7
        router.on_request_routed(pr, a.replica_id, result=None)  # accepted: not charged twice
        assert router._ledgers[a.replica_id].unreported_blocks == 4
        assert await ranking(router, [a, b], seven()) == ["b", "a"]

        # The same report again, or one read before the send, cannot show it yet.
        a.report(10, T0 + 0.05)
        assert await ranking(router, [a, b], seven()) == ["b", "a"]
        # A report read after the send already counts it: the ledger starts over.
        a.report(10, T0 + 0.2)
        assert await ranking(router, [a, b], seven()) == ["a", "b"]  # both fit; b is busier

        # Completions give their blocks back at once, until a report counts them.
        clock.advance(0.2)
        pr2, pr3 = request(50, 14), request(50, 14)
        router.on_request_routed(pr2, a.replica_id, result=None)
        router.on_request_routed(pr3, a.replica_id, result=None)
        assert await ranking(router, [a, b], seven()) == ["b", "a"]  # a: 10 - 8 = 2
        router.on_request_completed(a.replica_id, pr2.metadata.internal_request_id)
        assert router._ledgers[a.replica_id].unreported_blocks == 4  # a: 10 - 8 + 4 = 6
        assert await ranking(router, [a, b], seven()) == ["b", "a"]
        router.on_request_completed(a.replica_id, pr3.metadata.internal_request_id)
        assert router._ledgers[a.replica_id].unreported_blocks == 0  # a: 10 again
        assert await ranking(router, [a, b], seven()) == ["a", "b"]  # both fit; b is busier
        a.report(10, clock.time() + 0.01)  # read after both completions: it counts them
        await ranking(router, [a, b], seven())
        assert router._ledgers[a.replica_id].unreported_blocks == 0

    run(router, body)


def test_a_request_no_replica_has_room_for_waits_for_the_first_to_free_blocks(clock):
    """Held in the router, not queued in one engine: it goes where blocks free up first."""
    router = make_router(clock)
    a, b = FakeReplica("a").report(4, T0), FakeReplica("b").report(3, T0)

    async def body():
        router.update_replicas([a, b])
        busy = request(50, 14)  # 4 blocks, running on b
        router.on_request_routed(busy, b.replica_id, result=None)
        b.report(3, T0 + 0.01)  # read after the send: counts the busy request
        clock.advance(0.1)
        pr = request(100, 20)  # 8 blocks: a has 4, b 3
        assert await router.choose_replicas([a, b], pr) == []
        assert not pr.routing_context.should_backoff  # the router paces its own polls
        task = asyncio.ensure_future(router._choose_replica_for_request(pr))
        await asyncio.sleep(0.1)
        assert not task.done()
        router.on_request_completed(b.replica_id, busy.metadata.internal_request_id)  # b: 3 + 4 = 7
        await asyncio.sleep(0.1)
        assert not task.done()
        b.report(9, clock.time() + 0.01)
        assert await asyncio.wait_for(task, timeout=5) is b

    run(router, body)


def test_a_held_request_is_sent_after_max_hold_s(clock):
    router = make_router(clock, max_hold_s=2.0)
    a, b = FakeReplica("a").report(4, T0), FakeReplica("b").report(6, T0)

    async def body():
        router.update_replicas([a, b])
        task = asyncio.ensure_future(router._choose_replica_for_request(request(100, 20)))  # 8 blocks
        await asyncio.sleep(0.1)
        assert not task.done()
        clock.advance(1.0)
        a.report(4, clock.time()), b.report(6, clock.time())  # still fresh, still short
        await asyncio.sleep(0.1)
        assert not task.done()
        clock.advance(1.0)
        a.report(4, clock.time()), b.report(6, clock.time())
        assert await asyncio.wait_for(task, timeout=5) is b  # the smaller deficit

    run(router, body)


def test_requests_are_not_held_without_fresh_reports_or_when_they_never_fit(clock):
    router = make_router(clock)
    a, b = FakeReplica("a").report(4, T0, total_blocks=64), FakeReplica("b").report(6, T0, total_blocks=64)
    silent = FakeReplica("silent")

    async def body():
        router.update_replicas([a, b, silent])
        # An unreported replica may have room: try it first, hold nothing.
        assert await ranking(router, [a, b, silent], request(100, 20)) == ["silent", "b", "a"]
        # 65 blocks exceed every pool: send it now, the engine refuses it with a clear error.
        assert await ranking(router, [a, b], request(1000, 40)) == ["b", "a"]
        never = make_router(clock, max_hold_s=0)
        never.update_replicas([a, b])
        assert await ranking(never, [a, b], request(100, 20)) == ["b", "a"]

    run(router, body)


def test_stale_stats_fall_back_to_queue_length(clock):
    router = make_router(clock)
    replicas = [FakeReplica("r1").report(60, T0), FakeReplica("r2").report(5, T0), FakeReplica("r3").report(30, T0)]
    r1, r2, r3 = replicas

    async def body():
        router.update_replicas(replicas)
        assert await ranking(router, replicas) == ["r1", "r3", "r2"]
        clock.advance(router.STATS_MAX_AGE_S + 0.1)

        # No queue-length information at all: this router's own in-flight requests decide.
        for replica, n in ((r1, 2), (r3, 1)):
            for _ in range(n):
                router.on_request_routed(request(), replica.replica_id, result=None)
        assert await ranking(router, replicas) == ["r2", "r3", "r1"]

        # Ray's queue-length cache (probes, rejection replies) wins when it knows more.
        router.on_new_queue_len_info(r2.replica_id, 5)
        assert await ranking(router, replicas) == ["r3", "r1", "r2"]

        # A fresh report puts that replica back in the block tiers, ahead of the stale ones.
        r2.report(50, clock.time())
        assert (await ranking(router, replicas))[0] == "r2"

    run(router, body)


def test_stats_max_age_comes_from_router_kwargs(clock):
    router = make_router(clock, stats_max_age_s=10.0)
    old, new = FakeReplica("old").report(50, T0), FakeReplica("new").report(20, T0 + 4)
    clock.advance(5)

    async def body():
        router.update_replicas([old, new])
        assert await ranking(router, [old, new]) == ["old", "new"]  # 5 s old is fresh at 10 s

    run(router, body)


def test_dead_replica_is_never_chosen(clock):
    router = make_router(clock)
    best = FakeReplica("best").report(60, T0)
    ok = FakeReplica("ok").report(20, T0)
    gone = FakeReplica("gone").report(10, T0)
    replicas = [best, ok, gone]

    async def body():
        router.update_replicas(replicas)
        router.on_request_routed(request(), best.replica_id, result=None)
        router.on_replica_actor_died(best.replica_id)
        # Even when the caller's candidate list still holds it.
        assert await ranking(router, replicas) == ["ok", "gone"]
        for _ in range(3):  # the live ones take turns (each choice counts as load until a report)
            assert await router._choose_replica_for_request(request(10, 5)) in (ok, gone)
        router.update_replicas([ok])  # the controller's next broadcast drops "gone" as well
        assert await ranking(router, replicas) == ["ok"]
        assert set(router._ledgers) == {ok.replica_id}
        router.on_request_completed(best.replica_id, "late")  # a late callback must not revive it
        assert best.replica_id not in router._ledgers

    run(router, body)


def test_full_replica_is_skipped_and_backoff_is_asked_for(clock):
    router = make_router(clock)
    full = FakeReplica("full", queue_len=MAX_ONGOING).report(60, T0)
    room = FakeReplica("room").report(20, T0)

    async def body():
        router.update_replicas([full, room])
        pr = request()
        assert await router.choose_replicas([full, room], pr)
        assert pr.routing_context.should_backoff  # else Ray retries without sleeping when all are full
        assert await router._choose_replica_for_request(request()) is room

    run(router, body)


def test_concurrent_calls_sharing_an_internal_request_id_are_all_routed(clock):
    """Engine calls made while serving one ingress request share internal_request_id (n > 1)."""
    router = make_router(clock)
    a, b = FakeReplica("a").report(30, T0), FakeReplica("b").report(20, T0)

    async def body():
        router.update_replicas([a, b])
        calls = [router._choose_replica_for_request(request(request_id="shared")) for _ in range(3)]
        chosen = await asyncio.wait_for(asyncio.gather(*calls), timeout=5)
        assert set(chosen) <= {a, b}

    run(router, body)


def test_malformed_stats_count_as_no_report(clock):
    router = make_router(clock)
    bad = FakeReplica("bad")
    bad.stats = {"free_blocks": "many", "time": T0}
    good = FakeReplica("good").report(1, T0)

    async def body():
        router.update_replicas([bad, good])
        assert await ranking(router, [bad, good], request(10, 5)) == ["good", "bad"]

    run(router, body)


def test_router_kwargs_are_checked(clock):
    with pytest.raises(ValueError, match="stats_max_age"):
        make_router(clock, stats_max_age=3)
    with pytest.raises(ValueError, match="stats_max_age_s"):
        make_router(clock, stats_max_age_s=0)
    with pytest.raises(ValueError, match=r"max_hold_s=-1; expected seconds >= 0"):
        make_router(clock, max_hold_s=-1)


def test_request_router_config_imports_the_router():
    config = RequestRouterConfig(request_router_class="deployments.app.router:KVBlockRouter",
                                 request_routing_stats_period_s=0.2, request_routing_stats_timeout_s=0.2,
                                 request_router_kwargs={"stats_max_age_s": 1.0})
    assert config.get_request_router_class().__name__ == "KVBlockRouter"


def test_memory_filters_and_load_ranks_among_replicas_with_room(clock):
    router = make_router(clock)
    roomy_busy = FakeReplica("roomy_busy").report(60, T0, running=6)
    tight_idle = FakeReplica("tight_idle").report(10, T0, running=1)
    replicas = [roomy_busy, tight_idle]

    async def body():
        router.update_replicas(replicas)
        # 4 blocks fit both: the less loaded replica computes it sooner.
        assert await ranking(router, replicas, request(50, 14)) == ["tight_idle", "roomy_busy"]
        # 16 blocks fit only the roomy one: memory decides, whatever the load.
        assert await ranking(router, replicas, request(200, 56)) == ["roomy_busy", "tight_idle"]

    run(router, body)


def test_kv_in_use_and_load_weigh_together(clock):
    """A replica busy with one long prompt loses to one with two short requests and a pool mostly
    free: score = share of the pool in use + load / largest load (0.84 + 0.5 against 0.06 + 1)."""
    router = make_router(clock)
    long_prompt = FakeReplica("long_prompt").report(10, T0, running=1)
    two_short = FakeReplica("two_short").report(60, T0, running=2)
    replicas = [long_prompt, two_short]

    async def body():
        router.update_replicas(replicas)
        assert await ranking(router, replicas, request(20, 12)) == ["two_short", "long_prompt"]
        # Four more requests on the mostly free replica tip the balance back (0.84 + 1/6 < 0.06 + 1).
        two_short.report(60, T0, running=6)
        assert await ranking(router, replicas, request(20, 12)) == ["long_prompt", "two_short"]

    run(router, body)


def test_without_a_pool_size_load_alone_ranks(clock):
    router = make_router(clock)
    busy, idle = FakeReplica("busy").report(10, T0, running=3), FakeReplica("idle").report(5, T0, running=1)
    for replica in (busy, idle):
        del replica.stats["total_blocks"]  # an older replica build: no pool size in its stats

    async def body():
        router.update_replicas([busy, idle])
        assert await ranking(router, [busy, idle], request(20, 12)) == ["idle", "busy"]

    run(router, body)


def test_the_chosen_replica_goes_to_the_request_it_was_ranked_for(clock):
    """Routing tasks finish out of order: a replica ranked for the newer 4k-token request must not
    go to the older short one (FIFO order decides only when the ranked request is gone)."""
    router = make_router(clock)
    a = FakeReplica("a").report(400, T0)

    async def body():
        router.update_replicas([a])
        older, newer = request(10, 5), request(4000, 128)
        for pending in (older, newer):
            router._pending_requests_to_fulfill.append(pending)
            router._add_pending_request_to_indices(pending)
        router._fulfill_next_pending_request(a, newer.metadata)
        assert newer.future.done() and newer.future.result() is a and not older.future.done()
        gone = RequestMetadata(request_id="gone", internal_request_id="gone")
        router._fulfill_next_pending_request(a, gone)  # ranked request already served: FIFO
        assert older.future.done() and older.future.result() is a

    asyncio.run(body())


def test_a_burst_routed_out_of_order_still_sends_the_long_prompt_where_it_fits(clock):
    """Through Ray's routing loop: the short request (older) ranks "roomy-but-busy" below "small",
    whose queue-length probe is slow; the long one fits only "roomy", whose probe answers first.
    Matched by arrival order, "roomy" would go to the short request and the long one to "small"."""
    router = make_router(clock)
    roomy = FakeReplica("roomy").report(300, T0, total_blocks=1000)  # 70% in use, room for 258 blocks
    small = FakeReplica("small", probe_delay_s=0.02).report(50, T0)  # 22% in use, 50 blocks

    async def body():
        router.update_replicas([roomy, small])
        short, long = request(100, 20), request(4000, 128)  # 8 and 258 blocks
        assert await ranking(router, [roomy, small], short) == ["small", "roomy"]
        assert await ranking(router, [roomy, small], long) == ["roomy", "small"]
        chosen = await asyncio.wait_for(asyncio.gather(router._choose_replica_for_request(short),
                                                       router._choose_replica_for_request(long)), timeout=5)
        assert chosen == [small, roomy]

    run(router, body)


def test_a_burst_is_spread_before_any_replica_has_accepted(clock):
    """Blocks are reserved when a replica is chosen, not when it accepts (a round trip later): in a
    burst, the second long prompt must not see the first one's blocks as still free."""
    router = make_router(clock)
    a = FakeReplica("a").report(300, T0 + 0.01, total_blocks=1000)
    b = FakeReplica("b").report(280, T0 + 0.01, total_blocks=1000)

    async def body():
        router.update_replicas([a, b])
        clock.advance(0.1)
        first, second = request(4000, 128), request(4000, 128)  # 258 blocks each
        assert await router._choose_replica_for_request(first) is a
        assert await router._choose_replica_for_request(second) is b  # a has 42 left
        router.on_request_routed(first, a.replica_id, result=None)
        router.on_request_routed(second, b.replica_id, result=None)
        assert [router._ledgers[r.replica_id].unreported_blocks for r in (a, b)] == [258, 258]

    run(router, body)


def test_a_request_another_replica_took_moves_its_reservation(clock):
    """The chosen replica was full (it rejected the request) and Ray sent it elsewhere."""
    router = make_router(clock)
    a, b = FakeReplica("a").report(60, T0), FakeReplica("b").report(20, T0)

    async def body():
        router.update_replicas([a, b])
        clock.advance(0.1)
        pr = request(100, 20)  # 8 blocks
        assert await router._choose_replica_for_request(pr) is a
        router.on_request_routed(pr, b.replica_id, result=None)
        assert router._ledgers[a.replica_id].unreported_blocks == 0
        assert router._ledgers[b.replica_id].unreported_blocks == 8
        assert router._ledgers[b.replica_id].num_in_flight == 1 and router._ledgers[a.replica_id].num_in_flight == 0

    run(router, body)


def test_reservations_of_requests_never_sent_are_dropped(clock):
    router = make_router(clock)
    a = FakeReplica("a").report(60, T0)

    async def body():
        router.update_replicas([a])
        clock.advance(0.1)
        await router._choose_replica_for_request(request(100, 20))  # cancelled before it was sent
        assert len(router._reservations) == 1
        clock.advance(router.stats_max_age_s + 0.1)
        a.report(60, clock.time())
        await router._choose_replica_for_request(request(100, 20))
        assert len(router._reservations) == 1  # only the new one
        assert router._ledgers[a.replica_id].num_in_flight == 0  # nothing was ever accepted

    run(router, body)
