"""A reasoning model's thinking, split from its answer: vLLM's `--reasoning-parser` and the
`reasoning` field of its chat responses (`message.reasoning`, `delta.reasoning`).

Reasoning models write their thought between `<think>` and `</think>`, then the answer. Where
the thought starts:
- "auto" (the default, THINK: any template that mentions `</think>`): from the prompt. The replica
  renders the template's generation prompt once at start (`thought_opens`, for enable_thinking
  unset, true and false): where it leaves a `<think>` open (DeepSeek-R1, Qwen3-Thinking-2507,
  Qwen3.x with thinking on) the answer starts in thought; elsewhere it is a thought only if it
  begins with `<think>` (Qwen3's hybrids write the tag themselves), and plain text otherwise, so
  a template that only strips old thoughts from the history (Qwen3-Instruct-2507) answers in content;
- "qwen3" (vLLM's rule, set by the operator): the answer starts in thought unless the request's
  `chat_template_kwargs` set `enable_thinking` false;
- "deepseek_r1" (vLLM's rule, set by the operator): the answer always starts in thought.
Within thought a `<think>` is dropped, `</think>` ends it, and so does a `<tool_call>`, which stays
for the tool-call parser (vLLM's rule for Qwen3, which may call a tool without closing its
thought). A thought never closed (max_tokens hit) is all reasoning, and the content is null. The
whitespace around the thought (Qwen3 writes `<think>\\n` ... `\\n</think>\\n\\n`) is not kept.

Constrained answers (response_format, a named or required tool call) are grammar-bound JSON, not
thought: they are not split. `include_reasoning: false` leaves the reasoning out.
"""

from __future__ import annotations

from typing import Any

from .openai_responses import ChatDelta
from .tool_parsers import partial_tag

DEEPSEEK_R1, QWEN3, THINK = "deepseek_r1", "qwen3", "think"
THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START = "<tool_call>"  # ends a thought and stays (Hermes / Qwen3 tool calls follow)
REASONING, CONTENT = "reasoning", "content"
_TAGS = (THINK_START, THINK_END)

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
    """THINK where a chat template (the tokenizer's: a string, a dict of named templates, or None)
    shows a thought (`</think>`), else None."""
    templates = [t for t in (chat_template.values() if isinstance(chat_template, dict) else [chat_template])
                 if isinstance(t, str)]
    return THINK if any(THINK_END in t for t in templates) else None


_PROBE = "ponytail-probe-7f3a"  # a user message whose end marks where the generation prompt begins


def thought_opens(tokenizer: Any, defaults: dict[str, Any] | None = None) -> tuple[bool, bool, bool]:
    """Whether the template's generation prompt leaves a `<think>` open, with enable_thinking
    unset, true and false (and the operator's other default kwargs); a template that cannot render
    a one-message chat opens none."""
    opens = []
    for value in (None, True, False):
        kwargs = {k: v for k, v in (defaults or {}).items() if k != "enable_thinking"}
        if value is not None:
            kwargs["enable_thinking"] = value
        elif (defaults or {}).get("enable_thinking") is not None:
            kwargs["enable_thinking"] = defaults["enable_thinking"]
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": _PROBE}], add_generation_prompt=True,
                                                 tokenize=False, **kwargs)
        except Exception:  # the template needs more than one user message: no thought is assumed open
            opens.append(False)
            continue
        prompt = text[text.rfind(_PROBE) + len(_PROBE):] if _PROBE in text else ""
        opens.append(prompt.rfind(THINK_START) > prompt.rfind(THINK_END))
    return tuple(opens)


def starts_in_thought(fmt: str, template_kwargs: dict[str, Any] | None,
                      opens: tuple[bool, bool, bool] | None = None) -> bool | None:
    """Whether an answer under `fmt` begins inside its thought, given the request's template
    kwargs; None: it is a thought if it begins with `<think>` (THINK where the prompt opens none)."""
    thinking = (template_kwargs or {}).get("enable_thinking")
    if fmt == QWEN3:
        return thinking is not False
    if fmt == DEEPSEEK_R1:
        return True
    index = 0 if thinking is None else (1 if thinking is not False else 2)
    return True if opens and opens[index] else None


class ThoughtStream:
    """One answer fed in pieces, returned as (REASONING | CONTENT, text) events; fed whole or cut
    anywhere, the events' texts join to the same two strings."""

    def __init__(self, thinking: bool | None):
        self.thinking = thinking  # None: undecided until the answer's first text (a thought if it is `<think>`)
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
        if self.thinking is None:  # only blanks or a start of `<think>` came: text
            self.thinking = False
        text, self.held = self.held, ""
        if not self.thinking:  # a partial tag in the content is text
            self._content(text, events)
        return events  # a thought cut short: its trailing whitespace goes

    def _step(self, events: list) -> bool:
        """Handle the held text up to its first tag; True when a tag was consumed (look again)."""
        if self.thinking is None:
            start = self.held.lstrip()
            if not start or (THINK_START.startswith(start) and start != THINK_START):
                return False  # blanks, or a start of the tag: wait for more
            self.thinking = start.startswith(THINK_START)
            return True
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


class ReasoningTokens:
    """How many of an answer's tokens fall in its thought (usage's `reasoning_tokens`), fed token
    by token, each decoded alone (`texts`: token id -> text), on the replica, which has them.

    A token counts where the thought is open both before and after it and it is not a tag, so
    `<think>` and `</think>` do not (vLLM counts the same where they are single tokens, as in
    Qwen3 and DeepSeek-R1; a `</think>` spelled in several tokens counts all but its last)."""

    def __init__(self, thinking: bool | None, texts):
        self.stream = ThoughtStream(thinking)
        self.texts = texts
        self.count = 0

    def feed(self, token_ids: list[int]) -> int:
        stream = self.stream
        for token_id in token_ids:
            before = stream.thinking
            if before is False:  # the thought is over (or never began): nothing after it counts
                break
            text = self.texts(token_id)
            stream.feed(text)
            self.count += bool(before and stream.thinking and text.strip() not in _TAGS)
        return self.count


def split_reasoning(text: str, thinking: bool | None) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer."""
    stream = ThoughtStream(thinking)
    events = stream.feed(text) + stream.finish()
    reasoning = "".join(t for kind, t in events if kind == REASONING)
    return (reasoning or None), "".join(t for kind, t in events if kind == CONTENT)


class ReasoningFormat:
    """Chat responses of a reasoning model: wraps the chat format (or the tool-call format, which
    then reads only the content) and sends the thought as `reasoning`. Same methods."""

    def __init__(self, inner, thinking: bool | None, include: bool = True):
        self.inner = inner
        self.chat_format = getattr(inner, "chat_format", inner)  # the plain chat format, which makes chunks
        self.common = inner.common
        self.thinking = thinking
        self.include = include
        self.streams: dict[int, ThoughtStream] = {}

    def start(self, index: int) -> list:
        return self.inner.start(index)

    def text(self, index: int, text: str, items=None) -> list:
        chunks = self._chunks(index, self._stream(index).feed(text), items)
        return chunks or ([self.chat_format._delta(index, ChatDelta(), items=items)] if items else [])

    def finish(self, index: int, finish_reason: str | None) -> list:
        return self._chunks(index, self._stream(index).finish()) + self.inner.finish(index, finish_reason)

    def _stream(self, index: int) -> ThoughtStream:
        if index not in self.streams:
            self.streams[index] = ThoughtStream(self.thinking)
        return self.streams[index]

    def _chunks(self, index: int, events: list, items=None) -> list:
        chunks = []
        for kind, value in events:
            if kind == CONTENT:
                chunks.extend(self.inner.text(index, value, items))
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


def with_reasoning(fmt, info, draft, plan, req) -> Any:
    """`fmt` wrapped in a ReasoningFormat where the served model reasons (ModelInfo's
    reasoning_format and thought_opens) and the answer is free text: not grammar-bound, not a
    forced tool call. `draft`: the engine request being built (engine_requests.Draft: its template
    kwargs say whether thinking is on), `req` the chat request."""
    sampling, generate = draft.sampling, draft.request
    if info.reasoning_format is None or "structured_outputs" in sampling or (plan is not None and plan.format is None):
        return fmt
    if req.skip_special_tokens is None:
        sampling["skip_special_tokens"] = False  # some tokenizers make <think> special: the split needs it
    thinking = starts_in_thought(info.reasoning_format, generate.chat_template_kwargs, info.thought_opens)
    generate.count_reasoning, generate.starts_in_thought = True, thinking  # for usage's reasoning_tokens
    return ReasoningFormat(fmt, thinking, include=req.include_reasoning)
