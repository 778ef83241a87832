"""Anthropic's Messages API answers from the chat pipeline's: a ChatCompletion as a Message, and a
chat chunk stream as the Messages event stream (anthropic_protocol.py has the request side).

A Message's `content` holds, in order, a `thinking` block (a reasoning model's thought), a
`text` block and a `tool_use` block per tool call; `stop_reason` is end_turn, max_tokens,
stop_sequence (with the `stop_sequence` that matched) or tool_use. `usage.input_tokens` counts the
prompt tokens computed, `cache_read_input_tokens` those the prefix cache held (Anthropic's
split; their sum is the prompt). Streamed: `message_start`, then per block `content_block_start`,
its deltas (`thinking_delta`, `text_delta`, `input_json_delta`) and `content_block_stop`, then
`message_delta` (stop reason, usage) and `message_stop`. An error is an `error` event, and in a
body `{"type": "error", "error": {"type": ..., "message": ...}}`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response

from .anthropic_protocol import MessagesChatRequest, MessagesRequest
from .errors import APIError
from .shaped_stream import shaped_events
from .streams import DONE

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "invalid_request_error", 413: "request_too_large",
                415: "invalid_request_error",
                429: "rate_limit_error", 503: "overloaded_error"}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}  # else end_turn (or stop_sequence)


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def error_response(error) -> Response:
    """An APIError (errors.py) in Anthropic's shape, with its status and headers."""
    return Response(json.dumps(error_body(error.status, error.info.message)), status_code=error.status,
                    media_type="application/json", headers=error.headers())


def usage(chat_usage) -> dict[str, int]:
    cached = chat_usage.prompt_tokens_details.cached_tokens if chat_usage.prompt_tokens_details else 0
    return {"input_tokens": chat_usage.prompt_tokens - cached, "cache_read_input_tokens": cached,
            "output_tokens": chat_usage.completion_tokens}


class MessagesShape:
    """Turns one chat request's answer into the Messages API's (generate.py calls it)."""

    stream_dialect = "anthropic"  # cut_streams.py: how a stream cut short is ended

    def __init__(self, req: MessagesRequest, chat: MessagesChatRequest):
        self.req = req
        self.chat = chat

    @staticmethod
    def error_response(error) -> Response:
        return error_response(error)

    def stop(self, finish_reason: str | None, stop_reason) -> tuple[str | None, str | None]:
        """(stop_reason, stop_sequence) of a chat choice's finish and the engine's stop reason."""
        if finish_reason is None:
            return None, None
        if finish_reason == "stop" and isinstance(stop_reason, str) and stop_reason in (self.req.stop_sequences or ()):
            return "stop_sequence", stop_reason
        return _STOP_REASONS.get(finish_reason, "end_turn"), None

    def message(self, message_id: str, model: str, content: list, stop: tuple, use: dict | None) -> dict[str, Any]:
        return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": use}

    @staticmethod
    def message_id(chat_id: str) -> str:
        return "msg_" + chat_id.split("-", 1)[-1].replace("-", "")

    def whole(self, completion) -> dict[str, Any]:
        """A ChatCompletion (one choice) as a Message."""
        choice = completion.choices[0]
        message = choice.message
        content = []
        if getattr(message, "reasoning", None):
            content.append({"type": "thinking", "thinking": message.reasoning, "signature": ""})
        if message.content:
            content.append({"type": "text", "text": message.content})
        for call in message.tool_calls or []:
            content.append({"type": "tool_use", "id": call.id, "name": call.function.name,
                            "input": json.loads(call.function.arguments or "{}")})
        if not content:  # Anthropic's empty answer is one empty text block
            content.append({"type": "text", "text": ""})
        return self.message(self.message_id(completion.id), completion.model, content,
                            self.stop(choice.finish_reason, choice.stop_reason), usage(completion.usage))

    def events(self, chunks: AsyncIterator) -> AsyncIterator[dict[str, Any]]:
        """The Messages event stream of a chat chunk stream."""
        return shaped_events(_EventWriter(self).feed, chunks)


class _EventWriter:
    """The open content block of one streamed message and the events that move it on."""

    def __init__(self, shape: MessagesShape):
        self.shape = shape
        self.started = False
        self.index = -1  # the open block's index (blocks are numbered from 0 as they open)
        self.open: str | None = None  # its type: thinking, text, tool_use
        self.calls: dict[int, int] = {}  # chat tool-call index -> its block's index
        self.stop: tuple = (None, None)
        self.failed = False

    def feed(self, item) -> list[dict]:
        if isinstance(item, APIError):
            self.failed = True
            return [error_body(item.status, item.info.message)]
        if item is DONE:
            return [] if self.failed or not self.started else [{"type": "message_stop"}]
        events = []
        if not self.started:
            self.started = True
            opening = usage(item.usage) if item.usage is not None else None
            events.append({"type": "message_start", "message": self.shape.message(
                self.shape.message_id(item.id), item.model, [], (None, None), opening)})
        if not item.choices:  # the last chunk: the whole usage
            return events + self._close() + [{"type": "message_delta", "usage": usage(item.usage),
                                              "delta": {"stop_reason": self.stop[0], "stop_sequence": self.stop[1]}}]
        for choice in item.choices:
            delta = choice.delta
            if getattr(delta, "reasoning", None):
                events += self._text("thinking", delta.reasoning)
            if delta.content:
                events += self._text("text", delta.content)
            for call in delta.tool_calls or []:
                events += self._call(call)
            if choice.finish_reason is not None:
                self.stop = self.shape.stop(choice.finish_reason, choice.stop_reason)
        return events

    def _start(self, kind: str, block: dict) -> list[dict]:
        events = self._close()
        self.index += 1
        self.open = kind
        return events + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open != kind:
            events += self._start(kind, {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                  else {"type": "text", "text": ""})
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta",
                                                                                           "text": text}
        return events + [{"type": "content_block_delta", "index": self.index, "delta": delta}]

    def _call(self, call) -> list[dict]:
        events = []
        if call.index not in self.calls:
            name = call.function.name if call.function else ""
            events += self._start("tool_use", {"type": "tool_use", "id": call.id or f"toolu_{uuid.uuid4().hex}",
                                               "name": name, "input": {}})
            self.calls[call.index] = self.index
        arguments = call.function.arguments if call.function else None
        if arguments and self.calls[call.index] == self.index:
            events.append({"type": "content_block_delta", "index": self.index,
                           "delta": {"type": "input_json_delta", "partial_json": arguments}})
        return events

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]
