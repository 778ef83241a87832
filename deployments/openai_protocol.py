"""The OpenAI API's request and response bodies (pydantic v2), and their mapping to GenerateRequest.

Requests are parsed strictly (`"ten"` or `true` is no integer) and unknown fields are ignored, as
OpenAI does. Type errors surface as pydantic errors whose location names the field; the ingress
turns them into 400s. Sampling *values* are checked later by `ponytail.SamplingParams`, so the
messages read the same as in the Python API.

Defaults: completions generate at most 16 tokens (OpenAI's default), chat at most
CHAT_DEFAULT_MAX_TOKENS = 256. OpenAI lets chat run to the end of the context instead, but the
ingress does not know the prompt's token count (the replica applies the chat template), and the
engine reserves room for prompt + max_tokens up front: a fixed default keeps a request without
max_tokens from claiming a whole context's worth of KV blocks. The price: a chat prompt within 256
tokens of max_model_len must set max_tokens, or the engine refuses it (400).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

from .protocol import GenerateRequest

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 256  # see the module docstring

# Request fields passed to ponytail.SamplingParams under the same name: OpenAI's, then vLLM's extras.
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed",
                   "stop", "n", "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids",
                   "ignore_eos", "include_stop_str_in_output", "skip_special_tokens")


def new_request_id(prefix: str) -> str:
    """OpenAI-style ids: `cmpl-<hex>` for completions, `chatcmpl-<hex>` for chat."""
    return f"{prefix}-{uuid.uuid4().hex}"


# ------------------------------------------------------------------------------ field checks
def _one_error(message: str, check=None):
    """Replace pydantic's per-union-member errors with one message; `check` may raise first."""
    def validate(value, handler):
        if check is not None:
            check(value)
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("type_error", message) from None
    return WrapValidator(validate)


def _not_batch(value: object) -> None:
    if isinstance(value, list) and any(isinstance(item, (str, list)) for item in value):
        raise PydanticCustomError("not_supported", "a list of prompts (batch) is not supported yet; "
                                  "send one request per prompt")


def _unsupported(ok, what: str):
    """Accept the field only with values that change nothing (the engine cannot honour others yet)."""
    def validate(value):
        if value is not None and not ok(value):
            raise PydanticCustomError("not_supported", f"{what} is not supported yet")
        return value
    return AfterValidator(validate)


Prompt = Annotated[str | list[int], _one_error("must be a string or a list of token ids (integers)", _not_batch)]
Stop = Annotated[str | list[str] | None, _one_error("must be a string or a list of strings")]
Unsupported = Any  # fields declared only to refuse values the engine cannot honour


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False  # one more chunk, before [DONE], with usage and no choices


class _SamplingRequest(_Request):
    """The fields both endpoints share; None means "not given": SamplingParams' default applies."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: Stop = None
    n: int | None = None  # only 1 (SamplingParams says so)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras, same names and meanings
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    logit_bias: Annotated[Unsupported, _unsupported(lambda v: v == {}, "logit_bias")] = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    logprobs: Annotated[Unsupported, _unsupported(lambda v: False, "logprobs")] = None
    echo: Annotated[Unsupported, _unsupported(lambda v: v is False, "echo=true")] = None
    best_of: Annotated[Unsupported, _unsupported(lambda v: v == 1, "best_of > 1")] = None
    suffix: Annotated[Unsupported, _unsupported(lambda v: v == "", "suffix")] = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageParam(_Request):
    role: str  # system, developer, user, assistant, tool: the chat template decides what it accepts
    content: Annotated[str | list[TextPart] | None, _one_error(
        "must be a string or a list of text parts (type 'text'); images and audio are not supported")] = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a role "tool" message: the call it answers
    name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.tool_calls:  # templates with a tool format read these; deployments/tools.py fills content
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class JSONSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDefinition(_Request):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ToolParam(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Annotated[Literal["none", "auto", "required"] | NamedToolChoice, _one_error(
    "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")]


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessageParam], Field(min_length=1)]
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: Annotated[Unsupported, _unsupported(lambda v: v is False, "logprobs=true")] = None
    top_logprobs: Annotated[Unsupported, _unsupported(lambda v: False, "top_logprobs")] = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None  # None: 'auto' when tools are given (refused: deployments/tools.py)
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # vLLM's own structured-output fields: refused rather than ignored (use response_format / tools)
    guided_json: Annotated[Unsupported, _unsupported(lambda v: False, "guided_json (use response_format)")] = None
    guided_regex: Annotated[Unsupported, _unsupported(lambda v: False, "guided_regex")] = None
    guided_choice: Annotated[Unsupported, _unsupported(lambda v: False, "guided_choice")] = None
    guided_grammar: Annotated[Unsupported, _unsupported(lambda v: False, "guided_grammar")] = None
    guided_decoding_backend: Annotated[Unsupported, _unsupported(lambda v: False, "guided_decoding_backend")] = None
    structured_outputs: Annotated[Unsupported, _unsupported(
        lambda v: False, "structured_outputs (use response_format or tools)")] = None

    def field_name(self, sampling_name: str) -> str:
        """The request field a SamplingParams field came from (for error messages)."""
        if sampling_name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        if sampling_name == "structured_outputs":  # set by deployments/tools.py from one of these
            forced = self.tools and self.tool_choice not in (None, "none", "auto")
            return "tools" if forced else "response_format"
        return sampling_name


def to_generate_request(req: CompletionRequest | ChatCompletionRequest,
                        request_id: str | None = None) -> GenerateRequest:
    """The engine request for an OpenAI request; `sampling` holds ponytail.SamplingParams fields."""
    sampling = {name: value for name in SAMPLING_FIELDS if (value := getattr(req, name)) is not None}
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        sampling["max_tokens"] = CHAT_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
        return GenerateRequest(messages=[m.to_dict() for m in req.messages], sampling=sampling,
                               request_id=request_id or new_request_id("chatcmpl"))
    sampling.setdefault("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
    return GenerateRequest(prompt=req.prompt, sampling=sampling, request_id=request_id or new_request_id("cmpl"))


# ------------------------------------------------------------------------------ responses
def _omit_if_none(**kwargs):
    return Field(default=None, exclude_if=lambda value: value is None, **kwargs)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None  # stop, length (abort when the engine gave up on it)


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = _omit_if_none()


class CompletionChunk(Completion):
    """A streamed piece: OpenAI sends the same object as the full response, usage only at the end."""


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = _omit_if_none()


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = _omit_if_none()  # only in a call's first delta
    arguments: str | None = _omit_if_none()  # the next piece of the JSON text


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = _omit_if_none()  # only in a call's first delta
    type: Literal["function"] | None = _omit_if_none()
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = _omit_if_none()  # only in the first chunk
    content: str | None = _omit_if_none()
    tool_calls: list[ToolCallDelta] | None = _omit_if_none()


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = _omit_if_none()


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ponytail"
    max_model_len: int | None = None  # vLLM's extra


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class ErrorInfo(BaseModel):
    message: str
    type: str  # invalid_request_error, server_error, service_unavailable_error
    param: str | None = None  # the request field at fault, when known
    code: str | None = None  # e.g. model_not_found


class ErrorResponse(BaseModel):
    error: ErrorInfo
