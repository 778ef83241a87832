"""The KV-block router's default admission ("engine") in a running Serve app (CPU).

Two CPU engine replicas with a pool of T (~100) blocks each. One request on each replica has a
short prompt and max_tokens of 0.6 T blocks, so each replica's free blocks (what is left once its
requests reach max_tokens) are ~0.4 T. A probe whose prompt takes 3 blocks and whose prompt +
max_tokens takes 0.45 T fits neither replica's free blocks: admission "max_tokens" holds it in the
router until a request finishes (tens of seconds here), admission "engine" sends it at once to a
replica whose engine admits its prompt now, as the engine queue behind Serve's power-of-two router
would. Placement and running counts are read from the replicas themselves.
"""

import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("openai")

from ray import serve  # noqa: E402

from serve_support import running_app  # noqa: E402
from test_serve_routing import BLOCK, send, taken, tokens, wait_for_reports  # noqa: E402

from deployments.app.reports import replica_reports  # noqa: E402

pytestmark = pytest.mark.network  # the default model


@pytest.fixture(scope="module")
def app(default_model):
    # 72 MiB of fp32 KV for SmolLM2-135M (45 KiB per token) is about 100 blocks of 16 tokens.
    # max_hold_s 60: with admission "max_tokens" the probe would wait in the router far beyond the
    # test's 15 s instead of going to a replica when the default 10 s hold ends.
    with running_app(min_replicas=2, max_replicas=2, kv_cache_memory="72MiB", router="kv_blocks",
                     max_hold_s=60) as started:
        yield started


def running(reports):
    return {name: r.stats.num_running for name, r in reports.items()}


def test_a_request_the_reservation_would_hold_starts_where_its_prompt_fits(app):
    handle = serve.get_app_handle("ponytail")
    idle = replica_reports()
    total = min(r.routing["total_blocks"] for r in idle.values())
    assert total >= 60, f"the test's sizes assume a pool of ~100 blocks, got {total}"
    for r in idle.values():  # idle: every block free; the engine admits into all but the decode headroom
        assert (r.routing["free_blocks"], r.routing["startable_blocks"]) == (total, total - r.stats.headroom_blocks)
    before = taken(idle)
    long_max = total * 6 // 10 * BLOCK  # 0.6 T blocks of output after a one-block prompt
    streams = []
    try:
        for index in range(2):  # one per replica: the second goes to the emptier, less loaded one
            streams.append(send(handle, tokens(BLOCK, 40 + index), long_max))
            reports = wait_for_reports(lambda rs: sum(running(rs).values()) == index + 1, f"long request {index + 1}")
        assert sorted(running(reports).values()) == [1, 1], reports
        probe_prompt, probe_max = 2 * BLOCK, total * 45 // 100 * BLOCK
        whole_need = -(-(probe_prompt + probe_max) // BLOCK)
        for name, r in reports.items():  # the probe fits no replica's reservation, every replica's engine
            assert r.routing["free_blocks"] < whole_need, (name, r.routing)
            assert r.routing["startable_blocks"] >= 3, (name, r.routing)

        streams.append(send(handle, tokens(probe_prompt, 50), probe_max))
        reports = wait_for_reports(lambda rs: sum(running(rs).values()) == 3, "the probe running", timeout=15)
        assert sum(taken(reports).values()) == sum(before.values()) + 3
        # Both long requests are still decoding (0.6 T blocks take far longer on this CPU): the
        # probe did not wait for one to finish, and nobody was preempted for it.
        assert sorted(running(reports).values()) == [1, 2]
        assert all(r.stats.num_preemptions == 0 for r in reports.values())
    finally:
        for stream in streams:
            stream.cancel()  # aborts the request on its replica and frees its blocks
    wait_for_reports(lambda rs: all(r.stats.used_blocks == 0 for r in rs.values()), "blocks freed")
