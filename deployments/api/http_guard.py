"""The HTTP gate in front of the OpenAI routes: API key, JSON bodies only, body size, CORS.

An ASGI middleware (not Starlette's BaseHTTPMiddleware, which wraps streaming responses and the
disconnect messages the API watches). For every `/v1` request, in this order:

- 401 unless `Authorization: Bearer <api_key>` or `x-api-key: <api_key>` (what Anthropic's
  clients send) matches (compared in constant time), when a key is configured; `/health` stays
  open for load balancers and Serve's checks.
- 415 for a POST whose Content-Type is not application/json: a web page can send a cross-origin
  `text/plain` POST without a CORS preflight, a JSON one it cannot.
- 413 for a body over max_body_bytes: at once from Content-Length, else while it is read; the
  body read here is handed on to the app unchanged.

No CORS headers are sent unless `cors_origins` is configured (then Starlette's CORSMiddleware
answers preflights for those origins only).
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass, field

from starlette.middleware.cors import CORSMiddleware

from . import anthropic_api
from .openai_responses import ErrorInfo, ErrorResponse

API_KEY_ENV = "PONYTAIL_API_KEY"  # as vLLM's VLLM_API_KEY
ANTHROPIC_PATH = "/v1/messages"  # Anthropic's Messages API (anthropic_api.py): errors in its shape


@dataclass(slots=True)
class AccessPolicy:
    api_key: str | None = None  # None: no key asked (only bind to loopback then, see app.yaml)
    cors_origins: list[str] = field(default_factory=list)  # browser origins allowed to call the API
    max_body_bytes: int = 4 << 20


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
    """ASGI middleware enforcing an AccessPolicy on /v1 routes (see the module docstring)."""

    def __init__(self, app, policy: AccessPolicy):
        self.app = app
        self.policy = policy
        self._key = policy.api_key.encode() if policy.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope.get("path", "").startswith("/v1"):
            return await self.app(scope, receive, send)
        if self._key is not None and not self._authorized(scope):
            return await _send_error(scope, send, 401, "a valid API key is required: send it as 'Authorization: "
                                     "Bearer <key>' (or 'x-api-key: <key>')", "invalid_api_key",
                                     [(b"www-authenticate", b"Bearer")])
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
        while True:  # read it all here (bounded), then replay it to the app
            message = await receive()
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


def install(app, policy: AccessPolicy) -> None:
    """Add the guard (and CORS, outermost so preflights are answered, when origins are set)."""
    app.add_middleware(HTTPGuard, policy=policy)
    if policy.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(policy.cors_origins),
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"])
