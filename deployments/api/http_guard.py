"""The HTTP gate in front of every route: API key, who may call without one, JSON bodies only, body
size and time, CORS.

An ASGI middleware (not Starlette's BaseHTTPMiddleware, which wraps streaming responses and the
disconnect messages the API watches). For every request but `/health` (open for load balancers and
Serve's checks), in this order:

- with a key configured, 401 unless `Authorization: Bearer <api_key>` or `x-api-key: <api_key>`
  (what Anthropic's clients send) matches (compared in constant time); `metrics_without_key` opens
  `/metrics` to scrapers that send none;
- without one, 403 for a client that is not on this machine (its address is not loopback) unless
  `open_access` says the API is open on purpose (behind a gateway that authenticates callers);
- 415 for a POST whose Content-Type is not application/json: a web page can send a cross-origin
  `text/plain` POST without a CORS preflight, a JSON one it cannot;
- 413 for a body over max_body_bytes: at once from Content-Length, else while it is read; 408 for a
  body that has not all arrived within body_timeout_s (a client sending a byte at a time holds
  nothing longer). The body read here is handed on to the app unchanged.

No CORS headers are sent unless `cors_origins` is configured (then Starlette's CORSMiddleware
answers preflights for those origins only).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from dataclasses import dataclass, field

from starlette.middleware.cors import CORSMiddleware

from . import anthropic_api
from .openai_responses import ErrorInfo, ErrorResponse

API_KEY_ENV = "PONYTAIL_API_KEY"  # as vLLM's VLLM_API_KEY
ANTHROPIC_PATH = "/v1/messages"  # Anthropic's Messages API (anthropic_api.py): errors in its shape


OPEN_PATHS = ("/health",)
LOOPBACK = ("127.", "::1", "localhost")  # address prefixes of this machine's own clients


@dataclass(slots=True)
class AccessPolicy:
    api_key: str | None = None  # None: no key asked, and only this machine's clients are served
    cors_origins: list[str] = field(default_factory=list)  # browser origins allowed to call the API
    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 30.0  # the most a request body may take to arrive
    open_access: bool = False  # without a key, serve other machines' clients too
    metrics_without_key: bool = False  # /metrics answers scrapers without the key


async def _send_error(scope, send, status: int, message: str, code: str, headers: list | None = None) -> None:
    if scope.get("path", "").startswith(ANTHROPIC_PATH):  # Anthropic's clients read their own error shape
        body = json.dumps(anthropic_api.error_body(status, message))
    else:
        kind = "invalid_request_error"
        body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=None, code=code)).model_dump_json()
    data = body.encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class HTTPGuard:
    """ASGI middleware enforcing an AccessPolicy on every route but /health (the module docstring)."""

    def __init__(self, app, policy: AccessPolicy):
        self.app = app
        self.policy = policy
        self._key = policy.api_key.encode() if policy.api_key else None

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self._key is not None:
            if not self._authorized(scope) and not (self.policy.metrics_without_key and path == "/metrics"):
                return await _send_error(scope, send, 401, "a valid API key is required: send it as 'Authorization: "
                                         "Bearer <key>' (or 'x-api-key: <key>')", "invalid_api_key",
                                         [(b"www-authenticate", b"Bearer")])
        elif not self.policy.open_access and not _local(scope):
            return await _send_error(scope, send, 403, "this server has no API key, so it serves only clients on its "
                                     "own machine; allowed: set api_key (or PONYTAIL_API_KEY) and send it, or "
                                     "open_access: true where a gateway authenticates callers", "no_api_key")
        if scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        content_type = (_header(scope, b"content-type") or "").split(";")[0].strip().lower()
        if content_type != "application/json":
            return await _send_error(scope, send, 415, f"Content-Type {content_type or '(none)'!r:.60} is not "
                                     "supported; allowed: application/json", "unsupported_media_type")
        limit = self.policy.max_body_bytes
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await _send_error(scope, send, 413, f"the body has {int(length)} bytes; allowed: at most {limit} "
                                     "(max_body_bytes)", "request_too_large")
        body, message = [], None
        size = 0
        deadline = asyncio.get_running_loop().time() + self.policy.body_timeout_s
        while True:  # read it all here (bounded in size and time), then replay it to the app
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                return await _send_error(scope, send, 408, f"the body did not arrive within "
                                         f"{self.policy.body_timeout_s:g} s (body_timeout_s)", "request_timeout")
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > limit:
                return await _send_error(scope, send, 413, f"the body has more than {limit} bytes; allowed: at most "
                                         f"{limit} (max_body_bytes)", "request_too_large")
            body.append(message.get("body", b""))
            if not message.get("more_body", False):
                message = None
                break
        replay = [{"type": "http.request", "body": b"".join(body), "more_body": False}]
        if message is not None:  # a disconnect met while reading: the app sees it next
            replay.append(message)

        async def replayed():
            return replay.pop(0) if replay else await receive()

        return await self.app(scope, replayed, send)

    def _authorized(self, scope) -> bool:
        given = _header(scope, b"authorization") or ""
        scheme, _, token = given.partition(" ")
        # compare_digest on bytes of any length: the time does not tell how much of the key matched
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._key):
            return True
        key = _header(scope, b"x-api-key")
        return key is not None and hmac.compare_digest(key.strip().encode(), self._key)


def _local(scope) -> bool:
    """The client is on this machine (its address is loopback; no address: an in-process caller)."""
    client = scope.get("client")
    return not client or str(client[0]).startswith(LOOPBACK)


def install(app, policy: AccessPolicy) -> None:
    """Add the guard (and CORS, outermost so preflights are answered, when origins are set)."""
    app.add_middleware(HTTPGuard, policy=policy)
    if policy.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(policy.cors_origins),
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"])
