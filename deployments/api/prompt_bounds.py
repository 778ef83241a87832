"""How long a prompt may be on one replica, and what a request's truncation and open-ended max_tokens
make of it: checked before the engine sees the request, with errors that name the field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ponytail import ConfigError, ContextLengthError, SamplingParams

from .prompts import truncated
from .protocol import GenerateRequest

# truncate_prompt_tokens -1 on a request without max_tokens (which would take the rest of the
# context): the prompt's cut leaves this much room for the answer, not a single token.
TRUNCATED_ANSWER_ROOM = 256


@dataclass(frozen=True, slots=True)
class PromptBounds:
    max_prompt_tokens: int  # the operator's max_prompt_tokens, at most the context
    max_model_len: int
    max_token_bytes: int | None  # no token stands for more bytes of text than this (None: no tokenizer)

    @classmethod
    def of(cls, tokenizer: Any, max_model_len: int, max_prompt_tokens: int | None) -> PromptBounds:
        most = max_model_len if max_prompt_tokens is None else min(max_prompt_tokens, max_model_len)
        return cls(most, max_model_len, max_token_bytes(tokenizer))

    def refuse_certainly_too_long(self, request: GenerateRequest) -> None:
        """No token covers more than max_token_bytes bytes of text, so a text of more bytes than
        max_prompt_tokens x max_token_bytes is too long whatever it tokenizes to: refused before
        seconds of tokenizing."""
        if self.max_token_bytes is None:
            return
        if request.messages is not None:
            size = sum(len(str(m.get("content") or "").encode()) for m in request.messages)
        elif isinstance(request.prompt, str):
            size = len(request.prompt.encode())
        else:
            return
        least = size // self.max_token_bytes
        if least > self.max_prompt_tokens:
            raise ContextLengthError(
                f"prompt has at least {least} tokens ({size} bytes of text, at most {self.max_token_bytes} per "
                f"token); allowed: at most {self.max_prompt_tokens} (max_model_len={self.max_model_len})",
                least, request.sampling.max_tokens, self.max_prompt_tokens)

    def check(self, prompt: Any, params: SamplingParams) -> None:
        if isinstance(prompt, list) and len(prompt) > self.max_prompt_tokens:
            raise ContextLengthError(
                f"prompt has {len(prompt)} tokens; allowed: at most {self.max_prompt_tokens} (max_prompt_tokens, "
                f"max_model_len={self.max_model_len})", len(prompt), params.max_tokens, self.max_prompt_tokens)

    def truncated(self, prompt, request: GenerateRequest):
        """The prompt's last truncate_prompt_tokens tokens (vLLM's), its first ones with truncation_side
        "right"; -1: as many as fit in the context with the answer after them (and within
        max_prompt_tokens)."""
        keep, side = request.truncate_prompt_tokens, request.truncation_side
        if keep is None:
            return prompt
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < -1 or keep == 0:
            raise ConfigError(f"truncate_prompt_tokens={keep!r} is invalid; allowed: a positive integer "
                              "(the prompt's last this many tokens) or -1 (as many as the context allows)")
        if not isinstance(prompt, list):
            raise ConfigError("truncate_prompt_tokens needs the prompt as token ids, and this model has no "
                              "tokenizer; allowed: token-id prompts, or no truncate_prompt_tokens")
        if side not in ("left", "right"):
            raise ConfigError(f"truncation_side={side!r:.40} is invalid; allowed: left (keep the last "
                              "tokens), right (keep the first)")
        if keep == -1:
            answer = request.sampling.max_tokens
            if request.max_tokens_to_context:
                answer = min(answer, TRUNCATED_ANSWER_ROOM)
            keep = max(1, min(self.max_prompt_tokens, self.max_model_len - answer))
        return truncated(prompt, keep, side)

    def to_context(self, params: SamplingParams, prompt_tokens: int, cache_tokens: int) -> SamplingParams:
        """A request without max_tokens: at most what the prompt leaves of the context, and of the
        whole KV cache (cache_tokens) where that holds less (the engine refuses a request it could
        never hold)."""
        context = self.max_model_len
        most, by = (context, f"max_model_len={context}") if context <= cache_tokens else (
            cache_tokens, f"the KV cache holds {cache_tokens} tokens; max_model_len={context}")
        if prompt_tokens >= most:
            raise ContextLengthError(
                f"prompt has {prompt_tokens} tokens, which leaves no room for an answer; allowed: at most "
                f"{most - 1} ({by})", prompt_tokens, 1, most)
        return dataclasses.replace(params, max_tokens=min(params.max_tokens, most - prompt_tokens))


def max_token_bytes(tokenizer) -> int | None:
    """An upper bound on the bytes of text one token stands for: twice the longest token string in
    UTF-8 (byte-level and SentencePiece token strings spell each text byte with at least one byte;
    the factor 2 covers normalizers that shorten text). None without a tokenizer."""
    if tokenizer is None:
        return None
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return 2 * max(len(t.encode()) for t in tokens if t)
