"""vLLM's thinking_token_budget: a reasoning model may think (between `<think>` and `</think>`) for
at most that many tokens; then the engine writes `</think>` for it and the answer follows.

A thought may open in the prompt (templates such as DeepSeek-R1's and Qwen3's with thinking on
end the generation prompt with `<think>`): its tokens there count. Each step the engine reads the
request's new tokens (ThinkingBudget.forced_token) and, where the budget is spent inside a thought,
the sampler takes the end tag's next token instead of its draw (SamplingBatch.forced_tokens).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..errors import ConfigError

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkingTags:
    """The token ids a model writes its thought's tags with."""

    start: tuple[int, ...]
    end: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer) -> ThinkingTags | None:
        """The tokenizer's `<think>` and `</think>` when each is one token of its vocabulary (the
        reasoning models' added tokens: Qwen3, DeepSeek-R1, ...); None otherwise."""
        if tokenizer is None:
            return None
        vocab = tokenizer.get_vocab()
        if THINK_START not in vocab or THINK_END not in vocab:
            return None
        return cls((vocab[THINK_START],), (vocab[THINK_END],))


def check_thinking_budget(params, tags: ThinkingTags | None) -> None:
    """ConfigError where a request's thinking_token_budget cannot be kept by this engine."""
    if params.thinking_token_budget is not None and tags is None:
        raise ConfigError(f"thinking_token_budget={params.thinking_token_budget} needs a reasoning model whose "
                          f"tokenizer has {THINK_START} and {THINK_END} tokens, and this model has none; allowed: "
                          "None or -1 (no limit)")


class ThinkingBudget:
    """One sequence's thought so far: whether it is in one, how many tokens it has thought, and
    how much of the end tag the engine has written for it."""

    def __init__(self, tags: ThinkingTags, budget: int, prompt_token_ids: list[int]):
        self.tags, self.budget = tags, budget
        self.recent: deque[int] = deque(maxlen=max(len(tags.start), len(tags.end)))
        self.in_thought, self.thought, self.ending = False, 0, 0
        self.seen = 0  # output tokens read so far
        for token in prompt_token_ids:
            self._read(token)

    def forced_token(self, output_token_ids: list[int]) -> int:
        """The token the next step must take (the end tag's next one), or -1 for any; reads the
        output tokens written since the last call first."""
        for token in output_token_ids[self.seen:]:
            self._read(token)
        self.seen = len(output_token_ids)
        if not self.in_thought or self.thought < self.budget:
            return -1
        return self.tags.end[self.ending]

    def _read(self, token: int) -> None:
        self.recent.append(token)
        if self._ends_with(self.tags.start):
            self.in_thought, self.thought, self.ending = True, 0, 0
        elif self._ends_with(self.tags.end):
            self.in_thought, self.ending = False, 0
        elif self.in_thought and self.thought >= self.budget:
            self.ending = self.ending + 1 if token == self.tags.end[self.ending] else 0
        elif self.in_thought:
            self.thought += 1

    def _ends_with(self, tag: tuple[int, ...]) -> bool:
        n = len(tag)
        return len(self.recent) >= n and tuple(self.recent)[-n:] == tag
