"""Parallel sampling (n > 1, best_of): the samples a parent forks, and which of them a request returns.

As vLLM's parallel sampling: the request's first sample (the parent) is queued and prefilled alone;
when its prefill ends the engine forks the others from it. They share the prompt's KV blocks (the
cache's ref-counted fork; a shared partial last block is copied when a sample first writes to
it), sample their first token from the parent's logits row, and run as sequences of their own
from then on: own generator (seed + index), detokenizer, grammar matcher, preemption.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..errors import ConfigError
from ..sampling.grammar import RequestGrammar
from ..utils.device import to_device
from .request import CompletionOutput, Request, RequestMetrics, RequestOutput, RequestStatus, SampleGroup


def start_group(parent: Request) -> None:
    """Make `parent` (params: what the caller gave) the first of its request's samples."""
    if "\0" in parent.request_id:  # member_id names the other samples with it
        raise ConfigError(f"request_id={parent.request_id!r:.80} holds a NUL character; allowed: ids without one")
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
                                index=index, group=group, cache_salt=parent.cache_salt, priority=parent.priority))
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


def fork_samples(engine, requests: list[Request], logits: torch.Tensor) -> tuple[list[Request], torch.Tensor]:
    """A step's sampling rows (requests, their logits) once the parents among them whose prefill
    just ended forked their other samples: these follow their parent and sample their first
    token from a copy of its logits row. `engine`: the LLMEngine whose step this is."""
    if not any(r.group is not None and r.group.unforked and not r.finished for r in requests):
        return requests, logits
    expanded, rows = [], []
    for row, request in enumerate(requests):
        expanded.append(request)
        rows.append(row)
        if request.group is not None and request.group.unforked and not request.finished:
            children = _fork(engine, request)
            expanded.extend(children)
            rows.extend([row] * len(children))
    # Pinned and queued (to_device): a pageable copy would make torch wait for the steps in flight.
    return expanded, logits.index_select(0, to_device(torch.tensor(rows), logits.device))


def _fork(engine, parent: Request) -> list[Request]:
    # The prompt's blocks are complete: offer them to the prefix cache before the children copy
    # the parent's bookkeeping, so nobody offers them twice.
    engine.cache.mark_computed(parent.request_id, parent.num_computed_tokens)
    children = fork_members(parent)
    engine.scheduler.promises.forked(parent)  # the children are promised their own blocks as adopted
    for child in children:
        engine.cache.fork(parent.request_id, child.request_id)
        if parent.grammar is not None:  # its own matcher, at the start as the parent's is
            child.grammar = RequestGrammar(parent.grammar_ready.result())
        engine.track(child)  # its detokenizer and generator
        engine.scheduler.adopt(child)
    return children


def deferred_output(request: Request, text: str) -> Callable[[], RequestOutput]:
    """request_output(request) as of now, for a running request of one sample, built only when
    called: what changes is read now (counts, the text, scalars), its token and logprob lists
    later, cut to those counts, as they only grow while it runs. A stream that merges its deltas
    reads one output per message rather than the engine building one per row every step; the
    call may come from another thread while the engine goes on."""
    tokens = len(request.output_token_ids) - (request.pending_row is not None)
    wants_logprobs = request.params.logprobs is not None
    cumulative = request.cumulative_logprob if wants_logprobs else None
    error = request.error

    def build() -> RequestOutput:
        logprobs = request.logprobs if wants_logprobs else None
        if logprobs is not None:
            logprobs = logprobs[:tokens]
        completion = CompletionOutput(index=request.index, text=text, token_ids=request.output_token_ids[:tokens],
                                      finish_reason=None, logprobs=logprobs, cumulative_logprob=cumulative)
        return RequestOutput(request_id=request.request_id, prompt=request.prompt,
                             prompt_token_ids=request.prompt_token_ids, outputs=[completion], finished=False,
                             metrics=request.metrics, error=error, prompt_logprobs=request.prompt_logprobs)
    return build


def request_output(request: Request, text: Callable[[Request], str]) -> RequestOutput:
    """A request's output so far (text(sequence): its detokenized text): one completion per sample
    returned, indexed by sample, or once a ranked (best_of) request is done, by rank."""
    group = request.group
    members = [request] if group is None else returned(group)
    ranked = group is not None and group.params.ranks_samples and group.done
    wants_logprobs = (request.params if group is None else group.params).logprobs is not None
    completions = [CompletionOutput(index=rank if ranked else member.index, text=text(member),
                                    token_ids=list(member.known_output_token_ids),
                                    finish_reason=member.finish_reason, stop_reason=member.stop_reason,
                                    logprobs=member.logprobs if wants_logprobs else None,
                                    # computed when logprobs were (best_of asks for them to rank)
                                    cumulative_logprob=(member.cumulative_logprob
                                                        if member.params.logprobs is not None else None))
                   for rank, member in enumerate(members)]
    return RequestOutput(request_id=request.request_id, prompt=request.prompt,
                         prompt_token_ids=request.prompt_token_ids, outputs=completions,
                         finished=request.done, metrics=request.metrics,
                         error=next((m.error for m in members if m.error is not None), None),
                         prompt_logprobs=request.prompt_logprobs)
