"""A reasoning model's thinking, split from its answer: vLLM's `--reasoning-parser` and the
`reasoning` field of its chat responses (`message.reasoning`, `delta.reasoning`).

Reasoning models write their thought between `<think>` and `</think>`, then the answer. Two
kinds of chat template are told apart (`reasoning_format`):
- "qwen3" (the template reads `enable_thinking`: Qwen3, QwQ-style hybrids, SmolLM3): the answer
  starts in thought unless the request's `chat_template_kwargs` set `enable_thinking` false (the
  template then writes an empty thought into the prompt, and the model answers directly);
- "deepseek_r1" (`</think>` in the template, no switch: DeepSeek-R1 and its distills, whose
  templates open `<think>` in the prompt): the answer always starts in thought.
Within thought a `<think>` is dropped, `</think>` ends it, and so does a `<tool_call>`, which stays
for the tool-call parser (vLLM's rule for Qwen3, which may call a tool without closing its
thought). A thought never closed (max_tokens hit) is all reasoning, and the content is null. The
whitespace around the thought (Qwen3 writes `<think>\\n` ... `\\n</think>\\n\\n`) is not kept.

Constrained answers (response_format, a named or required tool call) are grammar-bound JSON, not
thought: they are not split. `include_reasoning: false` leaves the reasoning out.
"""

from __future__ import annotations

from typing import Any

from .openai_protocol import ChatDelta
from .tool_parsers import partial_tag

DEEPSEEK_R1, QWEN3 = "deepseek_r1", "qwen3"
THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START = "<tool_call>"  # ends a thought and stays (Hermes / Qwen3 tool calls follow)
REASONING, CONTENT = "reasoning", "content"

# What an operator may set as reasoning_parser (vLLM's --reasoning-parser): "auto" finds the
# format from the served template, "none" splits nothing (the thought stays in the content).
REASONING_PARSERS = ("auto", DEEPSEEK_R1, QWEN3, "none")


def served_reasoning_format(parser: str, chat_template) -> str | None:
    """The format answers are split by under the operator's `parser` (REASONING_PARSERS)."""
    if parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={parser!r} is not supported; allowed: {', '.join(REASONING_PARSERS)}")
    if parser == "auto":
        return reasoning_format(chat_template)
    return None if parser == "none" else parser


def reasoning_format(chat_template) -> str | None:
    """QWEN3 or DEEPSEEK_R1 from a chat template (the tokenizer's: a string, a dict of named
    templates, or None); None where the template shows no thought."""
    templates = [t for t in (chat_template.values() if isinstance(chat_template, dict) else [chat_template])
                 if isinstance(t, str)]
    if not any(THINK_END in t for t in templates):
        return None
    return QWEN3 if any("enable_thinking" in t for t in templates) else DEEPSEEK_R1


def starts_in_thought(fmt: str, template_kwargs: dict[str, Any] | None) -> bool:
    """Whether an answer under `fmt` begins inside its thought, given the request's template kwargs."""
    if fmt == QWEN3:
        return (template_kwargs or {}).get("enable_thinking", True) is not False
    return True


class ThoughtStream:
    """One answer fed in pieces, returned as (REASONING | CONTENT, text) events; fed whole or cut
    anywhere, the events' texts join to the same two strings."""

    def __init__(self, thinking: bool):
        self.thinking = thinking
        self.held = ""  # text not yet sent: a tail that may begin a tag, or whitespace that may be trimmed
        self.content_started = False  # whitespace at the content's start is dropped until then
        self.reasoning_started = False

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.held += text
        events: list[tuple[str, str]] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[tuple[str, str]]:
        events = self.feed("")
        text, self.held = self.held, ""
        if not self.thinking:  # a partial tag in the content is text
            self._content(text, events)
        return events  # a thought cut short: its trailing whitespace goes

    def _step(self, events: list) -> bool:
        """Handle the held text up to its first tag; True when a tag was consumed (look again)."""
        tags = (THINK_START, THINK_END, TOOL_CALL_START) if self.thinking else (THINK_END,)
        found = [(self.held.find(tag), tag) for tag in tags]
        at, tag = min(((i, t) for i, t in found if i >= 0), default=(-1, None))
        if tag is None:
            keep = max(partial_tag(self.held, tag) for tag in tags)
            text = self.held[: len(self.held) - keep]
            if self.thinking:  # trailing whitespace waits: it goes if `</think>` follows
                stripped = text.rstrip()
                keep += len(text) - len(stripped)
                text = stripped
            self.held = self.held[len(self.held) - keep:] if keep else ""
            self._emit(text, events)
            return False
        before, self.held = self.held[:at], self.held[at + len(tag):]
        if self.thinking:
            self._emit(before.rstrip() if tag != THINK_START else before, events)
            if tag == THINK_START:
                return True
            self.thinking = False
            if tag == TOOL_CALL_START:  # the call's tag opens the content
                self.held = tag + self.held
            return True
        self._content(before, events)  # a stray `</think>` after the thought: dropped
        return True

    def _emit(self, text: str, events: list) -> None:
        if self.thinking:
            if not self.reasoning_started:
                text = text.lstrip()
                self.reasoning_started = bool(text)
            if text:
                events.append((REASONING, text))
        else:
            self._content(text, events)

    def _content(self, text: str, events: list) -> None:
        if not self.content_started:
            text = text.lstrip()
            self.content_started = bool(text)
        if text:
            events.append((CONTENT, text))


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer."""
    stream = ThoughtStream(thinking)
    events = stream.feed(text) + stream.finish()
    reasoning = "".join(t for kind, t in events if kind == REASONING)
    return (reasoning or None), "".join(t for kind, t in events if kind == CONTENT)


def _listed(chunks) -> list:
    return chunks if isinstance(chunks, list) else [chunks]


class ReasoningFormat:
    """Chat responses of a reasoning model: wraps the chat format (or the tool-call format, which
    then reads only the content) and sends the thought as `reasoning`. Same methods, returning
    lists of chunks."""

    def __init__(self, inner, thinking: bool, include: bool = True):
        self.inner = inner
        self.chat_format = getattr(inner, "chat_format", inner)  # the plain chat format, which makes chunks
        self.common = inner.common
        self.thinking = thinking
        self.include = include
        self.streams: dict[int, ThoughtStream] = {}

    def start(self, index: int) -> list:
        return _listed(self.inner.start(index))

    def text(self, index: int, text: str, items=None) -> list:
        chunks = self._chunks(index, self._stream(index).feed(text), items)
        return chunks or ([self.chat_format._delta(index, ChatDelta(), items=items)] if items else [])

    def finish(self, index: int, finish_reason: str | None) -> list:
        return self._chunks(index, self._stream(index).finish()) + _listed(self.inner.finish(index, finish_reason))

    def _stream(self, index: int) -> ThoughtStream:
        if index not in self.streams:
            self.streams[index] = ThoughtStream(self.thinking)
        return self.streams[index]

    def _chunks(self, index: int, events: list, items=None) -> list:
        chunks = []
        for kind, value in events:
            if kind == CONTENT:
                chunks.extend(_listed(self.inner.text(index, value, items)))
            elif self.include:
                chunks.append(self.chat_format._delta(index, ChatDelta(reasoning=value), items=items))
            elif items:
                chunks.append(self.chat_format._delta(index, ChatDelta(), items=items))
            items = None  # a piece's logprobs go out once, with its first chunk
        return chunks

    def usage(self, usage):
        return self.inner.usage(usage)

    def choice(self, index: int, text: str, finish_reason: str | None, items=None):
        reasoning, content = split_reasoning(text, self.thinking)
        choice = self.inner.choice(index, content, finish_reason, items)
        message = choice.message
        update = {"reasoning": reasoning if self.include else None}
        if reasoning is not None and not message.content:
            update["content"] = None  # all thought: no answer
        return choice.model_copy(update={"message": message.model_copy(update=update)})

    def full(self, choices: list, usage):
        return self.inner.full(choices, usage)


def with_reasoning(fmt, served_format: str | None, generate, plan, req) -> Any:
    """`fmt` wrapped in a ReasoningFormat where the served model reasons (`served_format`, ModelInfo's
    reasoning_format) and the answer is free text: not grammar-bound, not a forced tool call.
    `generate`: the engine request (its template kwargs say whether thinking is on), `req` the chat request."""
    sampling = generate.sampling
    if served_format is None or "structured_outputs" in sampling or (plan is not None and plan.format is None):
        return fmt
    if req.skip_special_tokens is None:
        sampling["skip_special_tokens"] = False  # some tokenizers make <think> special: the split needs it
    return ReasoningFormat(fmt, starts_in_thought(served_format, generate.chat_template_kwargs),
                           include=req.include_reasoning)
