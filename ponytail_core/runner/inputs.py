"""What the runner takes for one step: scheduled chunks of requests, typed by what it reads of them.

The scheduler (engine/) builds these; the runner depends only on the `StepRequest` protocol, not
on the engine's `Request`, so imports run downward (runner < engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class StepRequest(Protocol):
    """What the runner reads of a request (engine.request.Request is one)."""

    request_id: str  # its sequence in the KV pool
    pending_row: int | None  # async scheduling: its last token is row `pending_row` of the step in flight
    prompt_token_ids: list[int]
    prompt_logits_from: int | None  # prompt_logprobs: keep logits from this prompt position on (None: none)

    @property
    def num_tokens(self) -> int: ...  # prompt + output tokens so far

    def token_slice(self, start: int, end: int | None = None) -> list[int]: ...  # prompt + output ids [start:end]


@dataclass(slots=True)
class ScheduledChunk:
    """Tokens start .. start + num_tokens - 1 of one request, computed in one step."""

    request: StepRequest
    start: int  # position of the first token computed in this step
    num_tokens: int  # tokens computed in this step
    slots: list[int]  # cache slot of each of those tokens

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last known token: a new token is sampled after it."""
        return self.start + self.num_tokens == self.request.num_tokens
