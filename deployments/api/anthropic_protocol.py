"""Anthropic's Messages API request (`POST /v1/messages`) as the chat request it runs as.

What the `anthropic` SDK, LangChain's ChatAnthropic and agents built on them send (vLLM 0.26
serves it too): `system` apart from the turns, content as blocks (`text`, `tool_use`,
`tool_result`, `thinking`), tools with an `input_schema`, `tool_choice` as auto / any / tool /
none, `stop_sequences`, `thinking` on or off (its `budget_tokens` kept as vLLM's thinking_token_budget
where the served model thinks in tags), `output_config` (a JSON schema, an effort). The
turns become chat messages: a user turn's `tool_result` blocks become tool messages (before its
text), an assistant turn's `tool_use` blocks its tool calls and its `thinking` its reasoning.
`cache_control` marks are accepted and change nothing (the prefix cache finds repeated prefixes
by itself). Images, documents, server tools and MCP servers are refused, naming the block.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr

from ponytail import ConfigError

from .openai_requests import ChatCompletionRequest, TokenizeRequest
from .protocol import ModelInfo

# Fields mapped here; everything else a chat request takes (vLLM's sampling extras,
# chat_template_kwargs, structured_outputs, ...) passes through under its own name.
_MESSAGES_FIELDS = {"messages", "system", "stop_sequences", "tools", "tool_choice", "thinking", "output_config",
                    "metadata", "service_tier", "container", "mcp_servers", "context_management", "stream_options",
                    "chat_template_kwargs"}
_TOOL_TYPES = (None, "custom")  # a client tool; others (web_search_..., bash_..., ...) run on Anthropic's side


class MessagesChatRequest(ChatCompletionRequest):
    """The chat request a Messages request runs as; errors name the Messages API's fields."""

    _FIELDS = {"stop": "stop_sequences", "response_format": "output_config", "reasoning_effort": "output_config",
               "thinking_token_budget": "thinking.budget_tokens"}
    _thinking_budget: int | None = PrivateAttr(default=None)  # thinking.budget_tokens, kept for for_model

    def field_name(self, sampling_name: str) -> str:
        name = super().field_name(sampling_name)
        return self._FIELDS.get(name, name)

    def for_model(self, info: ModelInfo) -> MessagesChatRequest:
        """thinking.budget_tokens as the engine's thinking_token_budget where the served model thinks
        in tags (info.reasoning_format); a model that does not think keeps any budget as it is."""
        if self._thinking_budget is None or info.reasoning_format is None:
            return self
        return self.model_copy(update={"thinking_token_budget": self._thinking_budget})


class CountTokensRequest(BaseModel):
    """`POST /v1/messages/count_tokens`: the prompt part of a Messages request."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs with enable_thinking from `thinking` (unless they set it)."""
        thinking = _thinking(self.thinking)
        kwargs = dict(self.chat_template_kwargs or {})
        if thinking is not None:
            kwargs.setdefault("enable_thinking", thinking)
        return kwargs or None


class MessagesRequest(CountTokensRequest):
    """The fields of a Messages request this module reads (the rest pass through to chat)."""

    max_tokens: int  # required, as in Anthropic's API
    stop_sequences: list[str] | None = None
    stream: bool = False
    output_config: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None
    container: Any = None


def count_tokens_request(body: bytes) -> CountTokensRequest:
    """`/v1/messages/count_tokens`' body."""
    return CountTokensRequest.model_validate(messages_body(body))


def count_tokens_prompt(req: CountTokensRequest) -> TokenizeRequest:
    """The /tokenize request that renders a count_tokens request's prompt (its checks run after the
    model's, so an unknown model is a 404 whatever the messages are)."""
    return TokenizeRequest.model_validate({**chat_fields(req), "chat_template_kwargs": req.template_kwargs()})


def messages_body(body: bytes) -> dict[str, Any]:
    raw = json.loads(body) if body else None
    if not isinstance(raw, dict):
        raise ConfigError("body is not a JSON object; allowed: a Messages API request ({\"model\": ..., "
                          "\"max_tokens\": ..., \"messages\": [...]})")
    return raw


def chat_request(body: bytes) -> tuple[MessagesRequest, MessagesChatRequest]:
    """The Messages request in `body` and the chat request it runs as. ValidationError for bad
    types (the API names the field), ConfigError for what this server does not do."""
    raw = messages_body(body)
    req = MessagesRequest.model_validate(raw)
    if req.mcp_servers:
        raise ConfigError(f"mcp_servers={req.mcp_servers!r:.60} is not supported; allowed: none (this server "
                          "connects to no MCP servers; give their tools as tools)")
    if req.container is not None:
        raise ConfigError("container is not supported; allowed: none (this server runs no code)")
    if req.max_tokens < 1:
        raise ConfigError(f"max_tokens={req.max_tokens} is invalid; allowed: at least 1")
    chat = {key: value for key, value in raw.items() if key not in _MESSAGES_FIELDS}
    chat.update(chat_fields(req))
    if req.stop_sequences:
        chat["stop"] = req.stop_sequences
    chat["chat_template_kwargs"] = req.template_kwargs()
    budget = _thinking_budget(req.thinking, req.max_tokens)
    config = req.output_config or {}
    if config.get("effort") is not None:
        chat["reasoning_effort"] = config["effort"]
    if config.get("format") is not None:
        chat["response_format"] = _response_format(config["format"])
    if req.stream:  # message_start carries the prompt's tokens; message_delta the whole usage
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    chat_req = MessagesChatRequest.model_validate(chat)
    chat_req._thinking_budget = budget
    return req, chat_req


def chat_fields(req: CountTokensRequest) -> dict[str, Any]:
    """messages, tools and tool_choice of the chat request (also what count_tokens renders)."""
    fields: dict[str, Any] = {"messages": _messages(req)}
    if req.tools is not None:
        fields["tools"] = [_tool(i, tool) for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        fields.update(_tool_choice(req.tool_choice))
    return fields


def _messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _text(req.system, "system")
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        role, content = message.get("role"), message.get("content")
        where = f"messages[{i}]"
        if role not in ("user", "assistant"):
            raise ConfigError(f"{where}.role={role!r:.40} is invalid; allowed: user, assistant (the system "
                              "prompt goes in system)")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise ConfigError(f"{where}.content={content!r:.60} is invalid; allowed: a string or a list of "
                              "content blocks")
        elif role == "user":
            messages += _user_turn(content, f"{where}.content")
        else:
            messages.append(_assistant_turn(content, f"{where}.content"))
    return messages


def _user_turn(blocks: list, where: str) -> list[dict[str, Any]]:
    """A user turn's tool results (tool messages, first) and its text (a user message)."""
    results, texts = [], []
    for j, block in enumerate(blocks):
        kind = _kind(block, f"{where}[{j}]")
        if kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise ConfigError(f"{where}[{j}].tool_use_id={call_id!r:.60} is invalid; allowed: the id of "
                                  "the tool_use block it answers")
            output = block.get("content")
            text = output if isinstance(output, str) else _text(output or [], f"{where}[{j}].content")
            results.append({"role": "tool", "tool_call_id": call_id,
                            "content": f"Error: {text}" if block.get("is_error") else text})
        elif kind == "text":
            texts.append(_block_text(block, f"{where}[{j}]"))
        else:
            raise ConfigError(f"{where}[{j}].type={kind!r} is not supported in a user turn; allowed: text, "
                              "tool_result (this server reads text only)")
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])


def _assistant_turn(blocks: list, where: str) -> dict[str, Any]:
    texts, calls, thoughts = [], [], []
    for j, block in enumerate(blocks):
        kind = _kind(block, f"{where}[{j}]")
        if kind == "text":
            texts.append(_block_text(block, f"{where}[{j}]"))
        elif kind == "tool_use":
            name, call_id, arguments = block.get("name"), block.get("id"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(arguments, dict):
                raise ConfigError(f"{where}[{j}]={json.dumps(block)[:80]} is invalid; allowed: a tool_use block "
                                  "with an id, a name and an input object")
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(arguments)}})
        elif kind == "thinking":
            thoughts.append(str(block.get("thinking") or ""))
        elif kind != "redacted_thinking":  # Anthropic's encrypted thought: nothing a template can show
            raise ConfigError(f"{where}[{j}].type={kind!r} is not supported in an assistant turn; allowed: text, "
                              "tool_use, thinking")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning"] = "\n".join(thoughts)
    return message


def _kind(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise ConfigError(f"{where}={block!r:.60} is invalid; allowed: a content block (an object with a type)")
    return block["type"]


def _block_text(block: dict, where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise ConfigError(f"{where}.text={text!r:.60} is invalid; allowed: a string")
    return text


def _text(blocks: Any, where: str) -> str:
    """Text blocks (a system prompt, a tool result) as one text."""
    if not isinstance(blocks, list):
        raise ConfigError(f"{where}={blocks!r:.60} is invalid; allowed: a string or a list of text blocks")
    texts = []
    for j, block in enumerate(blocks):
        kind = _kind(block, f"{where}[{j}]")
        if kind != "text":
            raise ConfigError(f"{where}[{j}].type={kind!r} is not supported; allowed: text (this server reads "
                              "text only)")
        texts.append(_block_text(block, f"{where}[{j}]"))
    return "\n".join(texts)


def _tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    """A client tool (name, description, input_schema) as a chat function tool."""
    if tool.get("type") not in _TOOL_TYPES:
        raise ConfigError(f"tools[{i}].type={tool.get('type')!r:.40} is not supported; allowed: custom tools "
                          "(name, description, input_schema): this server runs no server tools")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise ConfigError(f"tools[{i}].input_schema={schema!r:.60} is invalid; allowed: a JSON schema object")
    function = {"name": tool.get("name"), "parameters": {"type": "object", **schema}}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    kind = choice.get("type")
    fields: dict[str, Any] = {}
    if choice.get("disable_parallel_tool_use"):
        fields["parallel_tool_calls"] = False
    if kind in ("auto", "none"):
        fields["tool_choice"] = kind
    elif kind == "any":
        fields["tool_choice"] = "required"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise ConfigError(f"tool_choice={json.dumps(choice)[:80]} is invalid; allowed: type auto, any, none, or "
                          "tool with a name")
    return fields


def _thinking(thinking: dict[str, Any] | None) -> bool | None:
    """enable_thinking for the chat template: on, off, or the template's default (adaptive). Its
    budget_tokens: _thinking_budget."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise ConfigError(f"thinking.type={kind!r:.40} is invalid; allowed: enabled, disabled, adaptive")
    return None if kind == "adaptive" else kind == "enabled"


def _thinking_budget(thinking: dict[str, Any] | None, max_tokens: int) -> int | None:
    """thinking.budget_tokens of `"type": "enabled"`: at most this many tokens of thought, which (as in
    Anthropic's API) must leave room in max_tokens for the answer. None without one."""
    if not thinking or thinking.get("type") != "enabled" or thinking.get("budget_tokens") is None:
        return None
    budget = thinking["budget_tokens"]
    if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget < max_tokens:
        raise ConfigError(f"thinking.budget_tokens={budget!r:.40} is invalid; allowed: an integer from 1 to "
                          f"max_tokens - 1 ({max_tokens - 1}), so that the answer has room after the thought")
    return budget


def _response_format(fmt: Any) -> dict[str, Any]:
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ConfigError(f"output_config.format={fmt!r:.60} is invalid; allowed: {{\"type\": \"json_schema\", "
                          "\"schema\": {...}}")
    return {"type": "json_schema", "json_schema": {"name": "response", "schema": fmt["schema"]}}
