"""What one API request may ask for: bounds the ingress checks before any heavy work.

Each is an app arg (app.yaml `args:`) with the default below. The body size is checked by the HTTP
guard (http_guard.py) before the body is parsed; the rest after parsing, before the request goes
to an engine replica. A text prompt's token count is known only once the replica tokenizes it (in
a worker thread), so that check runs there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class LimitExceeded(Exception):
    """A request over one of the limits; the API answers `status` naming `param`."""

    def __init__(self, message: str, param: str, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


@dataclass(slots=True)
class RequestLimits:
    max_body_bytes: int = 4 << 20  # 413 beyond; a 128k-token prompt is ~0.5 MB of text
    max_prompt_tokens: int | None = None  # None: the context (max_model_len)
    max_output_tokens: int | None = None  # max_tokens a request may ask; None: the context
    max_n: int = 16  # samples per prompt: n and best_of (each takes a running sequence slot)
    max_stop: int = 16  # stop strings per request (OpenAI allows 4)
    max_stop_chars: int = 256  # characters per stop string

    def __post_init__(self):
        for name in ("max_body_bytes", "max_n", "max_stop", "max_stop_chars"):
            _positive(name, getattr(self, name), optional=False)
        for name in ("max_prompt_tokens", "max_output_tokens"):
            _positive(name, getattr(self, name), optional=True)

    def output_bound(self, max_model_len: int) -> int:
        """The most tokens a request may generate: the context, or max_output_tokens when smaller."""
        return max_model_len if self.max_output_tokens is None else min(self.max_output_tokens, max_model_len)

    def check(self, request: Any, max_model_len: int, max_tokens_field: str = "max_tokens") -> None:
        """Raise LimitExceeded for the first limit a parsed OpenAI request breaks."""
        for name in ("n", "best_of"):
            value = getattr(request, name, None)
            if value is not None and value > self.max_n:
                raise LimitExceeded(f"{name}={value} is more than this server allows: at most {self.max_n} "
                                    "(max_n)", name)
            if value is not None and value < 1:  # the server's range, not SamplingParams' wider one
                raise LimitExceeded(f"{name}={value} is invalid; allowed: an integer in [1, {self.max_n}] (max_n)",
                                    name)
        stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
        if len(stop) > self.max_stop:
            raise LimitExceeded(f"stop has {len(stop)} strings; allowed: at most {self.max_stop} (max_stop)", "stop")
        longest = max((len(s) for s in stop), default=0)
        if longest > self.max_stop_chars:
            raise LimitExceeded(f"stop has a string of {longest} characters; allowed: at most "
                                f"{self.max_stop_chars} (max_stop_chars)", "stop")
        max_tokens = getattr(request, max_tokens_field, None)
        bound = self.output_bound(max_model_len)
        by = "the model's context" if self.max_output_tokens is None else "max_output_tokens"
        if max_tokens is not None and max_tokens > bound:
            raise LimitExceeded(f"{max_tokens_field}={max_tokens} is more than {by} allows: at most {bound} "
                                f"(max_model_len={max_model_len})", max_tokens_field,
                                code="context_length_exceeded")
        prompt = getattr(request, "prompt", None)
        if getattr(request, "truncate_prompt_tokens", None) is not None:
            prompt = None  # the replica keeps only what fits (or refuses a truncate_prompt_tokens beyond it)
        most = self.prompt_tokens(max_model_len)
        batch = isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt)
        for one in (prompt if batch else [prompt]):  # a completions request may carry a list of prompts
            if isinstance(one, list) and len(one) > most:
                raise LimitExceeded(f"prompt has {len(one)} tokens; allowed: at most {most} "
                                    f"(max_model_len={max_model_len})", "prompt", code="context_length_exceeded")

    def prompt_tokens(self, max_model_len: int) -> int:
        """The most prompt tokens a request may have."""
        return max_model_len if self.max_prompt_tokens is None else min(self.max_prompt_tokens, max_model_len)


def _positive(name: str, value: Any, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "an integer >= 1" + (" or null (the context)" if optional else "")
        raise ValueError(f"{name}={value!r} is not supported; allowed: {allowed}")
