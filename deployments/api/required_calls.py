"""tool_choice "required" read as it is generated: each call's name as soon as it is written, then its
arguments in pieces as they come, as OpenAI and vLLM stream them.

The grammar makes the output a JSON list of {"name": ..., "parameters": {...}} objects (tools.py).
`RequiredCallStream.feed(text)` follows it character by character (strings, escapes, nesting) and
returns events: ("name", i, name) once call i's name string closes, ("arguments", i, piece) for
each piece of call i's parameters text. A call whose parameters come before its name (the grammar
allows either order) gets them right after its name. `complete` says the list closed; `calls`
holds the calls whose objects closed, so a list cut short (max_tokens) shows only whole calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Call:
    name: str | None = None
    arguments: list[str] = field(default_factory=list)  # the parameters' text, as written
    sent: int = 0  # pieces of arguments already handed out (all of them once the name is out)
    closed: bool = False


class RequiredCallStream:
    def __init__(self):
        self.depth = 0  # [ and { open outside strings
        self.in_string = self.escape = False
        self.calls: list[_Call] = []
        self.complete = False  # the list closed
        self._key: str | None = None  # the element's key whose value is being read
        self._text: list[str] = []  # the element-level string being read (a key or the name)
        self._reading: str | None = None  # "key", "name", "parameters" or None
        self._value_depth = 0  # depth at which the parameters value started

    def feed(self, text: str) -> list[tuple]:
        events: list[tuple] = []
        piece: list[str] = []  # parameters text of this feed, for the current call
        for char in text:
            if self._reading == "parameters":
                piece.append(char)
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif char == "\\":
                    self.escape = True
                elif char == '"':
                    self.in_string = False
                    if self._reading in ("key", "name"):
                        self._closed_string(events)
                        continue
                if self._reading in ("key", "name"):
                    self._text.append(char)
                continue
            if char == '"':
                self.in_string = True
                if self.depth == 2 and self._reading is None:  # an element's key, or its name's value
                    self._reading = "name" if self._key == "name" else "key"
                    self._text = ['"']
                continue
            if char in "[{":
                self.depth += 1
                if self.depth == 2 and char == "{":
                    self.calls.append(_Call())
                    self._key = None
                elif self.depth == 3 and self._key == "parameters" and self._reading is None:
                    self._reading, self._value_depth = "parameters", 3
                    piece = [char]
            elif char in "]}":
                self.depth -= 1
                if self._reading == "parameters" and self.depth < self._value_depth:
                    self._end_parameters(piece, events)
                    piece = []
                if self.depth == 1 and char == "}":
                    self.calls[-1].closed = True
                elif self.depth == 0 and char == "]":
                    self.complete = True
            elif char == ":" and self.depth == 2:
                pass
            elif char == "," and self.depth == 2:
                self._key = None
        if piece and self._reading == "parameters":
            self._add_arguments("".join(piece), events)
        return events

    def _closed_string(self, events: list) -> None:
        text = json.loads("".join(self._text) + '"')
        if self._reading == "key":
            self._key = text
        else:  # the name
            call = self.calls[-1]
            call.name = text
            events.append(("name", len(self.calls) - 1, text))
            if call.arguments:  # parameters written before the name: out right after it
                events.append(("arguments", len(self.calls) - 1, "".join(call.arguments)))
                call.sent = len(call.arguments)
            self._key = None
        self._reading = None

    def _end_parameters(self, piece: list[str], events: list) -> None:
        self._add_arguments("".join(piece), events)
        self._reading, self._key = None, None

    def _add_arguments(self, text: str, events: list) -> None:
        if not text:
            return
        call = self.calls[-1]
        call.arguments.append(text)
        if call.name is not None:
            events.append(("arguments", len(self.calls) - 1, text))
            call.sent = len(call.arguments)

    def whole_calls(self) -> list[tuple[str, str]]:
        """(name, arguments) of every call whose object closed."""
        return [(call.name, "".join(call.arguments)) for call in self.calls if call.closed and call.name is not None]
