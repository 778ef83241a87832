"""The KV-block router in a running Serve app (CPU): requests go where the free KV blocks are.

Two CPU engine replicas with a small KV pool of T blocks each; a replica reports as free what is
left once its requests reach max_tokens. One long request (prompt + max_tokens = 4/5 of a pool)
lands on one replica (A); two short prompts with a large max_tokens (3/10 of a pool each), which
only the other one (B) has room for, make B the busier replica by request count. Then:

- a probe that fits only in B's free blocks goes to B, although A has fewer requests: Serve's
  power-of-two router compares queue lengths (A 1, B 2) and sends it to A, where it would wait or
  preempt (with ROUTER = "power_of_two" this test fails: at the second short request, which goes
  to either replica, or at the probe);
- a small request that fits anywhere goes to A, the less loaded replica.

The router counts blocks as admission "max_tokens" does (router_admission), whose free blocks
these sizes are written in; admission "engine" is tested with fake replicas
(tests/test_router_admission.py) and measured on the GPU (bench_router.py).

Placement is read from the replicas themselves (ReplicaReport.num_requests), not inferred from
the requests succeeding. Prompts are token ids, so the router knows their exact size.
"""

import random
import time

import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("openai")

from ray import serve  # noqa: E402

from deployments.api.protocol import GenerateRequest  # noqa: E402
from ponytail import SamplingParams  # noqa: E402
from deployments.app.reports import replica_reports  # noqa: E402
from serve_support import running_app  # noqa: E402

pytestmark = pytest.mark.network  # the default model

ROUTER = "kv_blocks"
BLOCK = 16
SETTLE_S = 1.5  # > the router's STATS_MAX_AGE_S: its ledger then holds only what newer reports show


@pytest.fixture(scope="module")
def app(default_model):
    # 72 MiB of fp32 KV for SmolLM2-135M (45 KiB per token) is about 100 blocks of 16 tokens.
    with running_app(min_replicas=2, max_replicas=2, kv_cache_memory="72MiB", router=ROUTER,
                     router_admission="max_tokens") as started:
        yield started


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]  # ordinary vocabulary ids, no shared prefix


def send(handle, prompt, max_tokens):
    request = GenerateRequest(prompt=prompt, sampling=SamplingParams(max_tokens=max_tokens, temperature=0,
                                                       ignore_eos=True))
    return handle.options(stream=True).generate.remote(request)  # routed now; nobody needs to read it


def wait_for_reports(condition, what, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reports = replica_reports()
        if condition(reports):
            return reports
        time.sleep(0.2)
    summary = {name: (r.num_requests, r.stats.num_running, r.stats.num_waiting, r.routing["free_blocks"])
               for name, r in reports.items()}
    raise AssertionError(f"timed out waiting for {what}; (requests, running, waiting, free blocks): {summary}")


def taken(reports):
    return {name: r.num_requests for name, r in reports.items()}


def test_requests_go_where_the_free_blocks_are(app):
    handle = serve.get_app_handle("ponytail")
    idle = replica_reports()
    total = min(r.routing["total_blocks"] for r in idle.values())
    assert total >= 60, f"the test's sizes assume a pool of ~100 blocks, got {total}"
    before = taken(idle)
    streams = []
    try:
        # The long request (4/5 of the pool, half of it max_tokens) lands on either replica: that one is A.
        long_blocks = total * 4 // 5
        streams.append(send(handle, tokens(long_blocks // 2 * BLOCK, 1), (long_blocks - long_blocks // 2) * BLOCK))
        reports = wait_for_reports(lambda rs: sum(taken(rs).values()) == sum(before.values()) + 1
                                   and any(r.stats.num_running == 1 for r in rs.values()), "the long prompt")
        a = next(name for name, r in reports.items() if r.num_requests > before[name])
        b = next(name for name in reports if name != a)
        free_a = reports[a].routing["free_blocks"]
        assert free_a <= total - long_blocks, reports[a].routing

        # Each short request needs 3/10 of the pool (prompt + max_tokens): only B has that.
        short_need = total * 3 // 10
        assert short_need > free_a
        for index in range(2):
            time.sleep(SETTLE_S)
            streams.append(send(handle, tokens(32, 10 + index), short_need * BLOCK - 32))
            reports = wait_for_reports(lambda rs: sum(taken(rs).values()) == sum(before.values()) + 2 + index
                                       and rs[b].stats.num_running + rs[a].stats.num_running == 2 + index,
                                       f"short request {index + 1} running")
            assert taken(reports) == {a: before[a] + 1, b: before[b] + 1 + index}, \
                f"short request {index + 1} went to A, which has no room for it"

        # The probe fits only in B's free blocks; A has fewer requests (1 against 2).
        time.sleep(SETTLE_S)
        reports = replica_reports()
        probe_need = (reports[a].routing["free_blocks"] + reports[b].routing["free_blocks"]) // 2
        assert reports[a].routing["free_blocks"] < probe_need <= reports[b].routing["free_blocks"]
        streams.append(send(handle, tokens(probe_need * BLOCK - 2 * BLOCK, 20), 2 * BLOCK))
        reports = wait_for_reports(lambda rs: sum(taken(rs).values()) == sum(before.values()) + 4, "the probe")
        assert taken(reports) == {a: before[a] + 1, b: before[b] + 3}, "the probe did not go to B, which has room"
        # B has room, so the probe runs there; it may wait for the step in flight first (seconds on a loaded CPU).
        wait_for_reports(lambda rs: rs[b].stats.num_running == 3 and rs[b].stats.num_waiting == 0
                         and rs[a].stats.num_waiting == 0, "the probe admitted on B")

        # A small request fits anywhere: load decides, and A has less.
        time.sleep(SETTLE_S)
        small = send(handle, tokens(BLOCK, 30), BLOCK)
        assert list(small)[-1].finish_reason == "length"
        reports = replica_reports()
        assert taken(reports) == {a: before[a] + 2, b: before[b] + 3}, "the small request did not go to A"
        assert all(r.stats.num_preemptions == 0 for r in reports.values())
    finally:
        for stream in streams:
            stream.cancel()  # aborts the request on its replica and frees its blocks
    wait_for_reports(lambda rs: all(r.stats.used_blocks == 0 for r in rs.values()), "blocks freed")
