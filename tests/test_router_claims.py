"""KVBlockRouter's claims: a held request claims the replica closest to fitting it, and the oldest
claim holds against the requests that arrived after it (EASY backfilling), so a held 4k-token
prompt is not starved by later short ones.

Same fakes as tests/test_router.py (fake replicas, an injected clock, Ray's own routing loop).
Pools of 64 blocks of 16 tokens; "long" requests take 8 blocks (100 + 28 tokens), "short" ones 2
(20 + 12), "busy" ones (already running on a replica) 4 (50 + 14).
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from deployments.app.router_accounting import HOLDS, HeldRequest  # noqa: E402
from test_router import T0, FakeClock, FakeReplica, make_router, ranking, request, run  # noqa: E402


def long() -> PendingRequest:
    return request(100, 28)


def short() -> PendingRequest:
    return request(20, 12)


def claims(router) -> list[tuple[str, int]]:
    """(replica, blocks) of every claim, sorted."""
    return sorted((claim.replica_id.unique_id, claim.blocks) for claim in router._claims.values())


def running_on(router, replica, free: int) -> PendingRequest:
    """A 4-block request running on `replica`, whose next report (`free` blocks) counts it."""
    pr = request(50, 14)
    router.on_request_routed(pr, replica.replica_id, result=None)
    replica.report(free, T0 + 0.01)
    return pr


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_a_later_short_request_does_not_take_the_blocks_a_held_long_one_waits_for(clock):
    """The long request waits for "a" (5 of its 8 blocks free, "b" has 2). A short request arriving
    later goes to "b" while "b" has room, then waits rather than take "a"'s blocks; the long one
    goes the moment "a" frees enough. Without the claim the second short request took 2 of "a"'s
    blocks, and when "a"'s running request finished the long one was still a block short."""
    router = make_router(clock)
    a, b = FakeReplica("a").report(5, T0), FakeReplica("b").report(2, T0 + 0.01)

    async def body():
        router.update_replicas([a, b])
        busy = running_on(router, a, free=5)
        clock.advance(0.1)
        held = asyncio.ensure_future(router._choose_replica_for_request(long()))
        await asyncio.sleep(0.05)
        assert not held.done() and claims(router) == [("a", 8)]  # deficit 3 there, 6 on "b"

        first = short()  # "a" counts 5 - 8 = -3 free blocks for it, "b" 2
        assert await ranking(router, [a, b], first) == ["b", "a"]
        assert await router._choose_replica_for_request(first) is b
        later = asyncio.ensure_future(router._choose_replica_for_request(short()))  # now "b" is full too
        await asyncio.sleep(0.05)
        assert not later.done() and not held.done()
        assert claims(router) == [("a", 8), ("b", 2)]  # its deficit: 2 - (5 - 8) = 5 on "a", 2 on "b"

        router.on_request_completed(a.replica_id, busy.metadata.internal_request_id)  # "a": 5 + 4 = 9
        assert await asyncio.wait_for(held, timeout=5) is a
        assert ("a", 8) not in claims(router)  # routed: its 8 blocks are in "a"'s ledger instead
        await asyncio.sleep(0.05)
        assert not later.done() and claims(router) == [("a", 2)]  # deficit 2 - (9 - 8) = 1 < 2 on "b"
        b.report(4, clock.time() + 0.01)  # counts the first short request
        assert await asyncio.wait_for(later, timeout=5) is b
        assert claims(router) == []

    run(router, body)


def test_a_later_request_backfills_only_the_blocks_beyond_the_claims(clock):
    router = make_router(clock)
    a, b = FakeReplica("a").report(5, T0), FakeReplica("b").report(0, T0)

    async def body():
        router.update_replicas([a, b])
        busy = running_on(router, a, free=5)
        clock.advance(0.1)
        claimant = long()
        assert await router.choose_replicas([a, b], claimant) == []  # held (one poll, called directly)
        router.on_request_completed(a.replica_id, busy.metadata.internal_request_id)  # "a": 5 + 4 = 9
        waiting = short()
        assert await router.choose_replicas([a, b], waiting) == []  # 9 - 8 = 1 spare on "a": held too
        assert claims(router) == [("a", 2), ("a", 8)]  # its deficit: 1 on "a", 2 on "b"
        a.report(12, clock.time())  # three more free
        later = short()
        assert await ranking(router, [a, b], later) == ["a", "b"]  # 12 - 8 = 4 beside the oldest claim
        assert await router._choose_replica_for_request(later) is a
        # It did not delay the claimant: "a" has 12 - 2 = 10 for its 8 (and 10 - 8 = 2 for waiting's 2).
        assert await ranking(router, [a, b], claimant) == ["a", "b"]
        assert await ranking(router, [a, b], waiting) == ["a", "b"]
        # One more short request fits "a" too: only the oldest claim holds against later requests.
        assert await ranking(router, [a, b], short()) == ["a", "b"]

    run(router, body)


def test_claims_of_earlier_arrivals_take_precedence(clock):
    router = make_router(clock)
    a, b = FakeReplica("a").report(6, T0), FakeReplica("b").report(4, T0)

    async def body():
        router.update_replicas([a, b])
        older, newer = long(), long()
        newer.created_at = older.created_at + 0.001  # later, and before the short ones below
        assert await router.choose_replicas([a, b], newer) == []  # first here: claims "a" (deficit 2)
        assert claims(router) == [("a", 8)]
        assert await router.choose_replicas([a, b], older) == []  # arrived first: the newer claim does not count
        assert claims(router) == [("a", 8), ("a", 8)]
        assert await router.choose_replicas([a, b], newer) == []  # "a": 6 - 8 = -2, deficit 10; "b" 4
        assert sorted((c.pending is older, c.replica_id.unique_id) for c in router._claims.values()) == [
            (False, "b"), (True, "a")]
        # The older request goes the moment "a" has 8; the newer one could not take them before.
        a.report(8, T0 + 0.01)
        assert await ranking(router, [a, b], newer) == []
        assert await ranking(router, [a, b], older) == ["a", "b"]

    run(router, body)


def test_only_the_oldest_claim_counts_and_the_next_takes_over_when_it_is_routed(clock):
    router = make_router(clock)
    a, b = FakeReplica("a").report(6, T0), FakeReplica("b").report(4, T0)

    async def body():
        router.update_replicas([a, b])
        older, newer = long(), long()
        newer.created_at = older.created_at + 0.001  # later, and before the short ones below
        assert await router.choose_replicas([a, b], older) == []  # claims "a" (deficit 2)
        assert await router.choose_replicas([a, b], newer) == []  # "a": 6 - 8, so claims "b" (deficit 4)
        assert claims(router) == [("a", 8), ("b", 8)]
        # A later short request sees "a" less the oldest claim, and "b" whole: the newer claim waits its turn.
        assert await ranking(router, [a, b], short()) == ["b", "a"]
        a.report(8, T0 + 0.01)
        assert await router._choose_replica_for_request(older) is a  # routed: its claim ends
        assert claims(router) == [("b", 8)]
        # Now the newer claim holds: "b" has 4 - 8 for later requests, "a" 8 - 8 in its ledger.
        assert await ranking(router, [a, b], short()) == []

    run(router, body)


def test_a_held_request_keeps_its_claim_on_ties_and_moves_to_a_closer_replica(clock):
    router = make_router(clock)
    a, b = FakeReplica("a").report(6, T0), FakeReplica("b").report(4, T0)

    async def body():
        router.update_replicas([a, b])
        pr = long()
        for free_b, claimed in ((4, "a"), (6, "a"), (7, "b"), (6, "b")):  # deficits 2 on "a"; 4, 2, 1, 2 on "b"
            b.report(free_b, T0)
            assert await router.choose_replicas([a, b], pr) == []
            assert claims(router) == [(claimed, 8)]

    run(router, body)


def test_a_claim_lapses_when_its_request_stops_polling(clock):
    router = make_router(clock)
    a, b = FakeReplica("a").report(5, T0), FakeReplica("b").report(0, T0)

    async def body():
        router.update_replicas([a, b])
        assert await router.choose_replicas([a, b], long()) == []  # its routing task stops after this poll
        clock.advance(router.CLAIM_TTL_S / 2)
        assert await ranking(router, [a, b], short()) == []  # "a": 5 - 8; held too, it claims "b"
        assert claims(router) == [("a", 8), ("b", 2)]
        clock.advance(router.CLAIM_TTL_S / 2 + 0.01)  # the long request's claim was not renewed in time
        assert await ranking(router, [a, b], short()) == ["a", "b"]  # fits "a" as without it
        assert claims(router) == [("b", 2)]
        clock.advance(router.CLAIM_TTL_S)
        assert await ranking(router, [a, b], short()) == ["a", "b"] and claims(router) == []

    run(router, body)


def test_a_cancelled_held_request_leaves_no_claim(clock):
    router = make_router(clock)
    a, b = FakeReplica("a").report(5, T0), FakeReplica("b").report(0, T0)

    async def body():
        router.update_replicas([a, b])
        held = asyncio.ensure_future(router._choose_replica_for_request(long()))
        await asyncio.sleep(0.05)
        assert claims(router) == [("a", 8)]
        held.cancel()  # the caller gave up (client disconnected): Ray cancels its routing task
        for _ in range(3):
            await asyncio.sleep(0)
        assert claims(router) == []  # at once, not after CLAIM_TTL_S (the clock has not moved)
        assert await ranking(router, [a, b], short()) == ["a", "b"]

    run(router, body)


def test_a_claim_ends_when_the_request_is_sent_after_max_hold_s(clock):
    router = make_router(clock, max_hold_s=2.0)
    a, b = FakeReplica("a").report(5, T0), FakeReplica("b").report(2, T0)

    async def body():
        router.update_replicas([a, b])
        held = asyncio.ensure_future(router._choose_replica_for_request(long()))
        await asyncio.sleep(0.05)
        for _ in range(2):
            assert claims(router) == [("a", 8)]
            clock.advance(1.0)
            a.report(5, clock.time()), b.report(2, clock.time())  # fresh, still short
            await asyncio.sleep(0.05)
        assert await asyncio.wait_for(held, timeout=5) is a  # tier 3's first: the smaller deficit
        assert claims(router) == []
        assert await ranking(router, [a, b], short()) == ["b", "a"]  # "a": 5 - 8 in its ledger, no claim

    run(router, body)



def test_each_held_request_is_logged_once_with_its_wait_and_requests_never_held_are_not(clock):
    """router.HOLDS (what OpenAIIngress.take_router_holds hands out): replica, blocks reserved and
    seconds from the first hold to the choice, one entry per held request."""
    HOLDS.clear()
    router = make_router(clock, max_hold_s=2.0)
    a, b = FakeReplica("a").report(5, T0), FakeReplica("b").report(2, T0)

    async def body():
        router.update_replicas([a, b])
        assert await router._choose_replica_for_request(short()) is a  # room at once: not held
        held = asyncio.ensure_future(router._choose_replica_for_request(long()))
        await asyncio.sleep(0.05)
        for _ in range(2):
            clock.advance(1.0)
            a.report(5, clock.time()), b.report(2, clock.time())  # fresh, still short
            await asyncio.sleep(0.05)
        assert await asyncio.wait_for(held, timeout=5) is a
        assert list(HOLDS) == [HeldRequest("a", 8, 2.0)]

    run(router, body)
    HOLDS.clear()

def test_a_held_request_whose_replica_report_goes_stale_is_sent_there_and_its_claim_ends(clock):
    router = make_router(clock)
    a, b = FakeReplica("a").report(5, T0), FakeReplica("b").report(0, T0)

    async def body():
        router.update_replicas([a, b])
        held = asyncio.ensure_future(router._choose_replica_for_request(long()))
        await asyncio.sleep(0.05)
        assert claims(router) == [("a", 8)]
        clock.advance(router.stats_max_age_s + 0.1)
        b.report(0, clock.time())  # "a" reports no more: it may have room (tier 2)
        assert await asyncio.wait_for(held, timeout=5) is a
        assert claims(router) == []

    run(router, body)


def test_calls_that_are_not_generate_requests_are_never_held(clock):
    """They need no blocks; a claim or the ledger can leave every replica below zero free."""
    router = make_router(clock)
    a, b = FakeReplica("a").report(5, T0), FakeReplica("b").report(0, T0)

    async def body():
        router.update_replicas([a, b])
        clock.advance(0.1)
        router.on_request_routed(short(), b.replica_id, result=None)  # "b": 0 - 2
        assert await router.choose_replicas([a, b], long()) == []  # a: 5 - 8 for later requests
        other = PendingRequest(args=[{"prompt": "hi"}], kwargs={},
                               metadata=RequestMetadata(request_id="o", internal_request_id="o"))
        assert await ranking(router, [a, b], other) == ["b", "a"]  # deficits 2 and 3, sent at once

    run(router, body)
