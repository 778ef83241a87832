"""OpenAI's Responses API request (`POST /v1/responses`) as the chat request it runs as.

The Responses API (what the openai SDK's `client.responses.create`, the Agents SDK and
LangChain's `use_responses_api` send; vLLM serves it too) says the same as a chat request in
other words: `input` items instead of messages, `instructions` for the system turn, flat function
tools, `text.format` for response_format, `max_output_tokens`, `include` of the output text's
logprobs for chat's logprobs. This server keeps no responses:
`previous_response_id`, `conversation` and `background` are refused (send the whole
conversation as `input`), and `store` changes nothing.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ponytail import ConfigError

from .openai_requests import ChatCompletionRequest

# Fields of the Responses API mapped here; everything else a chat request takes (vLLM's sampling
# extras, chat_template_kwargs, ...) passes through under its own name.
_RESPONSES_FIELDS = {"input", "instructions", "tools", "tool_choice", "text", "reasoning", "max_output_tokens",
                     "store", "previous_response_id", "conversation", "background", "include", "metadata",
                     "truncation", "prompt", "stream_options", "top_logprobs", "max_tool_calls", "service_tier",
                     "prompt_cache_key", "safety_identifier", "user"}
_TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS = "message.output_text.logprobs"  # the `include` entry that returns the answer's token logprobs
_ROLES = ("user", "system", "developer", "assistant")


class ResponsesChatRequest(ChatCompletionRequest):
    """The chat request a Responses request runs as; errors name the Responses API's fields."""

    _FIELDS = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text",
               "reasoning_effort": "reasoning", "logprobs": "include"}

    def field_name(self, sampling_name: str) -> str:
        name = super().field_name(sampling_name)
        return self._FIELDS.get(name, name)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class _Text(_Strict):
    format: _TextFormat | None = None


class _Reasoning(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


class ResponsesRequest(_Strict):
    """The fields of a Responses request this module reads (the rest pass through to chat)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: _Text | None = None
    reasoning: _Reasoning | None = None
    max_output_tokens: int | None = None
    stream: bool = False
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    include: list[str] | None = None  # of what OpenAI can add, only "message.output_text.logprobs" changes the answer

    @property
    def include_logprobs(self) -> bool:
        return LOGPROBS in (self.include or ())


def chat_request(body: bytes) -> tuple[ResponsesRequest, ResponsesChatRequest]:
    """The Responses request in `body` and the chat request it runs as. ValidationError for bad
    types (the API names the field), ConfigError for what this server does not do."""
    raw = json.loads(body) if body else None
    if not isinstance(raw, dict):
        raise ConfigError("body is not a JSON object; allowed: a Responses API request ({\"model\": ..., "
                          "\"input\": ...})")
    req = ResponsesRequest.model_validate(raw)
    for name, why in (("previous_response_id", "this server keeps no responses"),
                      ("conversation", "this server keeps no conversations")):
        if getattr(req, name) is not None:
            raise ConfigError(f"{name}={getattr(req, name)!r:.60} is not supported: {why}; allowed: the whole "
                              "conversation as input")
    if req.background:
        raise ConfigError("background=true is not supported; allowed: false (the response comes on this "
                          "connection, streamed or whole)")
    for name in ("n", "best_of"):  # a response is one answer
        if raw.get(name) not in (None, 1):
            raise ConfigError(f"{name}={raw[name]!r:.20} is not supported on /v1/responses; allowed: 1 (a response "
                              "is one answer; chat completions takes n)")
    chat = {key: value for key, value in raw.items() if key not in _RESPONSES_FIELDS}
    chat["messages"] = _messages(req)
    if req.max_output_tokens is not None:
        chat["max_tokens"] = req.max_output_tokens
    if req.tools is not None:
        chat["tools"] = [_tool(i, tool) for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(req.tool_choice)
    if req.text is not None and req.text.format is not None:
        chat["response_format"] = _response_format(req.text.format)
    if req.reasoning is not None and req.reasoning.effort is not None:
        chat["reasoning_effort"] = req.reasoning.effort
    if req.stream:
        chat["stream_options"] = {"include_usage": True}  # response.completed carries the usage
    if req.include_logprobs:  # as OpenAI and vLLM: top_logprobs alone returns none
        chat["logprobs"], chat["top_logprobs"] = True, req.top_logprobs or 0
    return req, ResponsesChatRequest.model_validate(chat)


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    reasoning = None  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise ConfigError(f"input[{i}].role={role!r} is invalid; allowed: {', '.join(_ROLES)}")
            message = {"role": role, "content": _text(item.get("content"), f"input[{i}].content")}
            if role == "assistant" and reasoning is not None:
                message["reasoning"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i), "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":  # else: the calls of that answer
                last = {"role": "assistant", "content": None, "tool_calls": []}
                if reasoning is not None:
                    last["reasoning"], reasoning = reasoning, None
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i),
                             "content": output if isinstance(output, str) else _text(output, f"input[{i}].output")})
        elif kind == "reasoning":
            parts = (item.get("content") or []) + (item.get("summary") or [])
            reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict)) or None
        else:
            raise ConfigError(f"input[{i}].type={kind!r} is not supported; allowed: message, function_call, "
                              "function_call_output, reasoning")
    return messages


def _string(item: dict, key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"input[{i}].{key}={value!r:.60} is invalid; allowed: a non-empty string")
    return value


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ConfigError(f"{where}={content!r:.60} is invalid; allowed: a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise ConfigError(f"{where}[{j}].type={kind!r} is not supported; allowed: input_text, output_text "
                              "(this server reads text only)")
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)


def _tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool (flat) as a chat tool (nested under `function`)."""
    if tool.get("type") != "function":
        raise ConfigError(f"tools[{i}].type={tool.get('type')!r} is not supported; allowed: function (this "
                          "server runs no built-in tools)")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ConfigError(f"tool_choice={choice!r:.80} is not supported; allowed: auto, none, required or "
                              "{'type': 'function', 'name': ...}")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(fmt: _TextFormat) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}

