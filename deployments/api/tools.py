"""Structured outputs and forced tool calls for the chat API: response_format, tools, tool_choice.

`plan_structured(req, draft)` turns the request's fields into the engine's `structured_outputs`
(a JSON schema the sampler's grammar mask enforces, sampling/grammar.py) and, for tool calls, a
`ToolPlan`; `ToolCallFormat` turns the constrained JSON back into OpenAI's `tool_calls`, whole
or streamed as deltas.

- response_format json_object: any JSON object; json_schema: its schema (what the openai SDK's
  `chat.completions.parse` sends for a pydantic model).
- tool_choice {"type": "function", "function": {"name": N}}: the output is N's arguments,
  constrained by its `parameters` schema, streamed as argument deltas of one call.
- tool_choice "required": the output is a JSON list of {"name", "parameters"} objects, one per
  call (vLLM's format), at least one (exactly one when parallel_tool_calls is false); each call
  streams as it is written, its name, then its arguments in pieces (required_calls.py).
- tool_choice "auto" (OpenAI's default once tools are given): the model decides, unconstrained,
  and writes calls in its own format, which tool_parsers.py reads (Hermes `<tool_call>` blocks:
  Qwen2.5/3, Hermes and their fine-tunes; GLM-4.5-4.7's name and `<arg_key>` pairs in the same
  blocks; Llama 3.1-3.3's JSON calls; Mistral's `[TOOL_CALLS]`; vLLM's `--enable-auto-tool-choice
  --tool-call-parser hermes|glm45|llama3_json|mistral`, found here
  from the served chat template; pythonic calls where the operator sets that parser). Text around
  the calls is the content; with parallel_tool_calls false only the first call counts. A Hermes
  call streams its name, then its arguments as written (call_arguments.py). Refused
  where the template shows no format (SmolLM2's): nothing to parse.
  "none" generates text as usual.
All finish with finish_reason "tool_calls" when they called. A forced call that max_tokens cut short
finishes with "length", never as text: the whole answer holds the calls that were complete (none for
a named tool), no content. Errors are ConfigErrors starting "field=value", so the API answers 400
naming the field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
import string
import uuid
from dataclasses import dataclass

from pydantic import BaseModel

from ponytail import ConfigError

from .engine_requests import Draft, response_format_constraint
from .openai_requests import ChatCompletionRequest, FunctionCall, ToolCall, constraint_fields
from .openai_responses import ChatChoice, ChatDelta, ChatMessage, FunctionCallDelta, ToolCallDelta, Usage
from .required_calls import RequiredCallStream
from .tool_parsers import MISTRAL, call_stream, read
from .xml_tool_calls import typed_arguments

_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
_CHOICES = "'none', 'required' or {'type': 'function', 'function': {'name': <one of tools>}}"


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How the constrained JSON becomes tool calls."""

    name: str | None  # the forced function: the output is its arguments; None: a 'required' list or 'auto'
    format: str | None = None  # 'auto': the model's own format (tool_parsers.FORMATS), read from free text
    parallel: bool = True  # 'auto': every call the model writes, else the first only
    short_ids: bool = False  # call ids of 9 letters or digits, which Mistral's templates take back
    parameters: dict | None = None  # 'auto': each tool's parameters schema, which types XML calls' text values

    def arguments(self, call) -> str:
        """A parsed call's arguments as JSON text; XML calls' text values typed by the tool's schema."""
        if not call.text_values:
            return call.arguments
        schema = (self.parameters or {}).get(call.name)
        return json.dumps(typed_arguments(json.loads(call.arguments), schema))


def plan_structured(req: ChatCompletionRequest, draft: Draft, tool_format: str | None = None) -> ToolPlan | None:
    """Set the draft's structured_outputs (and the tools, for the template) from the request;
    returns the ToolPlan when the answer may be tool calls. tool_format: the format the served chat
    template writes calls in (ModelInfo.tool_call_format). ConfigError names the field."""
    tools = req.tools or []
    template_messages(draft.request.messages, bool(tools), tool_format)
    if tools:
        draft.request.tools = [tool.model_dump(exclude_none=True) for tool in tools]
    elif req.tool_choice is not None and req.tool_choice != "none":
        raise ConfigError(f"tool_choice={_show(req.tool_choice)} is invalid without tools; "
                          "allowed: give tools, or leave tool_choice out")
    plan, schema = _tool_schema(req, tools, tool_format)
    if plan is not None and tool_format == MISTRAL:
        plan = dataclasses.replace(plan, short_ids=True)
    if plan is not None and plan.format is not None and req.skip_special_tokens is None:
        draft.sampling["skip_special_tokens"] = False  # some tokenizers make the call tags special
    response = response_format_constraint(req.response_format)
    if plan is not None and response is not None:
        raise ConfigError(f"response_format={req.response_format.type!r} cannot be combined with "
                          f"tool_choice={_show(req.tool_choice)}; allowed: one of them")
    if (schema is not None or response is not None) and "structured_outputs" in draft.sampling:
        other = f"tool_choice={_show(req.tool_choice)}" if schema is not None else "response_format"
        name = constraint_fields(req)[0]
        raise ConfigError(f"{name}={getattr(req, name)!r:.60} cannot be combined with {other}; allowed: one "
                          "constraint per request")
    if schema is not None:
        draft.sampling["structured_outputs"] = {"json": schema}
    elif response is not None:
        draft.sampling["structured_outputs"] = response
    return plan


def _tool_schema(req: ChatCompletionRequest, tools: list,
                 tool_format: str | None) -> tuple[ToolPlan | None, dict | None]:
    choice = req.tool_choice
    if not tools or choice == "none":
        return None, None
    if choice is None or choice == "auto":
        if tool_format is not None:
            parameters = {tool.function.name: tool.function.parameters for tool in tools}
            return ToolPlan(name=None, format=tool_format, parallel=req.parallel_tool_calls is not False,
                            parameters=parameters), None
        given = "None (OpenAI's default 'auto' once tools are given)" if choice is None else "'auto'"
        raise ConfigError(f"tool_choice={given} is not supported: the served model's chat template has no "
                          "tool-call format to parse (read: Hermes <tool_call> blocks, GLM's <arg_key> calls, "
                          "Llama 3's JSON calls, Mistral's [TOOL_CALLS]; the server's tool_call_parser may name "
                          f"one, or pythonic) or the server reads none; allowed: {_CHOICES}")
    functions = {}
    for tool in tools:
        name = tool.function.name
        if name in functions:
            raise ConfigError(f"tools={name!r} is defined twice; allowed: distinct function names")
        functions[name] = tool.function.parameters or _NO_ARGUMENTS
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                   "parameters": parameters},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, parameters in functions.items()]
        schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan(name=None), schema
    name = choice.function.name
    if name not in functions:
        raise ConfigError(f"tool_choice={_show(choice)} names no tool; allowed: one of {sorted(functions)}")
    return ToolPlan(name=name), functions[name]


def template_messages(messages: list[dict] | None, tools_given: bool, tool_format: str | None) -> None:
    """Earlier tool calls in `messages` (to_dict()'s) as the chat template is handed them, in place:
    what a chat renders, and so what /tokenize and count_tokens count."""
    if tool_format is not None:  # earlier calls as the template writes them, with tools given or not
        _arguments_as_objects(messages)
        if tool_format == MISTRAL:
            _nine_character_ids(messages)
    elif tools_given:
        _describe_earlier_calls(messages)


def _describe_earlier_calls(messages: list[dict] | None) -> None:
    """An assistant message that only called tools gets those calls as its content (the JSON this
    server generates), so a template without a tool format still shows the model what it did."""
    for message in messages or []:
        if message.get("tool_calls") and not message.get("content"):
            message["content"] = json.dumps([{"name": c["function"]["name"],
                                              "parameters": _loads_or_text(c["function"]["arguments"])}
                                             for c in message["tool_calls"]])


def _arguments_as_objects(messages: list[dict] | None) -> None:
    """Earlier calls' arguments as objects, not JSON text: templates with a tool format write them
    with `tojson` (Qwen's), which would quote the text a second time."""
    for message in messages or []:
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            if isinstance(function.get("arguments"), str):
                function["arguments"] = _loads_or_text(function["arguments"])


def _loads_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def _show(choice) -> str:
    return repr(choice.model_dump() if isinstance(choice, BaseModel) else choice)


def _call_id(plan: ToolPlan) -> str:
    if plan.short_ids:  # Mistral's templates refuse any other id: 9 letters or digits
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


_ALPHANUMERIC = string.ascii_letters + string.digits


def _nine_character_ids(messages: list[dict] | None) -> None:
    """Earlier calls' ids as Mistral's templates take them (9 letters or digits, else the template
    raises): an id of another shape is replaced by a digest of it, the same in the assistant's call
    and in the tool message that answers it."""
    def short(call_id):
        if not isinstance(call_id, str) or (len(call_id) == 9 and call_id.isascii() and call_id.isalnum()):
            return call_id
        return hashlib.sha256(call_id.encode()).hexdigest()[:9]

    for message in messages or []:
        for call in message.get("tool_calls") or []:
            if isinstance(call, dict) and "id" in call:
                call["id"] = short(call["id"])
        if "tool_call_id" in message:
            message["tool_call_id"] = short(message["tool_call_id"])


def parse_calls(plan: ToolPlan, text: str) -> tuple[list[ToolCall], bool]:
    """The tool calls in a finished constrained output ('required' or a named tool), and whether the
    output was complete: cut short (max_tokens hit), only the calls that were whole come back."""
    if plan.name is not None:
        try:
            json.loads(text)
        except ValueError:
            return [], False
        return [ToolCall(id=_call_id(plan), function=FunctionCall(name=plan.name, arguments=text))], True
    stream = RequiredCallStream()
    stream.feed(text)
    return [ToolCall(id=_call_id(plan), function=FunctionCall(name=name, arguments=arguments))
            for name, arguments in stream.whole_calls()], stream.complete


class ToolCallFormat:
    """Chat responses whose answer is tool calls; same methods as formats.ChatFormat, whose
    chunks (id, created, model, system_fingerprint) it reuses; each choice (n > 1) has its own
    output and call id. start(), text() and finish() return lists of chunks."""

    def __init__(self, chat_format, plan: ToolPlan):
        self.common = chat_format.common
        self.chat_format = chat_format
        self.plan = plan
        self.pieces: dict[int, list[str]] = {}  # per choice: its output so far (constrained plans)
        self.call_ids: dict[int, str] = {}  # per choice: the id of its one call (plan.name)
        self.streams: dict[int, object] = {}  # per choice: its output, split (tool_parsers; 'required': required_calls)
        self.calls_sent: dict[int, int] = {}  # per choice under 'auto': calls streamed so far
        self.writing: dict[int, int | None] = {}  # per choice under 'auto': the call being streamed (None: skipped)

    def call_id(self, index: int) -> str:
        return self.call_ids.setdefault(index, _call_id(self.plan))

    def _chunk(self, index: int, delta: ChatDelta, finish_reason: str | None = None, items=None) -> BaseModel:
        return self.chat_format._delta(index, delta, finish_reason, items)

    def start(self, index: int) -> list[BaseModel]:
        chunks = self.chat_format.start(index)
        if self.plan.name is not None:  # one call: its name now, its arguments as they come
            chunks.append(self._chunk(index, ChatDelta(tool_calls=[ToolCallDelta(
                index=0, id=self.call_id(index), type="function",
                function=FunctionCallDelta(name=self.plan.name, arguments=""))])))
        return chunks

    def text(self, index: int, text: str, items=None) -> list[BaseModel]:
        if self.plan.format is not None:  # 'auto': content as it comes, each call once it is closed
            chunks = self._split(index, self._stream(index).feed(text), items)
            return chunks or ([self._chunk(index, ChatDelta(), items=items)] if items else [])
        self.pieces.setdefault(index, []).append(text)
        if self.plan.name is None:  # a list of calls: each one's name, then its arguments as they come
            chunks = [self._required_delta(index, event) for event in self._stream(index).feed(text)]
            return chunks or ([self._chunk(index, ChatDelta(), items=items)] if items else [])
        return [self._chunk(index, ChatDelta(tool_calls=[ToolCallDelta(index=0, function=FunctionCallDelta(
            arguments=text))]), items=items)]

    def _required_delta(self, index: int, event: tuple) -> BaseModel:
        kind, number, value = event
        if kind == "name":
            call = ToolCallDelta(index=number, id=_call_id(self.plan), type="function",
                                 function=FunctionCallDelta(name=value, arguments=""))
        else:
            call = ToolCallDelta(index=number, function=FunctionCallDelta(arguments=value))
        return self._chunk(index, ChatDelta(tool_calls=[call]))

    def _stream(self, index: int):
        if index not in self.streams:
            self.streams[index] = call_stream(self.plan.format) if self.plan.format else RequiredCallStream()
        return self.streams[index]

    def _split(self, index: int, events: list, items=None) -> list[BaseModel]:
        chunks = []
        for kind, value in events:
            if kind == "content":
                chunks.append(self._chunk(index, ChatDelta(content=value), items=items))
            elif kind == "call_name":  # a call being written: its name now, its arguments as they come
                number = self.writing[index] = self._next_call(index)
                if number is not None:
                    chunks.append(self._chunk(index, ChatDelta(tool_calls=[ToolCallDelta(
                        index=number, id=_call_id(self.plan), type="function",
                        function=FunctionCallDelta(name=value, arguments=""))]), items=items))
            elif kind == "call_arguments":
                if self.writing.get(index) is not None:
                    chunks.append(self._chunk(index, ChatDelta(tool_calls=[ToolCallDelta(
                        index=self.writing[index], function=FunctionCallDelta(arguments=value))]), items=items))
            elif kind == "call_done":
                self.writing.pop(index, None)
            elif (number := self._next_call(index)) is not None:  # a call read whole (XML, lists, other formats)
                chunks.append(self._chunk(index, ChatDelta(tool_calls=[ToolCallDelta(
                    index=number, id=_call_id(self.plan), type="function",
                    function=FunctionCallDelta(name=value.name, arguments=self.plan.arguments(value)))]), items=items))
            items = None  # a piece's logprobs go out once, with its first chunk
        return chunks

    def _next_call(self, index: int) -> int | None:
        """The index of the choice's next call, or None where only its first call counts."""
        if not self.plan.parallel and self.calls_sent.get(index):
            return None
        self.calls_sent[index] = self.calls_sent.get(index, 0) + 1
        return self.calls_sent[index] - 1

    def finish(self, index: int, finish_reason: str | None) -> list[BaseModel]:
        if self.plan.format is not None:
            stream = self._stream(index)
            chunks = self._split(index, stream.finish())
            return chunks + [self._chunk(index, ChatDelta(), _auto_finish(
                self.calls_sent.get(index, 0) > 0, getattr(stream, "cut_call", False), finish_reason))]
        text = "".join(self.pieces.get(index, []))
        complete = parse_calls(self.plan, text)[1]
        return [self._chunk(index, ChatDelta(), "tool_calls" if complete else finish_reason)]

    def usage(self, usage: Usage) -> BaseModel:
        return self.chat_format.usage(usage)

    def choice(self, index: int, text: str, finish_reason: str | None, items=None) -> ChatChoice:
        choice = self.chat_format.choice(index, text, finish_reason, items)
        if self.plan.format is not None:  # 'auto': calls and the text around them, read once
            content, parsed, cut = read(self.plan.format, text)
            calls = [ToolCall(id=_call_id(self.plan),
                              function=FunctionCall(name=c.name, arguments=self.plan.arguments(c)))
                     for c in (parsed if self.plan.parallel else parsed[:1])] or None
        else:  # forced: never text; cut short, the calls that were whole and the finish that says why
            calls, complete = parse_calls(self.plan, text)
            if self.plan.name is not None and calls:
                calls[0].id = self.call_id(index)
            message = choice.message.model_copy(update={"content": None, "tool_calls": calls or None})
            return choice.model_copy(update={"message": message,
                                             "finish_reason": "tool_calls" if complete else finish_reason})
        if calls is None:
            return choice
        return choice.model_copy(update={"message": ChatMessage(content=content, tool_calls=calls),
                                         "finish_reason": _auto_finish(True, cut, finish_reason)})

    def full(self, choices: list, usage: Usage) -> BaseModel:
        return self.chat_format.full(choices, usage)


def _auto_finish(called: bool, cut_call: bool, finish_reason: str | None) -> str | None:
    """An 'auto' choice's finish: "tool_calls" when it called, unless max_tokens cut its last call's
    arguments short ("length": they are as far as they were written)."""
    if cut_call and finish_reason == "length":
        return "length"
    return "tool_calls" if called else finish_reason
