"""Logprobs in OpenAI's two shapes: legacy completions (parallel lists) and chat (one object per token)."""

from __future__ import annotations

from pydantic import BaseModel

from .protocol import TokenLogprob

# JSON has no -inf; a token the model rules out gets vLLM's floor instead.
LOGPROB_FLOOR = -9999.0


def _finite(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


class CompletionLogprobs(BaseModel):
    """/v1/completions `logprobs`: one item per token in each list."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]  # the top `logprobs` tokens plus the chosen one (vLLM)
    text_offset: list[int]  # where each token's text starts in the choice's text


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # the token's UTF-8 bytes


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]  # the top `top_logprobs` tokens, most likely first


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


def _name(token_id: int, text: str, as_ids: bool) -> str:
    """How a token is named: its text, or vLLM's "token_id:<id>" (return_tokens_as_token_ids)."""
    return f"token_id:{token_id}" if as_ids else text


def completion_logprobs(items: list[TokenLogprob], text_offset: int, as_ids: bool = False) -> CompletionLogprobs:
    """The legacy shape for `items`, whose text starts at `text_offset` in the choice's text."""
    offsets = []
    for item in items:
        offsets.append(text_offset)
        text_offset += len(item.token)
    return CompletionLogprobs(
        tokens=[_name(item.token_id, item.token, as_ids) for item in items],
        token_logprobs=[None if item.logprob is None else _finite(item.logprob) for item in items],
        top_logprobs=[None if item.logprob is None else
                      {**{_name(i, text, as_ids): _finite(value) for i, text, value in item.top},
                       _name(item.token_id, item.token, as_ids): _finite(item.logprob)}
                      for item in items],
        text_offset=offsets)


def _top(token: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=token, logprob=_finite(logprob), bytes=list(token.encode("utf-8")))


def chat_logprobs(items: list[TokenLogprob], as_ids: bool = False) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatTokenLogprob(**_top(_name(item.token_id, item.token, as_ids), item.logprob).model_dump(),
                         top_logprobs=[_top(_name(i, text, as_ids), value) for i, text, value in item.top])
        for item in items])
