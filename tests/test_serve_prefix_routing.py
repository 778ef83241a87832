"""The prefix-aware router in a running Serve app (CPU): a chat's next turn goes where its prefix is.

Two CPU engine replicas, router: prefix. Turn 1 of a chat (a ~300-token system prompt) lands on
one replica, A; its report publishes the block hashes the engine stored, and they equal
ponytail.prefix_block_hashes of the chat template's token ids computed here, in a third process.
A long continuation of the chat (1,500 tokens to generate) then goes to A too: both are idle and
A holds its prefix. A is now the busier replica, and the next turn (4 tokens to generate, so its
cached blocks are nearly all it needs) still goes to A and hits its cache there. The KV-block
router (ROUTER = "kv_blocks") sends that turn to B, the idle one, and this test fails there.
"""

import threading
import time
from collections import defaultdict

import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("openai")

import ponytail  # noqa: E402
from deployments.api.prompts import chat_token_ids  # noqa: E402
from deployments.app.reports import replica_reports  # noqa: E402
from serve_support import MODEL, running_app  # noqa: E402

pytestmark = pytest.mark.network  # the default model

ROUTER = "prefix"
BLOCK = 16
SYSTEM = "You answer questions about the solar system in one short sentence. " * 20


@pytest.fixture(scope="module")
def app(default_model):
    with running_app(min_replicas=2, max_replicas=2, router=ROUTER) as started:
        yield started


def taken(reports):
    return {name: r.num_requests for name, r in reports.items()}


def wait_for(condition, what, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reports = replica_reports()
        if condition(reports):
            return reports
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}: {taken(reports)}")


def stored_hashes_during(call):
    """(call(), {replica: block hashes its reports said it stored}), reading the reports every 0.1 s
    while call() runs and once after. A report repeats an event for REPORTS_KEPT reports only (the
    router reads them all), so on a loaded CPU a prompt prefilled in several chunks can push its
    first events out of any single report read after the answer."""
    seen: dict[str, set[int]] = defaultdict(set)
    done = threading.Event()

    def read():
        for name, report in replica_reports().items():
            seen[name].update(h for h, is_stored in report.routing["prefix_events"] if is_stored)

    def watch():
        while not done.wait(0.1):
            read()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = call()
    finally:
        done.set()
        watcher.join()
    read()
    return result, seen


def test_the_next_turn_of_a_chat_goes_where_its_prefix_is_cached(app, default_model):
    client, _ = app
    tokenizer = default_model[1]
    before = taken(replica_reports())
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which planet is largest?"}]
    answer, stored_by = stored_hashes_during(
        lambda: client.chat.completions.create(model=MODEL, messages=turn1, max_tokens=2, temperature=0))
    reports = replica_reports()
    a = next(name for name in reports if reports[name].num_requests > before[name])
    b = next(name for name in reports if name != a)
    ids = chat_token_ids(tokenizer, turn1)
    stored = stored_by[a]
    expected = ponytail.prefix_block_hashes(ids, BLOCK)  # every full block of the prompt, computed here
    assert len(expected) == len(ids) // BLOCK >= 16
    assert set(expected) <= stored, (len(ids), len(stored), reports[a].routing["prefix_seq"])
    assert not set(expected) & stored_by[b]  # B never saw this prompt

    turn2 = turn1 + [{"role": "assistant", "content": answer.choices[0].message.content},
                     {"role": "user", "content": "And the smallest?"}]
    time.sleep(1.5)  # fresh reports: both replicas idle, so only the cached prefix sets them apart
    long = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=1500, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
    try:
        reports = wait_for(lambda rs: sum(taken(rs).values()) == sum(before.values()) + 2
                           and any(r.stats.num_running for r in rs.values()), "the long continuation running")
        assert taken(reports) == {a: before[a] + 2, b: before[b]}, "the continuation did not go where its prefix is"
        assert reports[a].stats.num_running == 1
        hits_before = reports[a].stats.prefix_cache_hits
        time.sleep(1.5)  # fresh reports: A shows one running request, B none

        reply = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=4, temperature=0)
        assert reply.usage.prompt_tokens == len(chat_token_ids(tokenizer, turn2))
        reports = replica_reports()
        assert taken(reports) == {a: before[a] + 3, b: before[b]}, "the next turn went to the idle replica"
        # The engine's hit on A: the whole turn-2 prompt but its last (partial or capped) block.
        assert reports[a].stats.prefix_cache_hits - hits_before == (reply.usage.prompt_tokens - 1) // BLOCK * BLOCK
        assert reply.usage.prompt_tokens_details.cached_tokens == (reply.usage.prompt_tokens - 1) // BLOCK * BLOCK
    finally:
        long.close()  # aborts the continuation on A
