"""Response objects of /v1/completions and /v1/chat/completions for one request, from its deltas.

A format turns deltas into chunks (streamed) or choices (whole); tools.py and reasoning.py wrap the
chat format where the answer may hold tool calls or a thought. The helpers add usage, stop reasons,
token ids and prompt logprobs where the request asked for them.
"""

from __future__ import annotations

import hashlib
import time

from pydantic import BaseModel

import ponytail

from .openai_logprobs import chat_logprobs, completion_logprobs
from .openai_requests import ChatCompletionRequest
from .openai_responses import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta, ChatMessage,
                               Completion, CompletionChoice, CompletionChunk, Usage)
from .protocol import GenerateDelta, ModelInfo, TokenLogprob


def echoed(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's text, when it is the assistant's (continue_final_message)."""
    last = req.messages[-1]
    return (last.to_dict()["content"] or "") if req.echo and last.role == "assistant" else ""


def piece(delta: GenerateDelta) -> tuple[str, list[TokenLogprob] | None]:
    """A delta's text and token logprobs, the echoed prompt (first delta only) in front."""
    text, items = delta.text, delta.logprobs
    if delta.prompt_text is not None:
        text = delta.prompt_text + text
        if delta.prompt_logprobs is not None:
            items = delta.prompt_logprobs + (items or [])
    return text, items


class CompletionFormat:
    """Response objects of /v1/completions for one request (one choice per prompt)."""

    def __init__(self, request_id: str, model: str, fingerprint: str | None = None):
        self.common = dict(id=request_id, created=int(time.time()), model=model)
        self.fingerprint = fingerprint
        self.text_offsets: dict[int, int] = {}  # per choice: where its next streamed piece starts
        self.tokens_as_ids = False  # logprobs name tokens "token_id:<id>" (vLLM's return_tokens_as_token_ids)

    def start(self, index: int) -> list[BaseModel]:
        return []

    def _logprobs(self, index: int, text: str, items: list[TokenLogprob] | None):
        offset = self.text_offsets.get(index, 0)
        self.text_offsets[index] = offset + len(text)
        return None if items is None else completion_logprobs(items, offset, self.tokens_as_ids)

    def _chunk(self, choices: list, usage: Usage | None = None) -> BaseModel:
        return CompletionChunk(choices=choices, usage=usage, system_fingerprint=self.fingerprint, **self.common)

    def text(self, index: int, text: str, items: list[TokenLogprob] | None = None) -> list[BaseModel]:
        return [self._chunk([CompletionChoice(index=index, text=text, logprobs=self._logprobs(index, text, items))])]

    def finish(self, index: int, finish_reason: str | None) -> list[BaseModel]:
        return [self._chunk([CompletionChoice(index=index, text="", finish_reason=finish_reason)])]

    def usage(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)

    def choice(self, index: int, text: str, finish_reason: str | None, items: list[TokenLogprob] | None):
        return CompletionChoice(index=index, text=text, finish_reason=finish_reason,
                                logprobs=self._logprobs(index, text, items))

    def full(self, choices: list, usage: Usage) -> BaseModel:
        return Completion(choices=choices, usage=usage, system_fingerprint=self.fingerprint, **self.common)


class ChatFormat(CompletionFormat):
    """Response objects of /v1/chat/completions for one request; `echo`: text each answer starts with."""

    echo = ""

    @property
    def chat_format(self) -> ChatFormat:  # what the wrapping formats (tools, reasoning) call theirs
        return self

    def _delta(self, index: int, delta: ChatDelta, finish_reason: str | None = None,
               items: list[TokenLogprob] | None = None) -> BaseModel:
        logprobs = None if items is None else chat_logprobs(items, self.tokens_as_ids)
        return self._chunk([ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)])

    def _chunk(self, choices: list, usage: Usage | None = None) -> BaseModel:
        return ChatCompletionChunk(choices=choices, usage=usage, system_fingerprint=self.fingerprint, **self.common)

    def start(self, index: int) -> list[BaseModel]:
        return [self._delta(index, ChatDelta(role="assistant", content=self.echo))]

    def text(self, index: int, text: str, items: list[TokenLogprob] | None = None) -> list[BaseModel]:
        return [self._delta(index, ChatDelta(content=text), items=items)]

    def finish(self, index: int, finish_reason: str | None) -> list[BaseModel]:
        return [self._delta(index, ChatDelta(), finish_reason)]

    def choice(self, index: int, text: str, finish_reason: str | None, items: list[TokenLogprob] | None):
        return ChatChoice(index=index, message=ChatMessage(content=self.echo + text), finish_reason=finish_reason,
                          logprobs=None if items is None else chat_logprobs(items, self.tokens_as_ids))

    def full(self, choices: list, usage: Usage) -> BaseModel:
        return ChatCompletion(choices=choices, usage=usage, system_fingerprint=self.fingerprint, **self.common)


def with_stop_reason(choice, delta: GenerateDelta):
    if choice.finish_reason is not None:
        choice.stop_reason = delta.stop_reason
    return choice


def add_prompt_logprobs(full, entries: list, per_prompt: int) -> None:
    """vLLM's prompt_logprobs field: a chat's beside its choices, each completion choice its prompt's."""
    if all(e is None for e in entries):
        return
    if isinstance(full, ChatCompletion):
        full.prompt_logprobs = entries[0]
        return
    for choice in full.choices:
        choice.prompt_logprobs = entries[choice.index // per_prompt]


def add_token_ids(full, token_ids: list[list[int]], prompts: list[list[int] | None], per_prompt: int) -> None:
    """vLLM's return_token_ids: each choice's token ids; the prompt's beside a chat's choices, in
    each completion choice its prompt's."""
    for choice, ids in zip(full.choices, token_ids):
        choice.token_ids = ids
    if isinstance(full, ChatCompletion):
        full.prompt_token_ids = prompts[0]
        return
    for choice in full.choices:
        choice.prompt_token_ids = prompts[choice.index // per_prompt]


def with_token_ids(fmt, chunks: list, index: int, delta: GenerateDelta) -> list:
    """vLLM's return_token_ids, streamed: a delta's new token ids (and a completion choice's prompt
    ids, with its first tokens) on the first of its chunks with that choice, or on an empty chunk
    of their own where the format holds the text back (a tool call or a thought being parsed)."""
    if not delta.token_ids and delta.prompt_token_ids is None:
        return chunks
    carrier = next((choice for chunk in chunks for choice in chunk.choices if choice.index == index), None)
    if carrier is None:
        own = getattr(fmt, "chat_format", fmt).finish(index, None)  # an empty delta, nothing finished
        chunks, carrier = chunks + own, own[0].choices[0]
    carrier.token_ids = list(delta.token_ids)
    if isinstance(carrier, CompletionChoice):
        carrier.prompt_token_ids = delta.prompt_token_ids
    return chunks


def with_usage(chunk, usage: Usage | None):
    if usage is not None:
        chunk.usage = usage
    return chunk


def usage_of(prompts: list[GenerateDelta], lasts: list[GenerateDelta]) -> Usage:
    """A request's usage: `prompts` one delta per prompt (its tokens counted once, whatever n),
    `lasts` each choice's last delta. Reasoning tokens where the replica counted them."""
    counted = [last.reasoning_tokens for last in lasts if last.reasoning_tokens is not None]
    return Usage.of(sum(d.prompt_tokens for d in prompts), sum(last.completion_tokens for last in lasts),
                    cached_tokens=sum(d.cached_tokens for d in prompts),
                    reasoning_tokens=sum(counted) if counted else None)


def system_fingerprint(info: ModelInfo) -> str:
    """OpenAI's system_fingerprint: changes when what produces the tokens changes (Ponytail's version,
    the model, its context and block size, the device kind), so clients can tell runs apart."""
    device = info.device.split(":")[0]
    key = f"{ponytail.__version__}|{info.model_id}|{info.max_model_len}|{info.block_size}|{device}"
    return "fp_" + hashlib.sha256(key.encode()).hexdigest()[:10]
