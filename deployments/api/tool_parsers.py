"""Tool calls a model writes in its own format, for tool_choice "auto": found in its output, whole or streamed.

With "auto" nothing constrains the output: the calls are whatever the chat template taught the
model to write. `tool_call_format` finds the format from the served template; one stream class a
format splits an output into content and calls as it comes: hermes (`<tool_call>` blocks of JSON,
or of Qwen3-Coder's XML: xml_tool_calls.py), glm45 (the same blocks with `<arg_key>` pairs),
llama3_json (`{"name", "parameters"}` objects after `<|python_tag|>`), mistral (`[TOOL_CALLS]`
then a JSON list or `name[ARGS]{...}`), pythonic (`[f(a=1)]`, read with `ast`, never run; only
where the operator sets it). docs/serving.md ("Structured outputs and tool calls") has each
format's rules. Each format's `parse` reads a finished output with its stream class, so a stream
and the whole answer agree wherever the deltas are cut.
"""

from __future__ import annotations

import ast
import json

from .call_arguments import StreamedArguments
from .call_bodies import FUNCTION_NAME, ParsedCall, block_calls, call_items, json_calls, text_valued
from .xml_tool_calls import ARG_KEY, glm_calls

HERMES, LLAMA3_JSON, MISTRAL, PYTHONIC, GLM45 = "hermes", "llama3_json", "mistral", "pythonic", "glm45"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"  # Llama 4's, around pythonic calls
TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"  # Mistral's control tokens


# What an operator may set as tool_call_parser (vLLM's --tool-call-parser): "auto" finds the format
# from the served template, "none" reads no calls (tool_choice "auto" refused), a format forces it.
# qwen3_coder (vLLM's name for Qwen3-Coder's XML calls) is hermes here: one reader takes both bodies.
QWEN3_CODER = "qwen3_coder"
GLM47 = "glm47"  # vLLM's name for GLM-4.7's parser: the same calls as GLM-4.5's here
TOOL_CALL_PARSERS = ("auto", HERMES, QWEN3_CODER, LLAMA3_JSON, MISTRAL, PYTHONIC, GLM45, GLM47, "none")


def served_tool_call_format(parser: str, chat_template) -> str | None:
    """The format tool_choice "auto" reads under the operator's `parser` (TOOL_CALL_PARSERS)."""
    if parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser={parser!r} is not supported; allowed: {', '.join(TOOL_CALL_PARSERS)}")
    if parser == "auto":
        return tool_call_format(chat_template)
    if parser == QWEN3_CODER:
        return HERMES
    if parser == GLM47:
        return GLM45
    return None if parser == "none" else parser


def tool_call_format(chat_template) -> str | None:
    """The tool-call format a chat template writes (HERMES, LLAMA3_JSON, MISTRAL), or None where it
    shows none. `chat_template` is the tokenizer's: a string, a dict of named templates, or None."""
    templates = [t for t in (chat_template.values() if isinstance(chat_template, dict) else [chat_template])
                 if isinstance(t, str)]
    if any(ARG_KEY in t for t in templates):  # GLM's calls, in <tool_call> blocks too
        return GLM45
    if any(OPEN in t for t in templates):
        return HERMES
    if any(PYTHON_TAG in t for t in templates):
        return LLAMA3_JSON
    if any(TOOL_CALLS in t for t in templates):
        return MISTRAL
    return None


class HermesCallStream:
    """Feeds of one choice's output -> ("content", text) and ("call", ParsedCall) events, in order.

    A block that opens as one call object streams it as it is written (call_arguments.py):
    ("call_name", name), ("call_arguments", text) pieces, then ("call_done", ParsedCall) with the
    arguments as written, however the block ends (`cut_call`: their object never closed). A block
    whose body is not a call (the model wrote the tag and then no JSON) stays in the content as
    written, tags included. Trailing whitespace waits for more text: it goes out with
    the next text, or at the end when no call was made; before and between calls (newlines) it is
    not content. Where the pieces are cut changes nothing."""

    def __init__(self):
        self._held = ""  # content not sent yet: a possible start of OPEN
        self._blank = ""  # content not sent yet: trailing whitespace
        self._body: list[str] | None = None  # inside a block: its body so far
        self._tail = ""  # the body's last len(CLOSE) - 1 characters: where a CLOSE cut in pieces starts
        self._called_any = False  # a call went out: trailing whitespace is not content
        self._streamed = StreamedArguments()  # the open block's call, as it is written
        self.cut_call = False  # the output ended inside a call's arguments

    def feed(self, text: str) -> list[tuple[str, object]]:
        events: list[tuple[str, object]] = []
        text = self._held + text
        self._held = ""
        while text:
            if self._body is not None:
                # Look for CLOSE only where it may be: in this piece and the few characters before it
                # (joining the whole body each feed would cost its length every token).
                tail = self._tail
                end = (tail + text).find(CLOSE)
                if end < 0:
                    self._body.append(text)
                    self._tail = (tail + text)[-(len(CLOSE) - 1):]
                    events += self._streamed.feed(text)
                    return events
                joined = "".join(self._body) + text
                end += len(joined) - len(text) - len(tail)
                events += self._streamed.feed(joined[len(joined) - len(text):end])
                self._close(joined[:end], events)
                text = joined[end + len(CLOSE):]
                continue
            start = text.find(OPEN)
            if start >= 0:
                self._content(events, text[:start])
                self._body, self._tail, self._streamed = [], "", StreamedArguments()
                text = text[start + len(OPEN):]
                continue
            keep = partial_tag(text)
            self._content(events, text[:len(text) - keep])
            self._held = text[len(text) - keep:]
            break
        return events

    def finish(self) -> list[tuple[str, object]]:
        """The end of the output: held text, and an unclosed block (a call if its body parses)."""
        events: list[tuple[str, object]] = []
        if self._body is not None:
            body, self._body = "".join(self._body), None
            calls = self.block_calls(body)
            if self._streamed.name is not None:
                self.cut_call = not self._streamed.closed
                self._streamed_call(events)
            elif calls is not None:
                self._called(events, calls)
            else:
                self._content(events, OPEN + body)
        self._content(events, self._held)
        if self._blank and not self._called_any:
            events.append(("content", self._blank))
        self._held = self._blank = ""
        return events

    block_calls = staticmethod(block_calls)  # a block's body -> its calls, or None: not a call

    def _close(self, body: str, events: list) -> None:
        self._body = None
        if self._streamed.name is not None:  # already going out as a call
            self._streamed_call(events)
            return
        calls = self.block_calls(body)
        if calls is None:
            self._content(events, OPEN + body + CLOSE)
        else:
            self._called(events, calls)

    def _streamed_call(self, events: list) -> None:
        self._called_any = True
        events.append(("call_done", ParsedCall(self._streamed.name, self._streamed.text)))

    def _called(self, events: list, calls: list[ParsedCall]) -> None:
        self._called_any = True
        events.extend(("call", call) for call in calls)

    def _content(self, events: list, text: str) -> None:
        text = self._blank + text
        kept = text.rstrip()
        if kept:
            events.append(("content", kept))
        self._blank = text[len(kept):]


class WholeAnswerCallStream:
    """Feeds of one choice's output -> ("content", text) and ("call", ParsedCall) events, for formats
    where an answer that is calls is only calls: an output that opens with one of `opens` (or a
    start of `tag`) is held to its end and is calls if `calls(held)` reads it all; any other
    output streams as text."""

    opens: tuple[str, ...] = ()
    tag = ""

    def __init__(self):
        self._held = ""  # the output so far, while it may be calls
        self._text = False  # it is text: pieces go out as they come

    def feed(self, text: str) -> list[tuple[str, object]]:
        if self._text:
            return [("content", text)] if text else []
        self._held += text
        start = self._held.lstrip()
        if not start or start.startswith(self.opens) or self.tag.startswith(start):
            return []  # calls, or still undecided
        self._text = True
        held, self._held = self._held, ""
        return [("content", held)]

    def finish(self) -> list[tuple[str, object]]:
        held, self._held = self._held, ""
        calls = None if self._text else self.calls(held)
        if calls:
            return [("call", call) for call in calls]
        return [("content", held)] if held else []

    @staticmethod
    def calls(text: str) -> list[ParsedCall] | None:
        raise NotImplementedError


class Llama3JsonCallStream(WholeAnswerCallStream):
    """Llama 3.1-3.3: `{...}; {...}` after an optional PYTHON_TAG."""

    opens, tag = ("{", PYTHON_TAG), PYTHON_TAG

    @staticmethod
    def calls(text: str) -> list[ParsedCall] | None:
        return json_calls(text.strip().removeprefix(PYTHON_TAG).lstrip())


class MistralCallStream:
    """Feeds of one choice's output -> ("content", text) and ("call", ParsedCall) events, in order:
    text before the first TOOL_CALLS streams as content (less a tail that may start the tag, and
    trailing whitespace, which waits for more text); from the tag on the output is held to its
    end and is calls if it all parses (`mistral_calls`), else content as written."""

    def __init__(self):
        self._held = ""  # content not sent yet: a possible start of TOOL_CALLS, or trailing whitespace
        self._calls: str | None = None  # from the first TOOL_CALLS on: the output so far

    def feed(self, text: str) -> list[tuple[str, object]]:
        if self._calls is not None:
            self._calls += text
            return []
        text = self._held + text
        start = text.find(TOOL_CALLS)
        if start >= 0:  # the whitespace before the tag is content only if no calls follow
            before = text[:start].rstrip()
            self._held, self._calls = text[len(before):start], text[start:]
            return self._content(before)
        sent = text[:len(text) - partial_tag(text, TOOL_CALLS)].rstrip()  # a tag's start, and blanks before
        self._held = text[len(sent):]
        return self._content(sent)

    def finish(self) -> list[tuple[str, object]]:
        held, self._held = self._held, ""
        if self._calls is None:
            return self._content(held)
        text, self._calls = self._calls, None
        calls = mistral_calls(text)
        return [("call", call) for call in calls] if calls else self._content(held + text)

    @staticmethod
    def _content(text: str) -> list[tuple[str, object]]:
        return [("content", text)] if text else []


def mistral_calls(text: str) -> list[ParsedCall] | None:
    """Calls after Mistral's TOOL_CALLS tags, as its tokenizers write them: before v11 one JSON list
    (or object) of {"name", "arguments"}; from v11 one `name[ARGS]{...}` (or `name{...}`, an optional
    `[CALL_ID]id` after the name) per tag. None unless every part parses."""
    calls: list[ParsedCall] = []
    for part in text.split(TOOL_CALLS)[1:]:
        part = part.strip()
        if part.startswith(("[", "{")):
            found = json_calls(part)
        else:
            name, _, arguments = part.partition("{")
            name = name.replace(ARGS, "").split(CALL_ID)[0].strip()
            found = None
            if FUNCTION_NAME.fullmatch(name) and arguments:
                try:
                    value = json.loads("{" + arguments)
                except ValueError:
                    value = None
                found = call_items([{"name": name, "arguments": value}]) if isinstance(value, dict) else None
        if found is None:
            return None
        calls += found
    return calls or None


class PythonicCallStream(WholeAnswerCallStream):
    """One Python list of calls (`pythonic_calls`), maybe after Llama 4's PYTHON_START."""

    opens, tag = ("[", PYTHON_START), PYTHON_START

    @staticmethod
    def calls(text: str) -> list[ParsedCall] | None:
        return pythonic_calls(text)


def pythonic_calls(text: str) -> list[ParsedCall] | None:
    """`[get_weather(city="Paris"), get_time()]` as calls (vLLM's pythonic format: Llama 3.2 and 4
    with their tool prompts, ToolACE), read with `ast`, never run; None unless it is all that:
    one list of calls by name with keyword arguments whose values are literals."""
    text = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and all(k.arg is not None for k in node.keywords) and FUNCTION_NAME.fullmatch(node.func.id)):
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            calls.append(ParsedCall(node.func.id, json.dumps(arguments, allow_nan=False)))
        except (ValueError, TypeError, SyntaxError, RecursionError):  # not a literal, or not JSON (a set, bytes)
            return None
    return calls


def _glm_calls(body: str) -> list[ParsedCall] | None:
    """A block's calls as Hermes reads them, else GLM-4.5's one call."""
    calls = block_calls(body)
    if calls is not None:
        return calls
    found = glm_calls(body)
    return None if found is None else text_valued(found)


class GlmCallStream(HermesCallStream):
    """GLM-4.5/4.6/4.7 (the template has `<arg_key>`): Hermes' `<tool_call>` blocks, each holding
    a name and `<arg_key>`/`<arg_value>` pairs (xml_tool_calls.glm_calls)."""

    block_calls = staticmethod(_glm_calls)


STREAMS = {HERMES: HermesCallStream, LLAMA3_JSON: Llama3JsonCallStream, MISTRAL: MistralCallStream,
           PYTHONIC: PythonicCallStream, GLM45: GlmCallStream}
FORMATS = tuple(STREAMS)


def call_stream(fmt: str):
    """A new stream splitter for one choice's output in format `fmt` (one of FORMATS)."""
    return STREAMS[fmt]()


def read(fmt: str, text: str) -> tuple[str | None, list[ParsedCall], bool]:
    """(content, calls, whether the output ended inside a call's arguments) of a finished output, as
    the stream splits it; content None when empty."""
    stream = call_stream(fmt)
    events = stream.feed(text) + stream.finish()
    content = "".join(value for kind, value in events if kind == "content")
    calls = [value for kind, value in events if kind in ("call", "call_done")]
    return (content or None), calls, getattr(stream, "cut_call", False)


def parse(fmt: str, text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a finished output, as the stream splits it; content None when empty."""
    return read(fmt, text)[:2]


def partial_tag(text: str, tag: str = OPEN) -> int:
    """Length of the longest tail of `text` that `tag` starts with (held back, it may be a tag)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
