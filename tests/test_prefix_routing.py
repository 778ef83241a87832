"""Prefix-cache affinity on the CPU: the engine's block hashes, what replicas publish, the router's
per-replica index and its scoring with exact numbers (fake replicas and clock, as test_router.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

pytest.importorskip("ray.serve")

import ponytail  # noqa: E402
from ponytail.kv.block_allocator import BlockAllocator  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402
from ray.serve._private.common import RequestMetadata  # noqa: E402

from deployments.app.prefix_index import PrefixIndex  # noqa: E402
from deployments.app.prefix_publisher import LOG_CAPACITY, PrefixPublisher  # noqa: E402
from deployments.app.prefix_router import PrefixAffinityRouter  # noqa: E402
from deployments.api.protocol import GenerateRequest  # noqa: E402
from ponytail import SamplingParams  # noqa: E402
from deployments.app.router import Placement  # noqa: E402
from test_router import DEPLOYMENT_ID, T0, FakeClock, FakeReplica, request, run  # noqa: E402

BS = 16
PROMPT = list(range(1000, 1100))  # 100 tokens: 6 full blocks within the engine's cap of 99
HASHES = ponytail.prefix_block_hashes(PROMPT, BS, max_cached_tokens=len(PROMPT) - 1)


def make_router(clock, **kwargs) -> PrefixAffinityRouter:
    from ray.serve._private.common import DeploymentHandleSource

    router = PrefixAffinityRouter(deployment_id=DEPLOYMENT_ID, handle_source=DeploymentHandleSource.REPLICA,
                                  self_actor_id="fake-actor-id", self_actor_handle=None,
                                  use_replica_queue_len_cache=True, get_curr_time_s=clock.time,
                                  initial_backoff_s=0.001, backoff_multiplier=1, max_backoff_s=0.001)
    if "tokenizer" not in kwargs:
        kwargs.setdefault("tokenize", False)  # token-id prompts: no tokenizer to load
    kwargs.setdefault("admission", "max_tokens")  # the expectations count prompt + max_tokens
    router.initialize_state(clock=clock.time, **kwargs)
    return router


def publish(replica: FakeReplica, hashes, cached_blocks=0, seq=None) -> FakeReplica:
    """The replica's report also says it stored these block hashes (events 1..n, or ending at seq)."""
    events = [(h, True) for h in hashes]
    replica.stats.update(prefix_seq=len(events) if seq is None else seq, prefix_events=events,
                         cached_blocks=cached_blocks)
    return replica


def prefixed(max_tokens=20) -> PendingRequest:
    """A generate call whose prompt is PROMPT as token ids (100 + 20 tokens: 8 blocks)."""
    pr = request(100, max_tokens)
    pr.args[0].prompt = list(PROMPT)
    return pr


def chat(messages, max_tokens=20) -> PendingRequest:
    return PendingRequest(args=[GenerateRequest(messages=messages, sampling=SamplingParams(max_tokens=max_tokens))], kwargs={},
                          metadata=RequestMetadata(request_id="c", internal_request_id="c"))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


# ---------------------------------------------------------------- the engine's hashes
def test_block_hashes_are_the_same_in_another_process():
    """A router in another process must compute the engine's hashes (hash(None) differs per process
    before Python 3.12, so the chain cannot start from None)."""
    code = "import ponytail; print(ponytail.prefix_block_hashes(list(range(1000, 1100)), 16, 99))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == str(HASHES)
    assert len(HASHES) == 6


def test_a_match_on_the_hashes_is_the_engines_prefix_hit():
    allocator = BlockAllocator(32, BS)
    publisher = _publisher(allocator)
    allocator.allocate("first", PROMPT)
    allocator.commit("first", len(PROMPT))  # 6 full blocks offered to the prefix cache
    stored = [h for h, is_stored in publisher.routing_stats(allocator.num_evictable)["prefix_events"] if is_stored]
    assert stored == ponytail.prefix_block_hashes(PROMPT, BS)
    index = PrefixIndex()
    index.add(stored)
    turn = PROMPT[:80] + list(range(5000, 5040))  # shares 5 blocks, then differs
    hit = allocator.allocate("second", turn, max_cached_tokens=len(turn) - 1).num_cached_tokens
    assert hit == 80 == BS * index.match(ponytail.prefix_block_hashes(turn, BS, len(turn) - 1))
    # The cap: a prompt of exactly 6 cached blocks still computes its last token, so 5 hit.
    exact = PROMPT[:96]
    assert index.match(ponytail.prefix_block_hashes(exact, BS, len(exact) - 1)) == 5
    assert allocator.allocate("third", exact, max_cached_tokens=95).num_cached_tokens == 80


def test_a_cache_salt_starts_another_chain_that_the_router_computes_too():
    """vLLM's cache_salt: only prompts with the same salt hit each other's blocks, in the engine and
    in the router's index alike, and the salted chain is the same in another process."""
    from ponytail.kv.blocks import salt_root

    allocator = BlockAllocator(64, BS)
    publisher = _publisher(allocator)
    allocator.allocate("a", PROMPT, root_hash=salt_root("tenant-a"))
    allocator.commit("a", len(PROMPT))
    stored = [h for h, is_stored in publisher.routing_stats(allocator.num_evictable)["prefix_events"] if is_stored]
    salted = ponytail.prefix_block_hashes(PROMPT, BS, cache_salt="tenant-a")
    assert stored == salted and not set(salted) & set(ponytail.prefix_block_hashes(PROMPT, BS))
    assert allocator.allocate("plain", PROMPT, max_cached_tokens=len(PROMPT) - 1).num_cached_tokens == 0
    assert allocator.allocate("b", PROMPT, len(PROMPT) - 1, salt_root("tenant-b")).num_cached_tokens == 0
    assert allocator.allocate("a2", PROMPT, len(PROMPT) - 1, salt_root("tenant-a")).num_cached_tokens == 96
    code = "import ponytail; print(ponytail.prefix_block_hashes(list(range(1000, 1100)), 16, cache_salt='tenant-a'))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == str(salted)
    with pytest.raises(ValueError, match=r"block_size=0 .* an int >= 1"):
        ponytail.prefix_block_hashes(PROMPT, 0)


# ---------------------------------------------------------------- what replicas publish
def _publisher(allocator: BlockAllocator, **kwargs) -> PrefixPublisher:
    """What LLM.publish_prefix_events does to the engine's allocator, on a bare one."""
    log = ponytail.PrefixEventLog(LOG_CAPACITY)
    allocator.prefix_events = log
    return PrefixPublisher(log, **kwargs)


def test_reports_carry_the_events_of_the_last_reports_and_idle_ones_none():
    allocator = BlockAllocator(4, 4)
    publisher = _publisher(allocator, reports_kept=2)
    allocator.allocate("s", list(range(8)))
    allocator.commit("s", 8)
    h1, h2 = ponytail.prefix_block_hashes(list(range(8)), 4)
    first = publisher.routing_stats(allocator.num_evictable)
    assert first == {"prefix_seq": 2, "prefix_events": [(h1, True), (h2, True)], "cached_blocks": 0}
    allocator.free("s")  # both blocks stay cached (evictable), the tail first in the LRU
    assert allocator.evict(1) == 1  # drops h2
    assert publisher.routing_stats(allocator.num_evictable) == {"prefix_seq": 3, "prefix_events": [(h1, True), (h2, True), (h2, False)],
                                         "cached_blocks": 1}
    assert publisher.routing_stats(allocator.num_evictable)["prefix_events"] == [(h2, False)]  # the first report is out of the window
    assert publisher.routing_stats(allocator.num_evictable) == {"prefix_seq": 3, "prefix_events": [], "cached_blocks": 1}
    allocator.shrink(4)  # releasing the pool drops the last cached block too
    assert publisher.routing_stats(allocator.num_evictable)["prefix_events"] == [(h1, False)]
    with pytest.raises(ponytail.ConfigError, match=r"capacity=0 is not supported; allowed: an int >= 1"):
        ponytail.PrefixEventLog(0)


def test_a_read_that_does_not_advance_leaves_the_routers_window_where_it_was():
    allocator = BlockAllocator(4, 4)
    publisher = _publisher(allocator, reports_kept=2)
    allocator.allocate("s", list(range(8)))
    allocator.commit("s", 8)
    h1, h2 = ponytail.prefix_block_hashes(list(range(8)), 4)
    stored = [(h1, True), (h2, True)]
    for _ in range(5):  # `ponytail replicas` or a test polling: the window stays put
        assert publisher.routing_stats(0, advance=False)["prefix_events"] == stored
    assert publisher.routing_stats(0)["prefix_events"] == stored  # the router still gets them
    assert publisher.routing_stats(0)["prefix_events"] == stored  # and once more (reports_kept=2)
    assert publisher.routing_stats(0)["prefix_events"] == []


def test_an_event_log_that_forgot_events_shows_the_gap():
    log = ponytail.PrefixEventLog(capacity=2)
    for h in (11, 12, 13):
        log.record(h, stored=True)
    assert [e.seq for e in log.since(0)] == [2, 3]  # seq 1 is gone: a reader at 0 sees 2 first
    assert [e.block_hash for e in log.since(2)] == [13] and log.since(3) == []


# ---------------------------------------------------------------- the router's index
def test_index_applies_each_event_once_and_starts_over_after_a_gap():
    index = PrefixIndex()
    index.apply_report({"prefix_seq": 2, "prefix_events": [(1, True), (2, True)]})
    index.apply_report({"prefix_seq": 3, "prefix_events": [(1, True), (2, True), (2, False)]})  # repeats 1-2
    assert (1 in index, 2 in index, index.seq, index.num_resets) == (True, False, 3, 0)
    index.apply_report({"prefix_seq": 3, "prefix_events": []})  # an older or idle report changes nothing
    assert len(index) == 1
    index.add([7, 8])  # our own sends
    index.apply_report({"prefix_seq": 9, "prefix_events": [(5, True), (6, True)]})  # 4-7 never seen
    assert (sorted(index._hashes), index.seq, index.num_resets) == ([5, 6], 9, 1)
    assert index.match([5, 6, 1]) == 2 and index.match([6, 5]) == 2 and index.match([1, 5]) == 0
    index.apply_report({"prefix_seq": 10, "prefix_events": [(9, True)]}, total_blocks=2)  # pool of 2 blocks
    assert sorted(index._hashes) == [6, 9]  # least recently seen goes first
    index.apply_report({"free_blocks": 3})  # a replica that does not publish: no change
    assert index.seq == 10


# ---------------------------------------------------------------- the scoring
def test_cached_blocks_are_not_needed_again_and_pull_the_request(clock):
    """100 + 20 tokens = 8 blocks; a holds the first 4 of its 6 cacheable prompt blocks."""
    router = make_router(clock)
    a = publish(FakeReplica("a").report(40, T0, total_blocks=64), HASHES[:4])
    b = publish(FakeReplica("b").report(40, T0, total_blocks=64), [])

    async def body():
        router.update_replicas([a, b])
        pr = prefixed()
        report_a = router._replicas[a.replica_id]
        from deployments.app.router import read_report

        # need 8 - 4 = 4; evicts nothing (no cached-only blocks); affinity 2 * 4 / 8
        assert router._placement(report_a, read_report(a.stats), 40, 120, pr) == Placement(need=4, affinity=1.0)
        assert router._placement(b, read_report(b.stats), 40, 120, pr) == Placement(need=8, affinity=0.0)
        assert await ranking(router, [a, b], pr) == ["a", "b"]
        # a busier: score a = used 0.375 + load 4/4 - 1.0 = 0.375 < b = 0.375 + 1/4
        a.report(40, T0, running=4, total_blocks=64)
        publish(a, HASHES[:4])
        b.report(40, T0, running=1, total_blocks=64)
        assert await ranking(router, [a, b], prefixed()) == ["a", "b"]
        # without affinity (weight 0) load decides: a = 1.375, b = 0.625
        router.prefix_weight = 0.0
        assert await ranking(router, [a, b], prefixed()) == ["b", "a"]

    run(router, body)


OTHER = ponytail.prefix_block_hashes(list(range(5000, 5200)), BS, max_cached_tokens=199)  # 12 blocks


def test_a_request_that_would_evict_more_than_it_gains_goes_elsewhere(clock):
    """a holds 1 block of the prompt but 8 of its 10 free blocks hold cached prefixes: the 7 new
    blocks would evict 5 of them. b has the same free blocks, none of them cached. a's held blocks
    are 1 of the prompt + 3 of another prompt that requests have hit, of 4: reuse share 3/4."""
    router = make_router(clock)
    a = publish(FakeReplica("a").report(10, T0, total_blocks=64), [*HASHES[:1], *OTHER[:3]], cached_blocks=8)
    b = publish(FakeReplica("b").report(10, T0, total_blocks=64), [], cached_blocks=0)

    async def body():
        router.update_replicas([a, b])
        from deployments.app.router import read_report

        router.index(a).mark_reused(OTHER[:3])
        assert router.index(a).reuse_share == 0.75
        pr = prefixed()
        assert router._placement(a, read_report(a.stats), 10, 120, pr) == Placement(
            need=7, affinity=2 * (1 - 5 * 0.75) / 8)
        assert router._placement(b, read_report(b.stats), 10, 120, pr) == Placement(need=8, affinity=0.0)
        assert await ranking(router, [a, b], pr) == ["b", "a"]

    run(router, body)


def test_evicting_blocks_no_request_has_hit_costs_nothing(clock):
    """A random mix: every cached block is a one-off. A request with no hits anywhere ranks by
    pool use and load alone (as KVBlockRouter), even where its blocks would evict cached ones."""
    router = make_router(clock)
    # a served more before (its free blocks are cached one-offs) but runs less now
    a = publish(FakeReplica("a").report(10, T0, running=1, total_blocks=64), OTHER[:8], cached_blocks=8)
    b = publish(FakeReplica("b").report(10, T0, running=3, total_blocks=64), [], cached_blocks=0)

    async def body():
        router.update_replicas([a, b])
        from deployments.app.router import read_report

        pr = prefixed()
        assert router.index(a).reuse_share == 0.0
        assert router._placement(a, read_report(a.stats), 10, 120, pr) == Placement(need=8, affinity=0.0)
        assert await ranking(router, [a, b], pr) == ["a", "b"]
        # the same blocks once hit by requests: evicting 6 of them now outweighs the load
        router.index(a).mark_reused(OTHER[:8])
        assert router._placement(a, read_report(a.stats), 10, 120, pr) == Placement(need=8, affinity=2 * -6 / 8)
        assert await ranking(router, [a, b], prefixed()) == ["b", "a"]

    run(router, body)


def test_hits_of_routed_requests_mark_blocks_reused_until_the_replica_drops_them(clock):
    router = make_router(clock)
    a = publish(FakeReplica("a").report(40, T0, total_blocks=64), HASHES[:4])

    async def body():
        router.update_replicas([a])
        assert router.index(a).reuse_share == 0.0
        assert await router._choose_replica_for_request(prefixed()) is a
        index = router.index(a)
        assert len(index) == 6 and index.reuse_share == 4 / 6  # its 4 hits; its 2 new blocks not yet
        assert await router._choose_replica_for_request(prefixed()) is a
        assert index.reuse_share == 1.0
        a.stats.update(prefix_seq=5, prefix_events=[(HASHES[5], False)])  # the engine evicted the last
        assert router.index(a).reuse_share == 1.0 and len(router.index(a)) == 5

    run(router, body)


def test_a_replica_that_holds_the_prefix_fits_what_free_blocks_alone_would_not(clock):
    router = make_router(clock, max_hold_s=0)
    a = publish(FakeReplica("a").report(5, T0), HASHES[:4])  # needs 8 - 4 = 4 <= 5
    b = publish(FakeReplica("b").report(6, T0), [])  # needs 8 > 6: short by 2

    async def body():
        router.update_replicas([a, b])
        assert await ranking(router, [a, b], prefixed()) == ["a", "b"]
        pr = prefixed()
        assert await router._choose_replica_for_request(pr) is a
        assert router._ledgers[a.replica_id].unreported_blocks == 4  # only the new blocks are reserved

    run(router, body)


def test_a_burst_with_one_prefix_follows_the_first_send_before_any_report(clock):
    router = make_router(clock)
    a = publish(FakeReplica("a").report(40, T0, total_blocks=64), [])
    b = publish(FakeReplica("b").report(40, T0, total_blocks=64), [])

    async def body():
        router.update_replicas([a, b])
        first = await router._choose_replica_for_request(prefixed())
        other = b if first is a else a
        assert router._ledgers[first.replica_id].unreported_blocks == 8
        # first: used 1 - 32/64 + load 1/1 - affinity 2 * 6/8 = 0.0; other: 0.375
        assert await ranking(router, [a, b], prefixed()) == [first.replica_id.unique_id,
                                                                     other.replica_id.unique_id]
        assert await router._choose_replica_for_request(prefixed()) is first
        assert router._ledgers[first.replica_id].unreported_blocks == 8 + 2
        # a different prompt has no affinity: the less used, less loaded replica
        assert (await ranking(router, [a, b], request(30, 2)))[0] == other.replica_id.unique_id

    run(router, body)


def test_stale_reports_rank_by_queue_length_whatever_the_index_says(clock):
    router = make_router(clock)
    a = publish(FakeReplica("a", queue_len=0).report(40, T0 - 5), HASHES)  # 5 s old
    b = publish(FakeReplica("b").report(40, T0), [])

    async def body():
        router.update_replicas([a, b])
        assert await ranking(router, [a, b], prefixed()) == ["b", "a"]
        assert router.index(a).match(HASHES) == 6  # learned anyway, for when a reports again
        a.report(40, T0 + 0.1)
        publish(a, HASHES, seq=6)  # no new events
        assert await ranking(router, [a, b], prefixed()) == ["a", "b"]

    run(router, body)



def test_with_every_report_stale_equal_queues_go_where_the_prefix_is(clock):
    """A busy control plane can deliver reports late: both replicas rank by queue length then, and
    the index breaks their tie instead of chance (a chat's next turn stays with its prefix)."""
    router = make_router(clock)
    a = publish(FakeReplica("a").report(40, T0 - 5), HASHES)  # both 5 s old
    b = publish(FakeReplica("b").report(40, T0 - 5), [])

    async def body():
        router.update_replicas([a, b])
        for _ in range(20):  # never the coin
            assert await ranking(router, [b, a], prefixed()) == ["a", "b"]
        assert (await ranking(router, [a, b], request(30, 2)))[0] in ("a", "b")  # no prefix: chance
        router.replica_queue_len_cache.update(a.replica_id, 1)  # the queue still comes first
        assert await ranking(router, [a, b], prefixed()) == ["b", "a"]

    run(router, body)

def test_chat_prompts_are_tokenized_once_with_the_engines_template(clock):
    class Template:
        """apply_chat_template's contract: token ids for the messages plus the generation prompt."""

        calls = 0

        def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
            assert add_generation_prompt and tokenize and not return_dict
            Template.calls += 1
            return [ord(c) for m in messages for c in m["content"]] + [1, 2]

    router = make_router(clock, tokenizer=Template())
    a = FakeReplica("a").report(40, T0, total_blocks=64)
    b = FakeReplica("b").report(40, T0, total_blocks=64)
    messages = [{"role": "system", "content": "s" * 40}, {"role": "user", "content": "hello" * 10}]
    ids = [ord(c) for m in messages for c in m["content"]] + [1, 2]
    publish(a, ponytail.prefix_block_hashes(ids, BS, len(ids) - 1))
    publish(b, [])

    async def body():
        router.update_replicas([a, b])
        pr = chat(messages)
        assert router.prompt_hashes(pr, BS) == (ponytail.prefix_block_hashes(ids, BS, 91), 92 + 20)
        assert await ranking(router, [a, b], pr) == ["a", "b"]
        assert Template.calls == 1  # cached on the request for every later look

    run(router, body)


def test_prefix_router_kwargs_are_checked(clock):
    with pytest.raises(ValueError, match=r"prefix_weight=-1; expected a number >= 0"):
        make_router(clock, prefix_weight=-1)
    with pytest.raises(ValueError, match=r"tokenize='no'; expected true or false"):
        make_router(clock, tokenize="no")
    with pytest.raises(ValueError, match="not known to KVBlockRouter"):
        make_router(clock, prefix_weigth=1)


async def ranking(router, replicas, pr: PendingRequest) -> list[str]:
    ranks = await router.choose_replicas(replicas, pr)
    assert all(len(rank) == 1 for rank in ranks)
    return [rank[0].replica_id.unique_id for rank in ranks]


def test_a_long_chat_prompt_is_tokenized_off_the_event_loop_while_others_route(clock):
    import threading

    release = threading.Event()

    class SlowTemplate:
        threads: list[int] = []

        def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
            SlowTemplate.threads.append(threading.get_ident())
            if len(messages[0]["content"]) >= 3 * PrefixAffinityRouter.THREAD_TOKENS:
                assert release.wait(10)  # a long prompt: seconds of tokenizing
            return [ord(c) % 500 for m in messages for c in m["content"]][:200] + [1, 2]

    router = make_router(clock, tokenizer=SlowTemplate())
    a = FakeReplica("a").report(400, T0, total_blocks=512)
    b = FakeReplica("b").report(400, T0, total_blocks=512)
    publish(a, HASHES)
    publish(b, [])

    async def body():
        router.update_replicas([a, b])
        loop_thread = threading.get_ident()
        long = asyncio.ensure_future(ranking(router, [a, b], chat([{"role": "user", "content": "x" * 4000}])))
        await asyncio.sleep(0.05)
        assert not long.done()
        assert await ranking(router, [a, b], prefixed()) == ["a", "b"]  # routed while the long one tokenizes
        short = chat([{"role": "user", "content": "hi"}])
        await ranking(router, [a, b], short)
        release.set()
        assert len(await long) == 2
        assert SlowTemplate.threads[0] != loop_thread and SlowTemplate.threads[1] == loop_thread

    run(router, body)


def test_a_truncated_prompt_is_hashed_as_the_replica_runs_it(clock):
    """truncate_prompt_tokens: the replica runs the prompt's last N tokens, so the router hashes those."""
    router = make_router(clock, tokenize=False)
    ids = list(range(1000, 1100))

    def pending(keep: int, side: str = "left") -> PendingRequest:
        request = GenerateRequest(prompt=ids, sampling=SamplingParams(max_tokens=20), truncate_prompt_tokens=keep,
                                  truncation_side=side)
        return PendingRequest(args=[request], kwargs={},
                              metadata=RequestMetadata(request_id="t", internal_request_id="t"))

    async def body():
        hashes, tokens = router.prompt_hashes(pending(40), BS)
        assert hashes == ponytail.prefix_block_hashes(ids[-40:], BS, 39) and tokens == 40 + 20
        # -1: as many as fit, which the replica decides: hashed whole
        assert router.prompt_hashes(pending(-1), BS)[0] == ponytail.prefix_block_hashes(ids, BS, 99)
        # truncation_side "right": the first N tokens
        assert router.prompt_hashes(pending(40, "right"), BS)[0] == ponytail.prefix_block_hashes(ids[:40], BS, 39)

    run(router, body)
