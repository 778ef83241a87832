"""Parallel sampling (n > 1, best_of): the samples a parent forks, and which of them a request returns.

As vLLM's parallel sampling: the request's first sample (the parent) is queued and prefilled alone;
when its prefill ends the engine forks the others from it. They share the prompt's KV blocks (the
cache's ref-counted fork; a shared partial last block is copied when a sample first writes to
it), sample their first token from the parent's logits row, and run as sequences of their own
from then on: own generator (seed + index), detokenizer, grammar matcher, preemption.
"""

from __future__ import annotations

import time

from .request import Request, RequestMetrics, RequestStatus, SampleGroup


def start_group(parent: Request) -> None:
    """Make `parent` (params: what the caller gave) the first of its request's samples."""
    params = parent.params
    if params.num_samples > 1:
        parent.group = SampleGroup(params=params, members=[parent])
        parent.params = params.member(0)


def fork_members(parent: Request) -> list[Request]:
    """The samples 1 .. size - 1 of a parent whose prefill just ended (not yet known to the cache)."""
    group = parent.group
    now = time.monotonic()
    children = []
    for index in range(len(group.members), group.size):
        metrics = RequestMetrics(parent.metrics.arrival_time, first_scheduled_time=now,
                                 num_cached_prompt_tokens=parent.metrics.num_cached_prompt_tokens)
        children.append(Request(request_id=member_id(parent.request_id, index), prompt=parent.prompt,
                                prompt_token_ids=parent.prompt_token_ids, params=group.params.member(index),
                                eos_token_ids=parent.eos_token_ids, status=RequestStatus.RUNNING,
                                num_computed_tokens=parent.num_computed_tokens, metrics=metrics,
                                index=index, group=group))
    group.members.extend(children)
    return children


def member_id(request_id: str, index: int) -> str:
    """The engine's id for sample `index` (> 0) of a request: its cache sequence, detokenizer, ...
    A NUL can only come from a caller who means to collide; prepare_request refuses it."""
    return f"{request_id}\0{index}"


def returned(group: SampleGroup) -> list[Request]:
    """The samples a request returns, in choice order: all of them by index; with best_of, once
    every sample finished, the n of highest cumulative logprob, best first (vLLM 0.x's best_of)."""
    members = group.members
    if not group.params.ranks_samples or not group.done:
        return list(members)
    return sorted(members, key=lambda m: m.cumulative_logprob, reverse=True)[: group.params.n]
