"""Tool calls a model writes in its own format, for tool_choice "auto": found in its output, whole or streamed.

With "auto" the model decides between text and calls, so nothing constrains its output: the calls
are whatever its chat template taught it to write. One format is read here, Hermes's, which the
templates of Qwen2.5/Qwen3, Hermes 2/3 and many fine-tunes use (vLLM's `--tool-call-parser
hermes`): each call is a JSON object {"name": ..., "arguments": {...}} between `<tool_call>` and
`</tool_call>` (or a list of such objects in one block), any text around the calls is the
answer's content. A served template that
mentions `<tool_call>` is taken to use it (`tool_call_format`); other templates (SmolLM2's) have no
format to read and "auto" is refused for them (tools.py).

`HermesCallStream` splits a streamed output as it comes: text goes out as content except a tail
that may be the start of `<tool_call>`, held until the next piece decides it; a call goes out once
its closing tag arrives (its arguments in one delta, which OpenAI's stream format allows).
`parse_hermes` reads a finished output the same way, so a stream and the whole answer agree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

HERMES = "hermes"
FORMATS = (HERMES,)
OPEN, CLOSE = "<tool_call>", "</tool_call>"


def tool_call_format(chat_template) -> str | None:
    """The tool-call format a chat template writes (HERMES), or None where it shows none.
    `chat_template` is the tokenizer's: a string, a dict of named templates, or None."""
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    return HERMES if any(isinstance(t, str) and OPEN in t for t in templates) else None


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call the model wrote: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


def _calls(body: str) -> list[ParsedCall] | None:
    """The calls in one `<tool_call>` block's body: an object, or a list of them (some fine-tunes
    write one block for all their calls); None when it is not that (bad JSON, a call without a name)."""
    try:
        items = json.loads(body)
    except ValueError:
        return None
    items = items if isinstance(items, list) else [items]
    if not items or not all(isinstance(item, dict) and isinstance(item.get("name"), str) for item in items):
        return None
    calls = []
    for item in items:
        arguments = item.get("arguments", item.get("parameters", {}))
        calls.append(ParsedCall(item["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
    return calls


class HermesCallStream:
    """Feeds of one choice's output -> ("content", text) and ("call", ParsedCall) events, in order.

    A block whose body is not a call (the model wrote the tag and then no JSON) stays in the
    content as written, tags included. Trailing whitespace waits for more text: it goes out with
    the next text, or at the end when no call was made; before and between calls (newlines) it is
    not content. Where the pieces are cut changes nothing."""

    def __init__(self):
        self._held = ""  # content not sent yet: a possible start of OPEN
        self._blank = ""  # content not sent yet: trailing whitespace
        self._body: list[str] | None = None  # inside a block: its body so far
        self.num_calls = 0

    def feed(self, text: str) -> list[tuple[str, object]]:
        events: list[tuple[str, object]] = []
        text = self._held + text
        self._held = ""
        while text:
            if self._body is not None:
                joined = "".join(self._body) + text
                end = joined.find(CLOSE)
                if end < 0:
                    self._body = [joined]
                    return events
                self._close(joined[:end], events)
                text = joined[end + len(CLOSE):]
                continue
            start = text.find(OPEN)
            if start >= 0:
                self._content(events, text[:start])
                self._body = []
                text = text[start + len(OPEN):]
                continue
            keep = _partial_tag(text)
            self._content(events, text[:len(text) - keep])
            self._held = text[len(text) - keep:]
            break
        return events

    def finish(self) -> list[tuple[str, object]]:
        """The end of the output: held text, and an unclosed block (a call if its body parses)."""
        events: list[tuple[str, object]] = []
        if self._body is not None:
            body, self._body = "".join(self._body), None
            calls = _calls(body)
            if calls is not None:
                self._called(events, calls)
            else:
                self._content(events, OPEN + body)
        self._content(events, self._held)
        if self._blank and not self.num_calls:
            events.append(("content", self._blank))
        self._held = self._blank = ""
        return events

    def _close(self, body: str, events: list) -> None:
        self._body = None
        calls = _calls(body)
        if calls is None:
            self._content(events, OPEN + body + CLOSE)
        else:
            self._called(events, calls)

    def _called(self, events: list, calls: list[ParsedCall]) -> None:
        self.num_calls += len(calls)
        events.extend(("call", call) for call in calls)

    def _content(self, events: list, text: str) -> None:
        text = self._blank + text
        kept = text.rstrip()
        if kept:
            events.append(("content", kept))
        self._blank = text[len(kept):]


def parse_hermes(text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a finished output, as the stream splits it; content None when empty."""
    stream = HermesCallStream()
    events = stream.feed(text) + stream.finish()
    content = "".join(value for kind, value in events if kind == "content")
    calls = [value for kind, value in events if kind == "call"]
    return (content or None), calls


def _partial_tag(text: str) -> int:
    """Length of the longest tail of `text` that OPEN starts with (held back, it may be a tag)."""
    for size in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0
