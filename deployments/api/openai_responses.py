"""The OpenAI API's response bodies (pydantic v2): completions, chat, models, errors, tokenize."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from .openai_logprobs import ChatLogprobs, CompletionLogprobs
from .openai_requests import ToolCall

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


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str
