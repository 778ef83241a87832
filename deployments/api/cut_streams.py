"""How a layer still alive closes what the server behind it left open: a stream cut short (its
replica died, or was stopped at the end of its shutdown timeout) ends with an explicit error event
in its API's shape, and a request that got no answer at all gets a 503 with Retry-After, so a
client never mistakes a crash for a complete answer or for a network fault.

Every event stream of this API names its shape in the X-Ponytail-Stream header: `openai` (chat and
completions: an error chunk, then `data: [DONE]`), `anthropic` (Messages: an `error` event) or
`responses` (an `error` event, then `response.failed`). A CutStream watches the stream's messages
as they pass (Serve's proxy carries every token, so it keeps references, never parses per token)
and knows whether the stream already ended itself.
"""

from __future__ import annotations

import json
import re

from .anthropic_api import error_body as anthropic_error_body
from .errors import APIError

STREAM_HEADER = "X-Ponytail-Stream"
DIALECTS = ("openai", "anthropic", "responses")
REPLICA_STOPPED = ("the engine replica serving this request stopped (the server is shutting down or the "
                   "replica failed); retry later")
RETRY_AFTER_S = 1.0

# The events after which a stream of each shape has ended (normally or with its own error event).
_ENDINGS = {"openai": (b"data: [DONE]",),
            "anthropic": (b"event: message_stop", b"event: error"),
            "responses": (b"event: response.completed", b"event: response.incomplete", b"event: response.failed",
                          b"event: error")}
_SEQUENCE = re.compile(rb'"sequence_number":\s*(\d+)')
_CREATED = re.compile(rb"event: response.created\ndata: (.*)\n")


def replica_stopped() -> APIError:
    return APIError(503, REPLICA_STOPPED, code="service_unavailable", retry_after_s=RETRY_AFTER_S)


class CutStream:
    """One event stream of this API on its way to the client; `ending()` is what closes it if the
    server behind stops writing before its last event."""

    def __init__(self, dialect: str):
        if dialect not in DIALECTS:
            raise ValueError(f"dialect={dialect!r}: allowed: {', '.join(DIALECTS)}")
        self.dialect = dialect
        self.first = b""  # the first message: the Responses API's response.created is there
        self.last = b""  # the latest message: whether the stream ended, and its last sequence number

    def feed(self, body: bytes) -> None:
        """A body message on its way; messages hold whole events (one per yielded chunk)."""
        if body:
            if not self.first:
                self.first = body
            self.last = body

    @property
    def ended(self) -> bool:
        return any(marker in self.last for marker in _ENDINGS[self.dialect])

    def ending(self, error: APIError | None = None) -> bytes:
        """The events that end this stream with `error` (the replica stopped, by default)."""
        error = error or replica_stopped()
        if self.dialect == "openai":
            return f"data: {error.body()}\n\ndata: [DONE]\n\n".encode()
        if self.dialect == "anthropic":
            return _event("error", anthropic_error_body(error.status, error.info.message))
        failure = {"code": error.info.code or str(error.status), "message": error.info.message}
        numbers = _SEQUENCE.findall(self.last)
        sequence = int(numbers[-1]) + 1 if numbers else 0
        events = _event("error", {"type": "error", "sequence_number": sequence, **failure, "param": None})
        created = _CREATED.search(self.first)
        if created is not None:
            response = {**json.loads(created.group(1))["response"], "status": "failed", "error": failure}
            events += _event("response.failed", {"type": "response.failed", "sequence_number": sequence + 1,
                                                 "response": response})
        return events


def unanswered(path: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """(status, headers, body) for a request the server behind never answered (its replica died
    first): a 503 with Retry-After, in Anthropic's shape on the Messages API, else OpenAI's."""
    error = replica_stopped()
    if path.rstrip("/").endswith(("/v1/messages", "/v1/messages/count_tokens")):
        body = json.dumps(anthropic_error_body(error.status, error.info.message)).encode()
    else:
        body = error.body().encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *((name.lower().encode(), value.encode()) for name, value in error.headers().items())]
    return error.status, headers, body


def _event(kind: str, payload: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()
