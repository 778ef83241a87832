"""The Serve app under failure and load (CPU): a replica killed mid-stream, autoscaling 1 -> 2 -> 1."""

import concurrent.futures
import time

import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

import ray  # noqa: E402
from ray import serve  # noqa: E402

from deployments.app.builder import build  # noqa: E402
from serve_support import MODEL, app_args, replica_stats, running_app  # noqa: E402

pytestmark = pytest.mark.network  # the default model


def running_engine_replicas() -> int:
    status = serve.status().applications["ponytail"].deployments["EngineReplica"]
    return status.replica_states.get("RUNNING", 0)


def wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture(scope="module")
def app(default_model):
    with running_app(min_replicas=1, max_replicas=2, target_ongoing_requests=1) as (client, _):
        yield client


def long_request(client, tokens=96):
    return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=tokens,
                                     temperature=0.8, extra_body={"ignore_eos": True})


def test_autoscaling_adds_a_replica_under_load_and_removes_it_after(app):
    client = app
    assert running_engine_replicas() == 1
    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        futures = [pool.submit(long_request, client, 160) for _ in range(6)]
        wait_for(lambda: running_engine_replicas() == 2, 90, "a second engine replica under load")
        for future in futures:
            assert future.result(timeout=180).usage.completion_tokens == 160
    wait_for(lambda: running_engine_replicas() == 1, 120, "scale back to one replica when idle")


def test_a_replica_killed_mid_stream_fails_that_stream_and_others_still_succeed(app):
    client = app
    # Two replicas, so the killed one leaves a survivor.
    serve.run(build(app_args(min_replicas=2, max_replicas=2)), name="ponytail", route_prefix="/")
    wait_for(lambda: running_engine_replicas() == 2, 90, "two engine replicas")
    stream = client.completions.create(model=MODEL, prompt="Tell me a story.", max_tokens=400, stream=True,
                                       temperature=0.8, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    ray.kill(ray.get_actor(busy_replica(), namespace="serve"), no_restart=True)
    started = time.monotonic()
    with pytest.raises(openai.APIError):
        for _ in chunks:
            assert time.monotonic() - started < 120, "the stream neither failed nor finished: a hang"
    ok = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert ok.choices[0].finish_reason in ("length", "stop")


def busy_replica() -> str:
    """The actor name of the engine replica that is running a request."""
    for _ in range(20):
        busy = [name for name, stats in replica_stats().items() if stats.num_running > 0]
        if busy:
            return busy[0]
    raise AssertionError("no replica reports a running request")
