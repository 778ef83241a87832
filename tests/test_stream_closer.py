"""The proxy middleware that ends what a dead engine replica left open (deployments/app/stream_closer.py),
driven with ASGI apps that stop the way a replica's death looks from Serve's proxy: the app returns,
or raises, with its event stream open or before any answer."""

import asyncio
import json

import pytest

from deployments.api.cut_streams import REPLICA_STOPPED, CutStream, unanswered
from deployments.app.stream_closer import PROXY_CALLBACK, PROXY_CALLBACK_VARIABLE, StreamCloser, controller_options

pytestmark = pytest.mark.chaos


def dying_app(dialect: str | None, bodies: list[bytes], raises: bool = False, finish: bool = False):
    """An app that starts an event stream (marked with `dialect`), sends `bodies`, then stops."""
    async def app(scope, receive, send):
        headers = [(b"content-type", b"text/event-stream")]
        if dialect is not None:
            headers.append((b"x-ponytail-stream", dialect.encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for body in bodies:
            await send({"type": "http.response.body", "body": body, "more_body": True})
        if finish:
            await send({"type": "http.response.body", "body": b""})
        if raises:
            raise RuntimeError("the replica's actor died")
    return app


def run(app, path="/v1/chat/completions") -> list[dict]:
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.disconnect"}

    async def main():
        try:
            await StreamCloser(app)({"type": "http", "path": path, "method": "POST"}, receive, send)
        except RuntimeError:
            pass
    asyncio.run(main())
    return sent


def events(sent: list[dict]) -> list[str]:
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    return [block for block in text.split("\n\n") if block]


CHUNK = b'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\n'


@pytest.mark.parametrize("raises", [False, True])
def test_an_openai_stream_cut_short_ends_with_the_error_chunk_then_done(raises):
    sent = run(dying_app("openai", [CHUNK, CHUNK], raises=raises))
    assert sent[-1] == {"type": "http.response.body", "body": sent[-1]["body"]}  # the last message: no more_body
    *text, error, done = events(sent)
    assert text == [CHUNK.decode().strip()] * 2 and done == "data: [DONE]"
    assert json.loads(error.removeprefix("data: ")) == {"error": {
        "message": REPLICA_STOPPED, "type": "service_unavailable_error", "param": None, "code": "service_unavailable"}}


def test_an_anthropic_stream_cut_short_ends_with_an_error_event():
    start = b'event: message_start\ndata: {"type": "message_start"}\n\n'
    *_, error = events(run(dying_app("anthropic", [start]), path="/v1/messages"))
    assert error.startswith("event: error\ndata: ")
    assert json.loads(error.split("data: ", 1)[1]) == {
        "type": "error", "error": {"type": "overloaded_error", "message": REPLICA_STOPPED}}


def test_a_responses_stream_cut_short_ends_with_error_then_response_failed_in_sequence():
    response = {"id": "resp_1", "object": "response", "status": "in_progress", "output": [], "error": None}
    created = f'event: response.created\ndata: {json.dumps({"type": "response.created", "sequence_number": 0, "response": response})}\n\n'
    delta = 'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", "sequence_number": 4, "delta": "Hi"}\n\n'
    *_, error, failed = events(run(dying_app("responses", [created.encode(), delta.encode()]), path="/v1/responses"))
    error = json.loads(error.split("data: ", 1)[1])
    failed = json.loads(failed.split("data: ", 1)[1])
    assert error == {"type": "error", "sequence_number": 5, "code": "service_unavailable",
                     "message": REPLICA_STOPPED, "param": None}
    assert failed["type"] == "response.failed" and failed["sequence_number"] == 6
    assert failed["response"] == {**response, "status": "failed",
                                  "error": {"code": "service_unavailable", "message": REPLICA_STOPPED}}


@pytest.mark.parametrize("dialect, last", [
    ("openai", b'data: {"error": {"message": "x"}}\n\ndata: [DONE]\n\n'),
    ("anthropic", b'event: message_stop\ndata: {"type": "message_stop"}\n\n'),
    ("responses", b'event: response.completed\ndata: {"type": "response.completed", "sequence_number": 9}\n\n'),
])
def test_a_stream_that_ended_itself_is_closed_without_another_ending(dialect, last):
    sent = run(dying_app(dialect, [CHUNK, last]))
    assert sent[-1] == {"type": "http.response.body", "body": b""}
    assert events(sent)[-len(events([{"type": "http.response.body", "body": last}])):] == events(
        [{"type": "http.response.body", "body": last}])  # what the stream wrote last, nothing after it


def test_finished_streams_and_other_apps_streams_pass_untouched():
    finished = run(dying_app("openai", [CHUNK], finish=True))
    assert [m.get("body") for m in finished[1:]] == [CHUNK, b""]
    foreign = run(dying_app(None, [CHUNK]))  # not this API's: nothing added, the server closes it
    assert [m.get("body") for m in foreign[1:]] == [CHUNK]


@pytest.mark.parametrize("path, shape", [("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic"),
                                         ("/v1/messages/count_tokens", "anthropic")])
def test_a_request_the_replica_never_answered_gets_a_503_with_retry_after(path, shape):
    async def app(scope, receive, send):
        raise RuntimeError("the replica's actor died")

    start, body = run(app, path)
    assert start["status"] == 503 and (b"retry-after", b"1") in start["headers"]
    error = json.loads(body["body"])
    if shape == "anthropic":
        assert error == {"type": "error", "error": {"type": "overloaded_error", "message": REPLICA_STOPPED}}
    else:
        assert error["error"]["code"] == "service_unavailable" and error["error"]["message"] == REPLICA_STOPPED
    assert unanswered(path)[2] == body["body"]


def test_a_client_gone_with_the_replica_is_nobody_to_tell():
    async def send(message):
        raise OSError("connection closed")

    async def main():
        await StreamCloser(dying_app("openai", []))({"type": "http", "path": "/", "method": "POST"}, None, send)
    with pytest.raises(OSError):  # the app's own send fails first; the closer adds nothing to it
        asyncio.run(main())


def test_unknown_dialects_are_refused_by_name():
    with pytest.raises(ValueError, match=r"dialect='grpc': allowed: openai, anthropic, responses"):
        CutStream("grpc")


def test_every_proxy_loads_the_closer_from_the_controllers_environment():
    import yaml
    from pathlib import Path
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load((Path(__file__).parents[1] / "deployments" /
                                                              "app.yaml").read_text()))
    assert config.controller_options.runtime_env == controller_options()["runtime_env"]
    assert controller_options()["runtime_env"]["env_vars"] == {PROXY_CALLBACK_VARIABLE: PROXY_CALLBACK}
    from ray.serve._private.http_util import validate_http_proxy_callback_return
    from ray.serve._private.utils import call_function_from_import_path

    assert validate_http_proxy_callback_return(call_function_from_import_path(PROXY_CALLBACK))  # as the proxy does
