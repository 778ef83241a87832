"""The engine's logprob entries ({token id: logprob}) as TokenLogprobs with text, on the replica."""

from __future__ import annotations

from typing import Any

from ponytail import SamplingParams, TokenTexts

from .openai_logprobs import LOGPROB_FLOOR
from .protocol import TokenLogprob


def shown_top(params: SamplingParams) -> int | None:
    """How many of a token's logprob entries the answer lists: the top `logprobs`, or every one
    where the request tracks tokens (logprob_token_ids: the sampled one too, as vLLM lists them)."""
    return None if params.logprob_token_ids else params.logprobs


def token_logprob(texts: TokenTexts, token_id: int, entry: dict[int, float], top: int | None) -> TokenLogprob:
    """One TokenLogprob from an engine entry: the chosen token's logprob and the `top` most likely
    (None: all the entry holds).

    The entry holds the chosen token and the top ones (the chosen one may be among them), so the
    top ones are its `top` largest values: a chosen token outside them is less likely than each."""
    ranked = sorted(entry.items(), key=lambda item: -item[1])[:top]
    return TokenLogprob(token_id=token_id, token=texts(token_id), logprob=entry[token_id],
                        top=[(i, texts(i), value) for i, value in ranked])


def prompt_logprob_entries(texts: TokenTexts, token_ids: list[int], entries: list[dict[int, float] | None],
                           top: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs field: per prompt token (None where nothing predicts it), the token's
    and the `top` most likely ones' {"logprob", "rank", "decoded_token"}, keyed by token id."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for token_id, entry in zip(token_ids, entries):
        if entry is None:
            out.append(None)
            continue
        chosen = [token_id] + [i for i, _ in sorted(entry.items(), key=lambda item: -item[1])[:top] if i != token_id]
        out.append({str(i): {"logprob": max(float(entry[i]), LOGPROB_FLOOR), "rank": getattr(entry[i], "rank", None),
                             "decoded_token": texts(i)} for i in chosen})
    return out


def token_logprobs(texts: TokenTexts, token_ids: list[int], entries: list[dict[int, float] | None],
                   top: int | None) -> list[TokenLogprob]:
    """token_logprob per token; logprob None where the entry is None (the first prompt token)."""
    return [TokenLogprob(token_id, texts(token_id), None, []) if entry is None
            else token_logprob(texts, token_id, entry, top) for token_id, entry in zip(token_ids, entries)]
