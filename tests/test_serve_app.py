"""The Serve application end to end on the CPU: two engine replicas of the embedded default model,
the OpenAI client over HTTP, a Serve handle, bad input, disconnects. Loopback only. The replicas run
their engines in child processes (engine_process, the GPU default), so this path is tested here;
the other Serve tests keep the CPU default (the engine in the replica's process)."""

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

import ray  # noqa: E402
from ray import serve  # noqa: E402

from deployments.api.protocol import GenerateRequest  # noqa: E402
from ponytail import SamplingParams  # noqa: E402
from serve_support import MODEL, replica_stats, running_app  # noqa: E402

pytestmark = pytest.mark.network  # the default model


@pytest.fixture(scope="module")
def app(default_model):  # default_model: the converted checkpoint exists before replicas start
    with running_app(min_replicas=2, max_replicas=2, engine_process=True) as started:
        yield started


def wait_until_idle(timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = list(replica_stats().values())
        if all(s.used_blocks == 0 and s.num_running == 0 for s in stats):
            return stats
        time.sleep(0.5)
    raise AssertionError(f"replicas still hold KV blocks: {stats}")


def test_two_replicas_serve_the_openai_api(app):
    client, _ = app
    served, alias = client.models.list().data
    assert served.id == served.root and alias.id == MODEL  # the tokenizer's path first, the short name too
    status = serve.status().applications["ponytail"].deployments["EngineReplica"]
    assert sum(status.replica_states.values()) == 2

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert "Paris" in chat.choices[0].message.content
    assert chat.usage.completion_tokens == 16 or chat.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                              stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content

    completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                           temperature=0)
    stream = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == completion.choices[0].text
    assert completion.usage.prompt_tokens > 0 and completion.usage.total_tokens == (
        completion.usage.prompt_tokens + completion.usage.completion_tokens)
    wait_until_idle()


def test_a_serve_handle_yields_the_same_deltas_as_http(app):
    client, _ = app
    http = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=8, temperature=0)
    handle = serve.get_app_handle("ponytail")
    request = GenerateRequest(prompt="1, 2, 3,", sampling=SamplingParams(max_tokens=8, temperature=0))
    deltas = list(handle.options(stream=True).generate.remote(request))
    assert deltas[-1].finished and deltas[-1].finish_reason == http.choices[0].finish_reason
    assert "".join(d.text for d in deltas) == http.choices[0].text


def readme_example(marker: str) -> str:
    """The code block README.md holds between <!-- marker --> and <!-- /marker -->."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    found = re.search(rf"<!-- {marker} -->\n```python\n(.*?)```\n<!-- /{marker} -->", readme, re.S)
    assert found, f"README.md has no python block marked {marker}"
    return found.group(1)


def test_the_readme_serve_handle_example_runs_as_written(app):
    code = readme_example("serve-handle-example")
    assert "asyncio.run(main())" in code and 'ray.init(address="auto")' in code
    # address="auto" finds this test's cluster through RAY_ADDRESS (other Ray clusters may share the machine).
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), f"the example printed nothing; stderr: {done.stderr[-2000:]}"


@pytest.mark.parametrize("kwargs, status, field", [
    (dict(model=MODEL, prompt="hi", max_tokens=10, temperature=-1), 400, "temperature"),
    (dict(model=MODEL, prompt="hi", max_tokens=-5), 400, "max_tokens"),
    (dict(model=MODEL, prompt="hi", max_tokens=10, top_p=2.0), 400, "top_p"),
    (dict(model=MODEL, prompt="hi " * 2100, max_tokens=10), 400, "max_model_len"),
    (dict(model="gpt-4", prompt="hi", max_tokens=10), 404, "gpt-4"),
])
def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(app, kwargs, status, field):
    client, _ = app
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(**kwargs)
    assert caught.value.status_code == status
    assert field in caught.value.body["message"]
    ok = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")
    wait_until_idle()


def test_malformed_json_is_a_400(app):
    httpx = pytest.importorskip("httpx2") if _has("httpx2") else pytest.importorskip("httpx")
    _, port = app
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", content=b"{not json",
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.chaos
def test_a_client_that_leaves_mid_stream_frees_its_blocks(app):
    client, _ = app
    stream = client.completions.create(model=MODEL, prompt="Tell me a long story.", max_tokens=400, stream=True,
                                       temperature=0.8, extra_body={"ignore_eos": True})
    for index, _ in enumerate(stream):
        if index == 3:
            break
    stream.close()
    wait_until_idle()


@pytest.mark.chaos
def test_a_client_that_stops_reading_holds_only_its_own_request(app):
    """A stalled reader (its socket's buffers fill): others are served meanwhile; when it goes
    away its request is aborted and its blocks freed."""
    client, port = app
    with socket.create_connection(("127.0.0.1", port)) as stalled:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = json.dumps({"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 1000, "ignore_eos": True,
                           "stream": True, "logprobs": 5}).encode()  # big events: the buffers fill quickly
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert stalled.recv(64).startswith(b"HTTP/1.1 200")  # then reads nothing more
        for _ in range(3):
            answer = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8)
            assert answer.choices[0].finish_reason == "length"
        assert sum(s.num_running for s in replica_stats().values()) == 1  # the stalled one, still there
    wait_until_idle(60)  # gone: aborted, its blocks back


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_behind_serve_one_request_id_metrics_tokenize_and_echo(app):
    import json
    import urllib.request

    client, port = app
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="The capital of France is", max_tokens=2,
                                                      temperature=0, echo=True, logprobs=1)
    assert len(raw.headers.get_list("x-request-id")) == 1  # Serve's proxy sets it; the app adds none
    choice = raw.parse().choices[0]
    assert choice.text.startswith("The capital of France is") and choice.logprobs.token_logprobs[0] is None
    with_id = client.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=1,
                                                          extra_headers={"x-request-id": "given-1"})
    assert with_id.headers.get_list("x-request-id") == ["given-1"] and with_id.parse().id == "cmpl-given-1"
    request = urllib.request.Request(f"http://127.0.0.1:{port}/tokenize", data=json.dumps({"prompt": "Hi"}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert json.load(response)["count"] >= 1
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as response:
        text = response.read().decode()
    assert f'ponytail:generation_tokens_total{{model_name="{MODEL}"}}' in text  # the short name, not the path
    assert "ponytail:kv_cache_usage_perc{" in text
    assert client.models.list().data[0].root
