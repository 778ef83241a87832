"""Serve's HTTP proxies end the streams an engine replica could not.

With the API on the engine replicas (the default), the replica that writes a stream is also the
process that can die: `kill -9`, a crash, or the kill that ends its shutdown timeout. Serve's proxy
outlives it, but on its own just drops the connection (the client reads a broken chunked body, or
a plain 500 if nothing was sent yet). This middleware runs in every proxy and closes what the
replica left open, as cut_streams.py says: an error event in the stream's API shape (OpenAI's then
`[DONE]`, Anthropic's, the Responses API's), or a 503 with Retry-After when no answer had started.

Ray loads it in each proxy from the import path in RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH, an
environment variable of Serve's controller (proxies inherit its runtime_env): app.yaml sets it in
`controller_options`, `ponytail serve` and the tests pass `controller_options()` to serve.start.
"""

from __future__ import annotations

import logging

from starlette.middleware import Middleware

from deployments.api.cut_streams import STREAM_HEADER, CutStream, unanswered

logger = logging.getLogger("ponytail.proxy")

PROXY_CALLBACK_VARIABLE = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "deployments.app.stream_closer:proxy_middlewares"
_HEADER = STREAM_HEADER.lower().encode()


def proxy_middlewares() -> list[Middleware]:
    """What Serve's proxy calls (PROXY_CALLBACK) for the middlewares it wraps itself in."""
    return [Middleware(StreamCloser)]


def controller_options() -> dict:
    """serve.start's controller_options that install the middleware in every proxy of a new Serve
    (a Serve already running keeps the proxies it has)."""
    return {"runtime_env": {"env_vars": {PROXY_CALLBACK_VARIABLE: PROXY_CALLBACK}}}


class StreamCloser:
    """An ASGI middleware: passes every message through, and when the app behind returns (or
    fails) with this API's event stream still open, or without any answer, writes its ending."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = finished = False
        stream: CutStream | None = None

        async def watched(message) -> None:
            nonlocal started, finished, stream
            kind = message["type"]
            if kind == "http.response.start":
                started = True
                dialect = next((value for name, value in message.get("headers", ()) if name.lower() == _HEADER),
                               None)
                if dialect is not None:
                    stream = CutStream(dialect.decode())
            elif kind == "http.response.body":
                if not message.get("more_body", False):
                    finished = True
                elif stream is not None:
                    stream.feed(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            if not finished:
                await self._close(scope, send, started, stream)

    @staticmethod
    async def _close(scope, send, started: bool, stream: CutStream | None) -> None:
        try:
            if not started:  # the replica died before it answered: say so, with when to retry
                status, headers, body = unanswered(scope.get("path", ""))
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
            elif stream is not None:
                ending = b"" if stream.ended else stream.ending()
                if ending:
                    logger.warning("%s %s: the replica stopped mid-stream; ended it with an error event",
                                   scope.get("method"), scope.get("path"))
                await send({"type": "http.response.body", "body": ending})
        except Exception:  # the client is gone too, or the server closed the connection: nobody to tell
            logger.debug("could not close a cut response", exc_info=True)
