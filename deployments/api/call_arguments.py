"""A tool call's arguments streamed while the model writes them, as OpenAI and vLLM stream them.

A Hermes `<tool_call>` block whose body opens as one call object, `{"name": "<name>", "arguments":
{` (or "parameters"), is a call from there on: its name goes out at once, then the arguments object
as written, a piece per piece of output, up to the brace that closes it (a scan of JSON strings and
nesting, never a parse per token). What follows the arguments in the block is not looked at. A body
of another shape (a list of calls, XML, a name with escapes) is left to the whole-block reader.
"""

from __future__ import annotations

import re

# The opening of one call object, up to the brace that opens its arguments.
_OPENING = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.\-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*\{')
_UNDECIDED_CHARS = 256  # a body that has not opened as a call by then is read whole


class StreamedArguments:
    """One block's body, fed as it comes: ("call_name", name) once it opens as a call, then
    ("call_arguments", text) pieces of the arguments object."""

    def __init__(self):
        self._opening = ""  # the body so far, until it opened as a call or cannot
        self.name: str | None = None  # the call's, once it opened as one
        self.arguments: list[str] = []  # the arguments object's text so far
        self._decided = False
        self._depth = 0  # braces and brackets open in the arguments (0: closed, once opened)
        self._in_string = False
        self._escaped = False

    @property
    def closed(self) -> bool:
        """Whether the arguments object was written to its closing brace."""
        return self.name is not None and self._depth == 0

    @property
    def text(self) -> str:
        return "".join(self.arguments)

    def feed(self, text: str) -> list[tuple[str, str]]:
        if self._decided:
            return self._value(text) if self.name is not None else []
        self._opening += text
        opened = _OPENING.match(self._opening)
        if opened is None:
            start = self._opening.lstrip()
            if (start and not start.startswith("{")) or len(self._opening) > _UNDECIDED_CHARS:
                self._decided = True  # not one call object: the block is read whole
            return []
        self._decided, self.name = True, opened.group(1)
        rest = self._opening[opened.end() - 1:]  # from the arguments' opening brace
        self._opening = ""
        return [("call_name", self.name), *self._value(rest)]

    def _value(self, text: str) -> list[tuple[str, str]]:
        if self.closed and self.arguments:
            return []
        end = len(text)
        for at, char in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = at + 1
                    break
        piece = text[:end]
        if not piece:
            return []
        self.arguments.append(piece)
        return [("call_arguments", piece)]
