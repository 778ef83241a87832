"""Hostile and oversize input against the OpenAI API (fake backend, no Ray): API keys, JSON-only
bodies, body size, CORS, request limits, OpenAI's ranges and roles, truncated echoes, Retry-After."""

from contextlib import contextmanager

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover - older openai clients use httpx
    import httpx

from deployments.api.http_guard import AccessPolicy
from deployments.api.limits import RequestLimits
from deployments.app.local_server import serve_on_loopback
from deployments.api import BackendUnavailable, build_app
from test_openai_api import CHAT, MODEL, FakeBackend, assert_error

KEY = "sk-test-0123456789"


@contextmanager
def serving(limits=None, policy=None):
    """(backend, base url) of build_app(FakeBackend()) under uvicorn on a free loopback port."""
    backend = FakeBackend()
    with serve_on_loopback(build_app(backend, limits, policy)) as url:
        yield backend, url


@pytest.fixture(scope="module")
def guarded():
    limits = RequestLimits(max_body_bytes=10_000, max_output_tokens=100, max_stop=4, max_stop_chars=20, max_n=2)
    with serving(limits, AccessPolicy(api_key=KEY, max_body_bytes=limits.max_body_bytes)) as served:
        yield served


@pytest.fixture
def http(guarded):
    backend, url = guarded
    backend.reset()
    with httpx.Client(base_url=url, timeout=5, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


@pytest.mark.chaos
def test_api_key_is_required_on_every_route_but_health(guarded, http):
    backend, url = guarded
    with httpx.Client(base_url=url, timeout=5) as anonymous:
        assert anonymous.get("/health").status_code == 200
        for method, path in (("GET", "/v1/models"), ("GET", "/v1/models/x"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions"), ("GET", "/v1/nowhere"), ("POST", "/tokenize"),
                             ("POST", "/detokenize"), ("GET", "/metrics"), ("GET", "/version"), ("GET", "/docs"),
                             ("GET", "/openapi.json")):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"Authorization": f"Basic {KEY}"}):
                r = anonymous.request(method, path, headers=headers, json={"prompt": "hi"})
                error = assert_error(r, 401, None, "a valid API key is required: send it as "
                                                   "'Authorization: Bearer <key>'")
                assert error["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
        for path in ("/v1/messages", "/v1/messages/count_tokens"):  # Anthropic's routes answer in its shape
            r = anonymous.post(path, json={"model": MODEL})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert backend.requests == []
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=5) as client:
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=3).usage.completion_tokens == 3
    with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0, timeout=5) as client:
        with pytest.raises(openai.AuthenticationError, match="a valid API key is required"):
            client.models.list()


def test_metrics_may_be_opened_to_scrapers_and_nothing_else_is():
    with serving(policy=AccessPolicy(api_key=KEY, metrics_without_key=True)) as (_, url):
        with httpx.Client(base_url=url, timeout=5) as anonymous:
            assert anonymous.get("/metrics").status_code == 200
            assert anonymous.get("/v1/models").status_code == 401
            assert anonymous.post("/tokenize", json={"prompt": "hi"}).status_code == 401


def _asgi_call(policy: AccessPolicy, client: tuple | None, path: str = "/v1/models") -> tuple[int, bytes]:
    """One request through the guard alone (the app behind it answers 200), from `client`'s address."""
    import asyncio

    from deployments.api.http_guard import HTTPGuard

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "headers": [], "client": client}
    asyncio.run(HTTPGuard(app, policy)(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_without_a_key_only_this_machines_clients_are_served():
    for client in (("127.0.0.1", 5000), ("::1", 5000), None):  # loopback, or an in-process caller
        assert _asgi_call(AccessPolicy(), client)[0] == 200
    status, body = _asgi_call(AccessPolicy(), ("10.0.0.7", 5000))
    assert status == 403 and b"this server has no API key, so it serves only clients on its own machine" in body
    assert b'"code":"no_api_key"' in body
    assert _asgi_call(AccessPolicy(), ("10.0.0.7", 5000), "/health")[0] == 200  # load balancers' checks
    assert _asgi_call(AccessPolicy(open_access=True), ("10.0.0.7", 5000))[0] == 200  # open on purpose
    assert _asgi_call(AccessPolicy(api_key=KEY), ("10.0.0.7", 5000))[0] == 401  # a key: anyone who has it


@pytest.mark.chaos
def test_a_body_that_trickles_in_gets_a_408_and_frees_the_connection():
    import socket
    import time

    with serving(policy=AccessPolicy(body_timeout_s=0.5)) as (backend, url):
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\"")  # then nothing more
            started = time.monotonic()
            answer = conn.recv(4096).decode()
        assert answer.startswith("HTTP/1.1 408") and "the body did not arrive within 0.5 s (body_timeout_s)" in answer
        assert time.monotonic() - started < 5 and backend.requests == []


@pytest.mark.chaos
def test_every_post_route_has_the_body_limit(http, guarded):
    for path in ("/tokenize", "/detokenize", "/v1/messages/count_tokens", "/v1/responses", "/v1/messages"):
        r = http.post(path, content=b"x" * 20_000, headers={"Content-Type": "application/json"})
        assert r.status_code == 413, (path, r.text)


@pytest.mark.chaos
def test_json_nested_too_deeply_is_a_400_on_every_route(http, guarded):
    deep = b"[" * 100_000 + b"]" * 100_000
    with serving(RequestLimits(max_body_bytes=1 << 20)) as (_, url):
        with httpx.Client(base_url=url, timeout=10) as client:
            for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
                         "/v1/responses", "/tokenize", "/detokenize"):
                r = client.post(path, content=deep, headers={"Content-Type": "application/json"})
                assert r.status_code == 400, (path, r.status_code, r.text[:200])
                assert "Traceback" not in r.text


@pytest.mark.chaos
def test_only_json_bodies_are_taken(http, guarded):
    r = http.post("/v1/completions", content=b'{"prompt": "hi"}', headers={"Content-Type": "text/plain"})
    error = assert_error(r, 415, None, "Content-Type 'text/plain' is not supported; allowed: application/json")
    assert error["code"] == "unsupported_media_type"
    r = http.post("/v1/completions", content=b'{"prompt": "hi"}',
                  headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200
    assert guarded[0].requests and len(guarded[0].requests) == 1


def test_no_cors_headers_unless_origins_are_configured(http):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={"Origin": "https://evil.example"})
    assert r.status_code == 200 and not any(h.startswith("access-control-") for h in r.headers)
    r = http.options("/v1/completions", headers={"Origin": "https://evil.example",
                                                 "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers


def test_configured_cors_origins_get_headers_and_others_do_not():
    with serving(policy=AccessPolicy(cors_origins=["https://app.example"])) as (_, url):
        with httpx.Client(base_url=url, timeout=5) as http:
            preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
            ok = http.options("/v1/chat/completions", headers={"Origin": "https://app.example", **preflight})
            assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
            other = http.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **preflight})
            assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


@pytest.mark.chaos
def test_a_body_over_the_limit_is_a_413_before_it_is_parsed(http, guarded):
    big = b'{"prompt": "' + b"a" * 20_000 + b'"}'
    r = http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
    error = assert_error(r, 413, None, "the body has 20014 bytes; allowed: at most 10000 (max_body_bytes)")
    assert error["code"] == "request_too_large"

    def chunked():  # no Content-Length: counted while it is read
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"a" * 1000
        yield b'"}'

    r = http.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
    assert_error(r, 413, None, "the body has more than 10000 bytes; allowed: at most 10000 (max_body_bytes)")
    r = http.post("/v1/completions", content=b'{"prompt": "' + b"a" * 9000 + b'", "max_tokens": 2}',
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert len(guarded[0].requests) == 1


@pytest.mark.parametrize("body, param, message, code", [
    ({"prompt": "hi", "n": 3}, "n", "n=3 is more than this server allows: at most 2 (max_n)", None),
    ({"prompt": "hi", "best_of": 3}, "best_of", "best_of=3 is more than this server allows: at most 2 (max_n)", None),
    ({"prompt": "hi", "n": 0}, "n", "n=0 is invalid; allowed: an integer in [1, 2] (max_n)", None),
    ({"prompt": "hi", "stop": ["a"] * 5}, "stop", "stop has 5 strings; allowed: at most 4 (max_stop)", None),
    ({"prompt": "hi", "stop": "x" * 21}, "stop",
     "stop has a string of 21 characters; allowed: at most 20 (max_stop_chars)", None),
    ({"prompt": "hi", "max_tokens": 101}, "max_tokens",
     "max_tokens=101 is more than max_output_tokens allows: at most 100 (max_model_len=512)",
     "context_length_exceeded"),
    ({"prompt": list(range(513))}, "prompt", "prompt has 513 tokens; allowed: at most 512 (max_model_len=512)",
     "context_length_exceeded"),
])
def test_limits_refuse_before_any_work(http, guarded, body, param, message, code):
    error = assert_error(http.post("/v1/completions", json=body), 400, param, message)
    assert error["code"] == code
    assert guarded[0].requests == []


def test_chat_limits_name_max_completion_tokens(http, guarded):
    r = http.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 1000})
    assert_error(r, 400, "max_completion_tokens", "max_completion_tokens=1000 is more than max_output_tokens allows")
    assert guarded[0].requests == []


@pytest.mark.parametrize("body, param, message", [
    ({"messages": [{"role": "hacker", "content": "hi"}]}, "messages[0].role",
     "messages[0].role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool' (got 'hacker')"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content",
     "messages[0].content: must be a string or a list of text parts (type 'text'); images, audio and null are "
     "not supported (null only in an assistant message with tool_calls) (got None)"),
    # tool calls (issue 18): an earlier call needs its function; tool_choice needs tools
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "x", "tool_calls": [{"id": "1", "type": "function"}]}]},
     "messages[1].tool_calls[0].function", "messages[1].tool_calls[0].function: Field required"),
    ({**CHAT, "tool_choice": "required"}, "tool_choice",
     "tool_choice='required' is invalid without tools"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options",
     "stream_options: stream_options is only allowed with stream=true"),
    ({**CHAT, "temperature": 1e30}, "temperature",
     "temperature: Input should be less than or equal to 2 (got 1e+30)"),
    ({**CHAT, "presence_penalty": -3}, "presence_penalty",
     "presence_penalty: Input should be greater than or equal to -2 (got -3)"),
])
def test_openai_ranges_and_roles(http, guarded, body, param, message):
    assert_error(http.post("/v1/chat/completions", json=body), 400, param, message)
    assert guarded[0].requests == []


def test_echoed_input_is_truncated(http, guarded):
    r = http.post("/v1/completions", json={"prompt": "hi", "model": "m" * 9_000})  # under max_body_bytes
    error = assert_error(r, 404, "model", "the model 'mmmm", "'... (9000 characters) does not exist")
    assert len(r.content) < 1000
    r = http.get("/v1/models/" + "m" * 30_000)
    assert r.status_code == 404 and len(r.content) < 1000
    assert error["code"] == "model_not_found"


def test_retry_after_follows_the_backend(http, guarded):
    backend = guarded[0]
    backend.fail, backend.fail_at = BackendUnavailable("all engine replicas are busy", retry_after_s=2.5), "first"
    r = http.post("/v1/completions", json={"prompt": "hi"})
    error = assert_error(r, 503, None, "all engine replicas are busy")
    assert r.headers["retry-after"] == "3" and error["code"] == "service_unavailable"


def test_limits_are_checked_when_built():
    with pytest.raises(ValueError, match=r"max_stop=0 is not supported; allowed: an integer >= 1"):
        RequestLimits(max_stop=0)
    with pytest.raises(ValueError, match=r"max_prompt_tokens='4k' is not supported; allowed: an integer >= 1 or "
                                         r"null \(the context\)"):
        RequestLimits(max_prompt_tokens="4k")
