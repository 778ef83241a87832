"""The Serve app under failure and load (CPU): a replica killed mid-stream, autoscaling 1 -> 2 -> 1."""

import concurrent.futures
import socket
import time

import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

import ray  # noqa: E402
from ray import serve  # noqa: E402

from deployments.app import build  # noqa: E402

pytestmark = pytest.mark.network  # the default model

MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    port = free_port()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build({"device": "cpu", "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                     "kv_cache_memory": "256MiB", "max_num_seqs": 8, "max_model_len": 2048}),
              name="ponytail", route_prefix="/")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120, max_retries=0)
    yield client
    serve.shutdown()
    ray.shutdown()


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
    serve.run(build({"device": "cpu", "min_replicas": 2, "max_replicas": 2, "kv_cache_memory": "256MiB",
                     "max_num_seqs": 8, "max_model_len": 2048}), name="ponytail", route_prefix="/")
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
    """The actor name of the engine replica that is running a request (asking each in turn)."""
    handle = serve.get_deployment_handle("EngineReplica", app_name="ponytail")
    seen = {}
    for _ in range(80):
        replica, stats = handle.engine_stats.remote().result()
        seen[replica] = stats
        busy = [r for r, st in seen.items() if st.num_running > 0]
        if busy and len(seen) == 2:
            return busy[0]
    raise AssertionError(f"no replica reports a running request: {seen}")
