"""A request's life in the engine, and what it hands back (vLLM's RequestOutput shape)."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..sampling.grammar import RequestGrammar
from ..sampling.params import SamplingParams
from ..sampling.thinking import ThinkingBudget

# Stands in output_token_ids for a token sampled on the device but not yet read back (async
# scheduling). Negative, so it can never pass for a real token: the model never reads it (its
# input comes from the device) and the prefix cache refuses blocks that still hold it.
PLACEHOLDER_TOKEN = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_FINISHED = RequestStatus.FINISHED  # a global: Request.finished runs per row several times a step, and
# an enum member's lookup costs ~110 ns on Python 3.11 against ~15 ns for a global


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float  # time.monotonic() when added
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        """Waiting before the first step (vLLM's request queue time); None until scheduled."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass(slots=True)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None
    # With params.prompt_logprobs: per prompt token so far, {token id: logprob} of it and the top
    # ones (None for the first token, which nothing predicts); filled as prefill chunks run.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Async scheduling: the row of the launched step's sampled tokens that will replace the
    # placeholder ending output_token_ids; None when every token is known.
    pending_row: int | None = None
    # Structured outputs: the compile under way (set by prepare_request), then the request's
    # matcher (set by enqueue), advanced by every token read back.
    grammar_ready: Future | None = None
    grammar: RequestGrammar | None = None
    thinking: ThinkingBudget | None = None  # with params.thinking_token_budget: its thought so far (step_sampling)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    # n > 1 / best_of: which sample of its request this sequence is, and the group they share
    # (None for a request of one sample).
    index: int = 0
    group: SampleGroup | None = None
    cumulative_logprob: float = 0.0  # sum of its sampled tokens' logprobs (when they are computed)
    cache_salt: str | None = None  # only requests with the same salt share cached prefix blocks (vLLM's)
    priority: int = 0  # scheduling_policy "priority": lower runs first (vLLM's)

    @property
    def follows_its_tokens(self) -> bool:
        """What it may take next follows from every token before (a grammar, a thinking budget):
        under async scheduling the step in flight is read back before it samples."""
        return self.grammar is not None or self.params.thinking_token_budget is not None

    @property
    def done(self) -> bool:
        """The whole request is over: this sequence and, with several samples, every one of them."""
        return self.finished if self.group is None else self.group.done

    @property
    def members(self) -> list[Request]:
        """Every sequence of its request: its group's samples, or itself alone."""
        return [self] if self.group is None else self.group.members

    @property
    def root(self) -> Request:
        """The request this sequence is a sample of (itself, or its parent)."""
        return self if self.group is None else self.group.members[0]

    @property
    def seqs_to_come(self) -> int:
        """Running slots it takes once admitted: itself and the samples it will still fork."""
        return 1 if self.group is None else 1 + self.group.unforked

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def prompt_logits_from(self) -> int | None:
        """The first position whose logits a prompt logprob still needs; None when none does."""
        done = self.prompt_logprobs
        if done is None or len(done) >= len(self.prompt_token_ids):
            return None
        return len(done) - 1

    def token_slice(self, start: int, end: int | None = None) -> list[int]:
        """all_token_ids[start:end] without building the whole list (hot in every step)."""
        prompt = len(self.prompt_token_ids)
        end = self.num_tokens if end is None else end
        if start >= prompt:
            return self.output_token_ids[start - prompt : end - prompt]
        if end <= prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is _FINISHED

    @property
    def reached_max_tokens(self) -> bool:
        """Its last token is sampled or being sampled: nothing is left to compute."""
        return len(self.output_token_ids) >= self.params.max_tokens

    @property
    def known_output_token_ids(self) -> list[int]:
        """output_token_ids without a placeholder of a step still on the device."""
        out = self.output_token_ids
        return out[:-1] if self.pending_row is not None else out

    def check_stop_token(self, token: int, num_output_tokens: int) -> None:
        """After `token` became output token number `num_output_tokens`: finish on EOS / stop token
        / max_tokens (not stop strings)."""
        params = self.params
        if num_output_tokens >= params.min_tokens:
            if token in (params.stop_token_ids or ()):
                self.finish("stop", token)
                return
            if token in self.eos_token_ids and not params.ignore_eos:
                self.finish("stop", None)
                return
        if num_output_tokens >= params.max_tokens:
            self.finish("length", None)

    def drop_placeholder(self) -> None:
        """Forget the token a launched step is still sampling (the request ended before it)."""
        if self.pending_row is not None:
            self.output_token_ids.pop()
            self.pending_row = None

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.metrics.finished_time = time.monotonic()


@dataclass(slots=True, eq=False)
class SampleGroup:
    """The sequences of one request with n > 1 or best_of (vLLM's parallel sampling). The first,
    the parent, is queued and prefilled alone; when its prefill ends, the engine forks the others
    from it: they share the prompt's KV blocks (copy-on-write) and sample their first token from
    the same logits, each with its own generator."""

    params: SamplingParams  # as the caller gave them (n, best_of)
    members: list[Request]  # by sample index; [parent] until the fork

    @property
    def size(self) -> int:
        return self.params.num_samples

    @property
    def unforked(self) -> int:
        return self.size - len(self.members)

    @property
    def done(self) -> bool:
        """Every sample finished; or the parent did before the fork (aborted or failed), so no
        other sample will ever run."""
        if self.unforked:
            return self.members[0].finished
        return all(m.finished for m in self.members)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None  # sum of its tokens' logprobs, when they were computed


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # as vLLM's: None for the first token

    # The single-completion shortcuts most callers want.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache (vLLM's RequestOutput field of that name)."""
        return self.metrics.num_cached_prompt_tokens


PROMPT_KEYS = ("prompt", "prompt_token_ids")  # vLLM's TextPrompt and TokensPrompt
OPTIONAL_PROMPT_KEYS = ("cache_salt",)  # vLLM's too


def unpack_prompt(prompt) -> tuple[object, str | None]:
    """vLLM's prompt dicts, {"prompt": text} or {"prompt_token_ids": ids}, with an optional
    "cache_salt" (a non-empty string: only prompts with the same salt share cached prefix blocks),
    as (the text or ids they hold, the salt); anything else as (itself, None) (the engine checks
    it). Keys for inputs Ponytail does not take (multi_modal_data, prompt_embeds, ...) are refused,
    never dropped."""
    if not isinstance(prompt, dict):
        return prompt, None
    given = [key for key in PROMPT_KEYS if key in prompt]
    extra = sorted(set(prompt) - set(PROMPT_KEYS) - set(OPTIONAL_PROMPT_KEYS))
    if extra or len(given) != 1:
        raise ConfigError(f"prompt dict with keys {sorted(prompt)}: allowed: exactly one of {list(PROMPT_KEYS)}"
                          f", and optionally {list(OPTIONAL_PROMPT_KEYS)}"
                          + (f" ({', '.join(extra)} not supported)" if extra else ""))
    salt = prompt.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ConfigError(f"cache_salt={salt!r:.80} is invalid; allowed: a non-empty string, or None")
    return prompt[given[0]], salt


def truncated_prompt(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: only the prompt's last `keep` tokens run (-1: max_model_len's
    worth); None keeps them all."""
    if keep is None:
        return token_ids
    keep = max_model_len if keep == -1 else keep
    return token_ids[-keep:] if len(token_ids) > keep else token_ids


def checked_prompt_ids(prompt, tokenizer, vocab_size: int) -> list[int]:
    """Text tokenized as the engine does (special tokens added); token ids checked against the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ConfigError("this engine has no tokenizer (tokenizer=None): give prompts as token ids")
        if not prompt:
            raise ConfigError("prompt='' is empty; give at least one token")
        return tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise ConfigError(f"prompt must be a non-empty string or list of token ids, got {prompt!r:.60}")
    if set(map(type, prompt)) == {int} and min(prompt) >= 0 and max(prompt) < vocab_size:
        return list(prompt)  # checked in C; the walk below (~20 ms per 100k ids) only names bad ids
    bad = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise ConfigError(f"prompt={bad[:5]!r:.80}: token ids outside the vocabulary; "
                          f"allowed: token ids in [0, {vocab_size})")
    return list(prompt)
