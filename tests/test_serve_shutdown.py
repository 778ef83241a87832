"""Removing the app (CPU, real Serve): engine replicas finish their streams for shutdown_timeout_s,
then every stream still open ends with an error event and [DONE], never cut or left hanging. With a
separate ingress the ingress outlives the engines and writes it; with the engine replicas serving
the API (the default) Serve's proxy does (deployments/app/stream_closer.py)."""

import json
import threading
import time

import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("openai")  # serve_support drives the app with the openai client
try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover - older openai clients use httpx
    import httpx

from ray import serve  # noqa: E402

from serve_support import MODEL, running_app  # noqa: E402

pytestmark = [pytest.mark.network, pytest.mark.chaos]  # the default model


def stream_while_deleting(port: int) -> tuple[list[str], Exception | None, float]:
    """Streams a long completion and deletes the app after its third event: (the events' data,
    the error that ended the read or None, seconds from the delete's start to the stream's end)."""
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    events, deleting, cut = [], None, None
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: "):])
                if len(events) == 3:  # streaming: now take the app down under it
                    started = time.monotonic()
                    deleting = threading.Thread(target=serve.delete, args=("ponytail",), daemon=True)
                    deleting.start()
    except httpx.RemoteProtocolError as exc:  # the replica went away mid-body
        cut = exc
    ended_in = time.monotonic() - started
    deleting.join(timeout=60)
    assert not deleting.is_alive()
    return events, cut, ended_in


@pytest.mark.parametrize("api_in_engines", [False, True])
def test_shutdown_ends_open_streams_with_an_error_event_and_done(default_model, api_in_engines):
    with running_app(min_replicas=1, max_replicas=1, shutdown_timeout_s=3, api_in_engines=api_in_engines) as (_, port):
        events, cut, ended_in = stream_while_deleting(port)
        assert cut is None
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "service_unavailable"
        assert error["message"] == ("the engine replica serving this request stopped (the server is shutting down "
                                    "or the replica failed); retry later")
        assert all("choices" in json.loads(e) for e in events[:-2])  # text until then
        assert ended_in >= 3  # it streamed on for shutdown_timeout_s first
        print(f"stream ended {ended_in:.1f} s after the delete began (engines' shutdown_timeout_s: 3)")
