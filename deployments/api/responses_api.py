"""OpenAI's Responses API answers from the chat pipeline's: a ChatCompletion as a Response, and
a chat chunk stream as the Responses event stream (responses_protocol.py has the request side).

A Response's `output` holds, in order, a `reasoning` item (a reasoning model's thought), a
`message` item with one `output_text` part (the content), and one `function_call` item per tool
call. Streamed, each item is opened (`response.output_item.added`), filled with deltas
(`response.reasoning_text.delta`, `response.output_text.delta`,
`response.function_call_arguments.delta`) and closed (`....done`, `response.output_item.done`),
between `response.created` / `response.in_progress` and `response.completed` (or
`response.incomplete` when max_output_tokens cut it), which carries the whole response and its
usage. Every event has a `sequence_number`. An error mid-stream is an `error` event.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from .responses_protocol import ResponsesChatRequest, ResponsesRequest
from .errors import APIError
from .shaped_stream import shaped_events
from .streams import DONE


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesShape:
    """Turns one chat request's answer into the Responses API's (generate.py calls it)."""

    stream_dialect = "responses"  # cut_streams.py: how a stream cut short is ended

    def __init__(self, req: ResponsesRequest, chat: ResponsesChatRequest):
        self.req = req
        self.chat = chat
        self.created_at = int(time.time())

    def response(self, response_id: str, model: str, output: list[dict], status: str,
                 usage: dict | None = None) -> dict[str, Any]:
        chat, req = self.chat, self.req
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": response_id, "object": "response", "created_at": self.created_at, "model": model,
            "status": status, "output": output, "usage": usage, "error": None, "incomplete_details": incomplete,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": chat.temperature, "top_p": chat.top_p,
            "parallel_tool_calls": chat.parallel_tool_calls is not False,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "text": req.text.model_dump(by_alias=True) if req.text else {"format": {"type": "text"}},
            "reasoning": req.reasoning.model_dump() if req.reasoning else None, "store": False,
            "previous_response_id": None, "metadata": None, "truncation": "disabled", "background": False,
        }

    @staticmethod
    def response_id(chat_id: str) -> str:
        return "resp_" + chat_id.split("-", 1)[-1].replace("-", "")

    def whole(self, completion) -> dict[str, Any]:
        """A ChatCompletion (one choice) as a Response."""
        choice = completion.choices[0]
        message = choice.message
        output = []
        if getattr(message, "reasoning", None):
            output.append(_reasoning_item(_item_id("rs"), message.reasoning))
        if message.content:
            item = _message_item(_item_id("msg"), message.content, "completed")
            item["content"][0]["logprobs"] = _logprobs(choice)
            output.append(item)
        for call in message.tool_calls or []:
            output.append(_call_item(_item_id("fc"), call.id, call.function.name, call.function.arguments))
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        return self.response(self.response_id(completion.id), completion.model, output, status,
                             _usage(completion.usage))

    def events(self, chunks: AsyncIterator) -> AsyncIterator[dict[str, Any]]:
        """The Responses event stream of a chat chunk stream."""
        return shaped_events(_EventWriter(self).feed, chunks)


class _EventWriter:
    """The open items of one streamed response and the events that move them on."""

    def __init__(self, shape: ResponsesShape):
        self.shape = shape
        self.sequence = 0
        self.output: list[dict] = []  # items so far (closed ones final)
        self.open: dict | None = None  # the item being written: reasoning or message
        self.calls: dict[int, dict] = {}  # tool-call index -> its function_call item
        self.response_id = None
        self.model = None
        self.finish_reason = None
        self.usage = None
        self.failed: dict | None = None  # the error that ended the stream
        self.logprobs: list[dict] = []  # token logprobs not sent yet: they go with the next output_text delta

    def _event(self, kind: str, **fields) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def feed(self, item) -> list[dict]:
        if isinstance(item, APIError):  # the stream ends here: `error`, then the response failed
            info = item.info
            self.failed = {"code": info.code or str(item.status), "message": info.message}
            events = [self._event("error", **self.failed, param=info.param)]
            if self.response_id is not None:
                failed = self.shape.response(self.response_id, self.model, [_final(i) for i in self.output],
                                             "failed", self.usage)
                events.append(self._event("response.failed", response={**failed, "error": self.failed}))
            return events
        if item is DONE:
            return [] if self.response_id is None or self.failed else self._finish()
        events = []
        if self.response_id is None:
            self.response_id, self.model = self.shape.response_id(item.id), item.model
            started = self.shape.response(self.response_id, self.model, [], "in_progress")
            events += [self._event("response.created", response=started),
                       self._event("response.in_progress", response=started)]
        if item.usage is not None:
            self.usage = _usage(item.usage)
        for choice in item.choices:
            delta = choice.delta
            self.logprobs += _logprobs(choice)
            if delta.reasoning:
                events += self._text("reasoning", delta.reasoning)
            if delta.content:
                events += self._text("message", delta.content)
            for call in delta.tool_calls or []:
                events += self._call(call)
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            item = (_reasoning_item(_item_id("rs"), "", "in_progress") if kind == "reasoning"
                    else _message_item(_item_id("msg"), "", "in_progress"))
            self.open = item
            self.output.append(item)
            events.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                      item=_empty(item)))
            events.append(self._event("response.content_part.added", **self._where(), part=_empty_part(item)))
        part = self.open["content"][0]
        part["text"] += text
        if kind == "reasoning":
            return events + [self._event("response.reasoning_text.delta", **self._where(), delta=text)]
        logprobs, self.logprobs = self.logprobs, []  # the thought's too, as the whole answer's message has them
        part["logprobs"] += logprobs
        return events + [self._event("response.output_text.delta", **self._where(), delta=text, logprobs=logprobs)]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": self.output.index(self.open), "content_index": 0}

    def _call(self, call) -> list[dict]:
        events = []
        item = self.calls.get(call.index)
        if item is None:
            events += self._close()
            item = _call_item(_item_id("fc"), call.id, call.function.name if call.function else "", "",
                              "in_progress")
            self.calls[call.index] = item
            self.output.append(item)
            events.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                      item=dict(item)))
        arguments = call.function.arguments if call.function else None
        if arguments:
            item["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.output.index(item), delta=arguments))
        return events

    def _close(self) -> list[dict]:
        """Close the open reasoning or message item."""
        item, self.open = self.open, None
        if item is None:
            return []
        part = item["content"][0]
        index = self.output.index(item)
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            done = [self._event("response.reasoning_text.done", **where, text=part["text"])]
        else:
            done = [self._event("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"])]
        item["status"] = "completed"
        done.append(self._event("response.content_part.done", **where, part=dict(part)))
        return done + [self._event("response.output_item.done", output_index=index, item=_final(item))]

    def _finish(self) -> list[dict]:
        events = self._close()
        for item in self.calls.values():
            index = self.output.index(item)
            item["status"] = "completed"
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, arguments=item["arguments"]))
            events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        status = "incomplete" if self.finish_reason == "length" else "completed"
        final = self.shape.response(self.response_id, self.model, [_final(i) for i in self.output], status,
                                    self.usage)
        return events + [self._event(f"response.{status}", response=final)]


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _empty(item: dict) -> dict:
    """An item as announced: no content yet."""
    return {**item, "content": []}


def _empty_part(item: dict) -> dict:
    part = {**item["content"][0], "text": ""}
    if "logprobs" in part:
        part["logprobs"] = []  # not the part's own list, which grows
    return part


def _final(item: dict) -> dict:
    return json.loads(json.dumps(item))  # a copy later deltas cannot change


def _logprobs(choice) -> list[dict]:
    """A chat choice's token logprobs (include "message.output_text.logprobs") as output_text's."""
    logprobs = getattr(choice, "logprobs", None)
    return [token.model_dump() for token in logprobs.content or []] if logprobs is not None else []


def _usage(usage) -> dict[str, Any] | None:
    if usage is None:
        return None
    # Both details always, as OpenAI's schema has them: reasoning 0 where answers are not split.
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    reasoning = usage.completion_tokens_details.reasoning_tokens if usage.completion_tokens_details else 0
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": usage.total_tokens}
