"""The OpenAI API's request and response bodies (pydantic v2), and their mapping to GenerateRequest.

Requests are parsed strictly (`"ten"` or `true` is no integer) and unknown fields are ignored, as
OpenAI does. Type errors surface as pydantic errors whose location names the field; the ingress
turns them into 400s. Sampling *values* are checked later by `ponytail.SamplingParams`, so the
messages read the same as in the Python API.

Defaults: completions generate at most 16 tokens (OpenAI's default); chat without max_tokens runs
to the end of the context, as under OpenAI and vLLM (GenerateRequest.max_tokens_to_context: the
ingress does not know the prompt's token count, the replica applies the chat template and sets
max_tokens to what the prompt leaves; the operator's max_output_tokens caps it).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, WrapValidator,
                      field_validator)
from pydantic_core import PydanticCustomError

from ponytail import ConfigError, check_chat_template_options

from .openai_logprobs import ChatLogprobs, CompletionLogprobs
from .protocol import BEAM_SEARCH_SAMPLING, GenerateRequest

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# Request fields passed to ponytail.SamplingParams under the same name: OpenAI's, then vLLM's extras.
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed",
                   "stop", "n", "best_of", "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids",
                   "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "allowed_token_ids", "bad_words")


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


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False  # one more chunk, before [DONE], with usage and no choices
    continuous_usage_stats: bool = False  # with include_usage: every chunk carries its choice's usage so far (vLLM's)


class _SamplingRequest(_Request):
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


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    logprobs: int | None = None  # logprobs of each token and of this many most likely ones (0-20)
    echo: bool | None = None  # the prompt comes first in the text (with its logprobs, if logprobs is set)
    response_format: ResponseFormat | None = None  # as in chat (vLLM takes it here too)
    suffix: Annotated[Unsupported, _unsupported(lambda v: v == "", "suffix")] = None
    add_special_tokens: bool = True  # vLLM's: false tokenizes a text prompt without BOS...
    prompt_embeds: Annotated[Unsupported, _unsupported(lambda v: not v, "prompt_embeds")] = None


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


def constraint_fields(req: _SamplingRequest) -> list[str]:
    """The request's own constraint fields that are set: structured_outputs, guided_*, and on
    completions response_format (chat's goes with tools: deployments/tools.py)."""
    names = ["structured_outputs", *GUIDED_FIELDS]
    if isinstance(req, CompletionRequest):
        names.append("response_format")
    return [name for name in names if getattr(req, name) is not None
            and not (name == "response_format" and req.response_format.type == "text")]


def requested_constraint(req: _SamplingRequest) -> dict[str, Any] | None:
    """SamplingParams.structured_outputs from the request's own constraint field; ConfigError when
    there are several (the message names the first)."""
    given = constraint_fields(req)
    if len(given) > 1:
        raise ConfigError(f"{given[0]}={_shown(getattr(req, given[0]))} cannot be combined with {given[1]}; "
                          "allowed: one constraint per request")
    if not given:
        return None
    name = given[0]
    if name == "structured_outputs":
        return dict(req.structured_outputs)
    if name == "response_format":
        return response_format_constraint(req.response_format)
    return {GUIDED_FIELDS[name]: getattr(req, name)}


def _shown(value) -> str:
    value = value.model_dump(exclude_none=True) if isinstance(value, BaseModel) else value
    return f"{value!r:.60}"


def response_format_constraint(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    """structured_outputs for OpenAI's response_format (None for text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ConfigError("response_format={'type': 'json_schema'} has no json_schema.schema; "
                          "allowed: {'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}")
    return {"json": fmt.json_schema.schema_}


def to_generate_requests(req: CompletionRequest | ChatCompletionRequest,
                         base_id: str | None = None) -> list[GenerateRequest]:
    """One engine request per prompt of a completions request (a string, token ids, or a list of
    either), one for a chat request. Ids: `<prefix>-<base_id>` (base_id: the client's x-request-id,
    else a random hex), with `-<index>` appended when there are several prompts."""
    prefix = "chatcmpl" if isinstance(req, ChatCompletionRequest) else "cmpl"
    request_id = f"{prefix}-{base_id}" if base_id else new_request_id(prefix)
    prompts = [None] if isinstance(req, ChatCompletionRequest) else _prompts(req.prompt)
    if len(prompts) == 1:  # a list of one prompt ([[ids]], what lm-eval sends) is that prompt
        single = req if prompts[0] is None or prompts[0] is req.prompt else req.model_copy(update={"prompt": prompts[0]})
        return [to_generate_request(single, request_id)]
    return [to_generate_request(req.model_copy(update={"prompt": prompt}), f"{request_id}-{index}")
            for index, prompt in enumerate(prompts)]


def _prompts(prompt: str | list) -> list:
    """A completions prompt as a list of single prompts (strings or token-id lists)."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return [prompt]
    if not prompt:
        raise ConfigError("prompt=[] is empty; allowed: a string, a list of token ids, or a non-empty list of either")
    return list(prompt)


def to_generate_request(req: CompletionRequest | ChatCompletionRequest,
                        request_id: str | None = None) -> GenerateRequest:
    """The engine request for an OpenAI request; `sampling` holds ponytail.SamplingParams fields."""
    sampling = {name: value for name in SAMPLING_FIELDS if (value := getattr(req, name)) is not None}
    if req.prompt_logprobs is not None:
        if req.stream:
            raise ConfigError(f"prompt_logprobs={req.prompt_logprobs} with stream=true is not supported; allowed: "
                              "prompt_logprobs on a request that is not streamed")
        sampling["prompt_logprobs"] = req.prompt_logprobs
    if (constraint := requested_constraint(req)) is not None:
        sampling["structured_outputs"] = constraint
    if req.logit_bias:
        sampling["logit_bias"] = _token_keys(req.logit_bias)
    if req.logprob_token_ids is not None:
        sampling["logprob_token_ids"] = req.logprob_token_ids
    if req.thinking_token_budget is not None:
        sampling["thinking_token_budget"] = req.thinking_token_budget
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is not None:
            sampling["max_tokens"] = max_tokens
        sampling.update(chat_logprob_fields(req))
        messages = [m.to_dict() for m in req.messages]
        kwargs = template_kwargs(req)
        check_chat_template_options(kwargs, req.add_generation_prompt, req.continue_final_message, messages)
        return GenerateRequest(messages=messages, sampling=sampling,
                               request_id=request_id or new_request_id("chatcmpl"), chat_template_kwargs=kwargs,
                               add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message,
                               truncate_prompt_tokens=req.truncate_prompt_tokens,
                               truncation_side=req.truncation_side or "left",
                               max_tokens_to_context=max_tokens is None, cache_salt=req.cache_salt,
                               documents=req.documents, prompt_logprobs=req.prompt_logprobs, priority=req.priority,
                               add_special_tokens=req.add_special_tokens, return_token_ids=bool(req.return_token_ids))
    sampling.setdefault("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
    if req.logprob_token_ids is not None and req.logprobs is None:
        raise ConfigError(f"logprob_token_ids={_shown(req.logprob_token_ids)} needs logprobs; allowed: "
                          "logprob_token_ids only together with logprobs (any count: the tracked tokens replace "
                          "the top ones)")
    if req.logprobs is not None:
        if req.logprob_token_ids is None:
            sampling["logprobs"] = req.logprobs
        if req.echo:  # what loglikelihood evaluation reads: the prompt tokens' logprobs
            sampling["prompt_logprobs"] = max(req.logprobs, req.prompt_logprobs or 0)
    return GenerateRequest(prompt=req.prompt, sampling=sampling, request_id=request_id or new_request_id("cmpl"),
                           echo=bool(req.echo), truncate_prompt_tokens=req.truncate_prompt_tokens,
                           truncation_side=req.truncation_side or "left",
                           cache_salt=req.cache_salt, prompt_logprobs=req.prompt_logprobs, priority=req.priority,
                           add_special_tokens=req.add_special_tokens, return_token_ids=bool(req.return_token_ids))


MAX_BEAMS = 10  # ponytail.BeamSearchParams' limit: each beam asks for 2 x n of at most 20 logprobs a step


def set_beam_search(req: CompletionRequest | ChatCompletionRequest, generate: GenerateRequest) -> None:
    """generate.beam_search from use_beam_search and length_penalty (once the sampling fields are
    final: tools and response formats add to them); ConfigError names what cannot go with it."""
    if not req.use_beam_search:
        if req.length_penalty is not None and req.length_penalty != 1:
            raise ConfigError(f"length_penalty={req.length_penalty} ranks beams and needs use_beam_search=true; "
                              "allowed without it: 1, or leave it out")
        return
    field = req.field_name if isinstance(req, ChatCompletionRequest) else (lambda name: name)
    others = [name for name in generate.sampling if name not in BEAM_SEARCH_SAMPLING]
    if generate.tools:
        others.insert(0, "tools")
    if getattr(req, "echo", False):
        others.insert(0, "echo")
    if req.stream:
        others.insert(0, "stream")
    if others:
        name = others[0]
        value = {"tools": "[...]", "echo": "true", "stream": "true"}.get(name)
        if value is None and field(name) == "logprobs" and isinstance(req, ChatCompletionRequest):
            value = "true"  # chat's logprobs=true alone
        elif value is None:
            name, value = field(name), _shown(generate.sampling[name])
        raise ConfigError(f"{name}={value} cannot be combined with use_beam_search=true; allowed with it: "
                          f"{', '.join(field(name) for name in BEAM_SEARCH_SAMPLING)}, length_penalty")
    beams = generate.sampling.get("n", 1)
    if beams > MAX_BEAMS:
        raise ConfigError(f"n={beams} with use_beam_search=true asks for {beams} beams; allowed: at most {MAX_BEAMS}")
    generate.beam_search = {"length_penalty": 1.0 if req.length_penalty is None else float(req.length_penalty)}


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """chat_template_kwargs, with reasoning_effort as vLLM passes it: itself, and enable_thinking
    (false for "none") unless the request set that."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs["reasoning_effort"] = req.reasoning_effort
        kwargs.setdefault("enable_thinking", req.reasoning_effort != "none")
    return kwargs or None


def _token_keys(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as strings."""
    try:
        return {int(key): value for key, value in bias.items()}
    except ValueError:
        raise ConfigError(f"logit_bias={bias!r:.80} is invalid; allowed: token ids (integers) as keys, "
                          "biases in [-100, 100] as values") from None


def chat_logprob_fields(req: ChatCompletionRequest) -> dict[str, int]:
    """SamplingParams.logprobs from chat's logprobs/top_logprobs (OpenAI: top_logprobs needs logprobs)."""
    if req.top_logprobs is not None and not req.logprobs:
        raise ConfigError(f"top_logprobs={req.top_logprobs} needs logprobs=true; allowed: top_logprobs "
                          "only together with logprobs=true")
    if req.logprob_token_ids is not None and not req.logprobs:
        raise ConfigError(f"logprob_token_ids={_shown(req.logprob_token_ids)} needs logprobs=true; allowed: "
                          "logprob_token_ids only together with logprobs=true")
    if not req.logprobs:
        return {}
    if req.logprob_token_ids is not None:  # the tracked tokens replace the top ones (vLLM)
        return {}
    return {"logprobs": 0 if req.top_logprobs is None else req.top_logprobs}


# ------------------------------------------------------------------------------ responses
def _omit_if_none(**kwargs):
    return Field(default=None, exclude_if=lambda value: value is None, **kwargs)


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # found in the prefix cache, not computed again


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int  # in the thought of a reasoning model's answer


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # OpenAI's details: cached prompt tokens always (vLLM's --enable-prompt-tokens-details), and
    # reasoning tokens where the served model's answers are split into thought and content.
    prompt_tokens_details: PromptTokensDetails | None = _omit_if_none()
    completion_tokens_details: CompletionTokensDetails | None = _omit_if_none()

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
           reasoning_tokens: int | None = None) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=None if cached_tokens is None else PromptTokensDetails(
                       cached_tokens=cached_tokens),
                   completion_tokens_details=None if reasoning_tokens is None else CompletionTokensDetails(
                       reasoning_tokens=reasoning_tokens))


# vLLM's prompt_logprobs: per prompt token (None for the first), {token id: {logprob, rank, decoded_token}}
PromptLogprobs = list[dict[str, dict[str, Any]] | None]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = _omit_if_none()
    finish_reason: str | None = None  # stop, length (abort when the engine gave up on it)
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it (not EOS)
    # vLLM's return_token_ids: the prompt's (streamed: in the choice's first chunk) and the output's (new) ids
    prompt_token_ids: list[int] | None = _omit_if_none()
    token_ids: list[int] | None = _omit_if_none()


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = _omit_if_none()


class CompletionChunk(Completion):
    """A streamed piece: OpenAI sends the same object as the full response, usage only at the end."""


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = _omit_if_none()
    reasoning: str | None = _omit_if_none()  # a reasoning model's thinking (vLLM's field; deployments/reasoning.py)


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # as CompletionChoice's
    token_ids: list[int] | None = _omit_if_none()  # vLLM's return_token_ids: the answer's


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = _omit_if_none()  # vLLM's, for the request's prompt
    prompt_token_ids: list[int] | None = _omit_if_none()  # vLLM's return_token_ids


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
    reasoning: str | None = _omit_if_none()  # a reasoning model's thinking (vLLM's field; deployments/reasoning.py)
    tool_calls: list[ToolCallDelta] | None = _omit_if_none()


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # as CompletionChoice's, with the finish_reason
    token_ids: list[int] | None = _omit_if_none()  # vLLM's return_token_ids: the tokens new in this chunk


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = _omit_if_none()
    prompt_token_ids: list[int] | None = _omit_if_none()  # vLLM's return_token_ids: the first chunk only


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ponytail"
    max_model_len: int | None = None  # vLLM's extra
    root: str | None = None  # vLLM's: where the tokenizer loads from (a path or hub id)


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


class TokenizeRequest(_Request):
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


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
