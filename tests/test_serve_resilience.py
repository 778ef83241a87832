"""The Serve app under failure and load (CPU): a replica killed (kill -9) mid-stream, autoscaling 1 -> 2 -> 1."""

import concurrent.futures
import json
import os
import signal
import threading
import time

import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

import psutil  # noqa: E402
import ray  # noqa: E402
try:
    import httpx2 as httpx  # the HTTP library openai>=3 depends on
except ImportError:  # pragma: no cover - older openai clients use httpx
    import httpx
from ray import serve  # noqa: E402

from deployments.api.cut_streams import REPLICA_STOPPED  # noqa: E402
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
    with running_app(min_replicas=1, max_replicas=2, target_ongoing_requests=1) as (client, port):
        yield client, port


def long_request(client, tokens=96):
    return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=tokens,
                                     temperature=0.8, extra_body={"ignore_eos": True})


def test_autoscaling_adds_a_replica_under_load_and_removes_it_after(app):
    client, _ = app
    assert running_engine_replicas() == 1
    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        futures = [pool.submit(long_request, client, 160) for _ in range(6)]
        wait_for(lambda: running_engine_replicas() == 2, 90, "a second engine replica under load")
        for future in futures:
            assert future.result(timeout=180).usage.completion_tokens == 160
    wait_for(lambda: running_engine_replicas() == 1, 120, "scale back to one replica when idle")


def exited(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # exited, not yet reaped
    except psutil.NoSuchProcess:
        return True


STREAMS = {  # each API's stream, and what the proxy writes when its replica dies under it
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Tell me a long story."}]},
    "/v1/messages": {"messages": [{"role": "user", "content": "Tell me a long story."}]},
    "/v1/responses": {"input": "Tell me a long story."},
}


def read_stream(port: int, path: str, opened: threading.Event, events: list[str]) -> None:
    """Streams `path` until it ends, its events' blocks into `events`; sets `opened` on the first."""
    body = {"model": MODEL, "max_tokens": 1000, "ignore_eos": True, "stream": True, **STREAMS[path]}
    if path == "/v1/responses":
        body["max_output_tokens"] = body.pop("max_tokens")
    with httpx.stream("POST", f"http://127.0.0.1:{port}{path}", json=body, timeout=120) as response:
        assert response.status_code == 200
        for block in response.iter_text():
            events.extend(event for event in block.split("\n\n") if event.strip())
            opened.set()


@pytest.mark.chaos
def test_a_replica_killed_mid_stream_ends_every_stream_with_its_error_event(app):
    _, port = app
    # engine_process: the engine in a child process, as on GPUs; it must not outlive its replica
    serve.run(build(app_args(min_replicas=1, max_replicas=1, engine_process=True)), name="ponytail", route_prefix="/")
    wait_for(lambda: running_engine_replicas() == 1, 90, "one engine replica")
    streams = {path: (threading.Event(), []) for path in STREAMS}
    readers = [threading.Thread(target=read_stream, args=(port, path, *streams[path])) for path in STREAMS]
    for reader in readers:
        reader.start()
    for opened, _ in streams.values():
        assert opened.wait(120)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a whole answer in the making, not streamed
        whole = pool.submit(httpx.post, f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True})
        wait_for(lambda: sum(s.num_running for s in replica_stats(1).values()) == 4, 60, "four running requests")
        victim = ray.get_actor(next(iter(replica_stats(1))), namespace="serve")
        pid, engine_pids = ray.get(victim.__ray_call__.remote(
            lambda replica: (os.getpid(), [child.pid for child in psutil.Process().children()])))
        assert engine_pids
        os.kill(pid, signal.SIGKILL)  # kill -9
        for reader in readers:
            reader.join(120)
            assert not reader.is_alive(), "a stream neither ended nor failed: a hang"
        refused = whole.result()
    wait_for(lambda: all(exited(p) for p in engine_pids), 60, "the engine process to exit")
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "service_unavailable"
    *_, error, done = streams["/v1/chat/completions"][1]
    assert json.loads(error.removeprefix("data: "))["error"] == {
        "message": REPLICA_STOPPED, "type": "service_unavailable_error", "param": None, "code": "service_unavailable"}
    assert done == "data: [DONE]"
    anthropic = streams["/v1/messages"][1]
    assert anthropic[-1] == "event: error\ndata: " + json.dumps(
        {"type": "error", "error": {"type": "overloaded_error", "message": REPLICA_STOPPED}})
    assert not any(e.startswith("event: message_stop") for e in anthropic)
    *before, error, failed = streams["/v1/responses"][1]
    last = json.loads(before[-1].split("data: ", 1)[1])["sequence_number"]
    assert json.loads(error.split("data: ", 1)[1])["sequence_number"] == last + 1
    assert failed.startswith("event: response.failed\n")
    assert json.loads(failed.split("data: ", 1)[1])["response"]["status"] == "failed"
    # Serve replaces the replica; the next request waits for it and is answered
    ok = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300,
                    json={"model": MODEL, "prompt": "Hello", "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert [s.used_blocks for s in replica_stats(1).values()] == [0]
