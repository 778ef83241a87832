"""The OpenAI API's request bodies (pydantic v2), as this server takes them.

Requests are parsed strictly (`"ten"` or `true` is no integer) and unknown fields are ignored, as
OpenAI does. Type errors surface as pydantic errors whose location names the field; the API turns
them into 400s. Sampling *values* are checked once, by `ponytail.SamplingParams`
(engine_requests.py), so the messages read the same as in the Python API.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, WrapValidator,
                      field_validator)
from pydantic_core import PydanticCustomError

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


def _unsupported(ok, what: str):
    """Accept the field only with values that change nothing (the engine cannot honour others yet)."""
    def validate(value):
        if value is not None and not ok(value):
            raise PydanticCustomError("not_supported", f"{what} is not supported yet")
        return value
    return AfterValidator(validate)


def _not_zero(value: int) -> int:
    if value == 0:
        raise PydanticCustomError("value_error", "must be a positive number of tokens to keep, or -1 (what fits)")
    return value


Prompt = Annotated[str | list[int] | list[str] | list[list[int]], _one_error(
    "must be a string, a list of token ids (integers), or a list of strings or of token-id lists")]
Stop = Annotated[str | list[str] | None, _one_error("must be a string or a list of strings")]
Unsupported = Any  # fields declared only to refuse values the engine cannot honour


class StrictModel(BaseModel):
    """A request body: strict types, unknown fields ignored (as OpenAI's API)."""

    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(StrictModel):
    include_usage: bool = False  # one more chunk, before [DONE], with usage and no choices
    continuous_usage_stats: bool = False  # with include_usage: every chunk carries its choice's usage so far (vLLM's)


class SamplingRequest(StrictModel):
    """The fields both endpoints share; None means "not given": SamplingParams' default applies."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    # OpenAI's ranges (SamplingParams alone would take any temperature >= 0)
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    seed: int | None = None
    stop: Stop = None
    n: int | None = None  # choices per prompt: samples of one prefill (the engine forks the prompt's KV)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Sample best_of, return the n of highest cumulative logprob (OpenAI's completions field; vLLM
    # takes it on chat too). Not with stream=true: which choices win is known only at the end.
    best_of: int | None = None
    # vLLM's extras, same names and meanings
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias in [-100, 100]
    # vLLM's constraint: exactly one of json, regex, choice, grammar, json_object (ponytail.StructuredOutputsParams)
    structured_outputs: dict[str, Any] | None = None
    # vLLM < 0.12's names for the same, still sent by older clients
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Annotated[Unsupported, _unsupported(
        lambda v: v in ("auto", "xgrammar"), "guided_decoding_backend other than auto or xgrammar")] = None
    # vLLM's: logprobs name tokens "token_id:<id>" (tokens whose text alone is not valid UTF-8 stay apart)
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: the answer carries the prompt's and each choice's token ids (streamed: each chunk its new ones)
    return_token_ids: bool | None = None
    return_prompt_text: Annotated[Unsupported, _unsupported(lambda v: v is False, "return_prompt_text")] = None
    return_token_offsets: Annotated[Unsupported, _unsupported(lambda v: v is False, "return_token_offsets")] = None
    repetition_detection: Annotated[Unsupported, _unsupported(lambda v: False, "repetition_detection")] = None
    # vLLM's plug-in and disaggregation hooks (custom logits processors' arguments, KV/encoder transfer):
    # this server has none of those, so a request that counts on them is refused rather than run without
    vllm_xargs: Annotated[Unsupported, _unsupported(lambda v: not v, "vllm_xargs")] = None
    kv_transfer_params: Annotated[Unsupported, _unsupported(lambda v: not v, "kv_transfer_params")] = None
    ec_transfer_params: Annotated[Unsupported, _unsupported(lambda v: not v, "ec_transfer_params")] = None
    # vLLM's: a reasoning model thinks at most this many tokens, then </think> is written for it (-1: no limit)
    thinking_token_budget: int | None = None
    # vLLM's: only requests with the same salt share cached prompt prefixes (tenants apart)
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    # vLLM's: each prompt token's logprob, rank and this many most likely ones, beside the answer
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: the only tokens the output may take
    bad_words: list[str] | None = None  # vLLM's: words the output may not contain
    # keep only the prompt's last this many tokens (-1: as many as the context allows; vLLM's)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1), AfterValidator(_not_zero)] | None = None
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: "right" keeps the first tokens instead
    # vLLM's extras the engine cannot honour yet: refused with their values rather than ignored
    # vLLM's beam search: the n best of n beams (ponytail.LLM.beam_search), ranked by length_penalty
    use_beam_search: bool | None = None
    length_penalty: Annotated[float, Field(allow_inf_nan=False)] | None = None
    priority: int = 0  # vLLM's: lower runs first, where the server's scheduling_policy is "priority"
    # vLLM's: these tokens' logprobs at every position instead of the top ones (label scoring); needs logprobs
    logprob_token_ids: list[int] | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream", False):
            raise PydanticCustomError("not_supported", "stream_options is only allowed with stream=true")
        return value

    @field_validator("best_of")
    @classmethod
    def _not_streamed(cls, value, info: ValidationInfo):
        if value is not None and value > 1 and info.data.get("stream", False):
            raise PydanticCustomError("not_supported", "best_of > 1 is not allowed with stream=true (the best "
                                      "choices are known only once all are done)")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    logprobs: int | None = None  # logprobs of each token and of this many most likely ones (0-20)
    echo: bool | None = None  # the prompt comes first in the text (with its logprobs, if logprobs is set)
    response_format: ResponseFormat | None = None  # as in chat (vLLM takes it here too)
    suffix: Annotated[Unsupported, _unsupported(lambda v: v == "", "suffix")] = None
    add_special_tokens: bool = True  # vLLM's: false tokenizes a text prompt without BOS...
    prompt_embeds: Annotated[Unsupported, _unsupported(lambda v: not v, "prompt_embeds")] = None


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageParam(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a role "tool" message: the call it answers
    name: str | None = None
    reasoning: str | None = None  # an assistant's earlier reasoning, as this server returns it
    reasoning_content: str | None = None  # the same under its older name (vLLM < 0.11, DeepSeek's API)
    # after role and tool_calls, so its check sees them: null only in an assistant message that calls tools
    content: Annotated[str | list[TextPart] | None, _one_error(
        "must be a string or a list of text parts (type 'text'); images and audio are not supported")] = Field(
        default=None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _content_needed(cls, content, info: ValidationInfo):
        if content is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise PydanticCustomError("type_error", "must be a string or a list of text parts (type 'text'); "
                                      "images, audio and null are not supported (null only in an assistant "
                                      "message with tool_calls)")
        return content

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
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:  # what reasoning templates read (Qwen3 keeps or drops it by turn)
            message["reasoning_content"] = reasoning
        return message


class JSONSchemaFormat(StrictModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDefinition(StrictModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ToolParam(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Annotated[Literal["none", "auto", "required"] | NamedToolChoice, _one_error(
    "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")]


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessageParam], Field(min_length=1)]
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = None  # each output token's logprob
    top_logprobs: int | None = None  # with logprobs: this many most likely tokens per position (0-20)
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None  # None: 'auto' when tools are given (refused: deployments/tools.py)
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # vLLM's chat-template fields (ponytail.check_chat_template_options checks them)
    chat_template_kwargs: dict[str, Any] | None = None  # names the template reads, e.g. {"enable_thinking": false}
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the answer continues the last message (prefill), not a new one
    echo: bool = False  # the answer starts with the last message's text when that is the assistant's
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    include_reasoning: bool = True  # False: a reasoning model's thinking is left out of the answer
    chat_template: Annotated[Unsupported, _unsupported(
        lambda v: False, "chat_template per request (the server's chat_template sets it)")] = None
    documents: list[dict[str, str]] | None = None  # vLLM's: passed to templates that take them (RAG)
    add_special_tokens: bool = False  # vLLM's: true adds the tokenizer's BOS... to what the template writes

    def field_name(self, sampling_name: str) -> str:
        """The request field a SamplingParams field came from (for error messages)."""
        if sampling_name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        if sampling_name == "structured_outputs":  # the request's own, else set by deployments/tools.py
            if (given := constraint_fields(self)):
                return given[0]
            forced = self.tools and self.tool_choice not in (None, "none", "auto")
            return "tools" if forced else "response_format"
        if sampling_name == "logprobs":  # logprobs=true alone asks for 0 top ones
            return "top_logprobs" if self.top_logprobs is not None else "logprobs"
        return "messages" if sampling_name == "prompt" else sampling_name


GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def constraint_fields(req: SamplingRequest) -> list[str]:
    """The request's own constraint fields that are set: structured_outputs, guided_*, and on
    completions response_format (chat's goes with tools: deployments/tools.py)."""
    names = ["structured_outputs", *GUIDED_FIELDS]
    if isinstance(req, CompletionRequest):
        names.append("response_format")
    return [name for name in names if getattr(req, name) is not None
            and not (name == "response_format" and req.response_format.type == "text")]


class TokenizeRequest(StrictModel):
    """vLLM's /tokenize body: a completions prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessageParam], Field(min_length=1)] | None = None
    # with messages: the chat template's options, as in a chat request
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolParam] | None = None

    def template_options(self) -> dict[str, Any]:
        """GenerateRequest's fields for the chat template (the replica checks them with the messages)."""
        return {"chat_template_kwargs": self.chat_template_kwargs, "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message,
                "tools": [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None}


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]
