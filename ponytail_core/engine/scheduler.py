"""Iteration-level scheduling: which requests compute which tokens in the next step.

Each step has a token budget. Running requests go first, oldest first: a decoding request needs
one token, one still in (chunked) prefill takes what the budget leaves. When the pool cannot give
a running request its next slot, the newest running request is preempted (its blocks are freed
and it is recomputed later; its full blocks stay in the prefix cache, so recompute is often
cheap). Waiting requests are then admitted in arrival order (FCFS: nobody jumps the queue, so
nobody starves) while their whole prompt fits with a watermark of free blocks to spare. With a
context_cost (chunk_cost.py) a prefill chunk counts its attention over cached context too, so
the late chunks of a long prompt get fewer tokens; decode rows count one token each. A request
that could never fit is refused when it is added, so the queue cannot deadlock. With policy
"priority" (vLLM's scheduling_policy) the queue is ordered by (priority, arrival), lower first, and
the victim of a preemption is the running request with the largest (priority, arrival) among those
not yet given a slot this step; nothing running is preempted to admit a waiting request. A request with
several samples (n > 1, best_of) is admitted alone but takes running slots for all of them; the
engine forks the others when its prefill ends and hands them over with `adopt`.

prefill_delay_factor (vLLM v0's scheduler_delay_factor): a step that carries a prefill runs its
forward pass without CUDA graphs, several times as long as a decode step for a small model. Under
streaming traffic a prompt arrives every step or two, so without a delay nearly every step is one
of those. While requests decode, new prompts wait until the oldest has waited factor x what a step
with a prompt costs beyond the graph replay it displaces, at the step's decode rows (measured at
start-up, runner/step_overhead.py: all that sharing a step saves), or x the last prefill step's
duration where that was not measured; at most MAX_PREFILL_DELAY_S. Prompts that arrive close
together share one such step, and the decode steps between them replay graphs. Prompts that
already fill a step (its token budget or its free seats) never wait: no later prompt could join.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..config import SchedulerConfig, TuningConfig
from ..errors import ConfigError, ContextLengthError
from ..kv.paged_cache import PagedKVCache
from ..runner.inputs import ScheduledChunk
from ..runner.step_overhead import StepOverhead
from .chunk_cost import chunk_cost, chunk_tokens
from .request import Request, RequestStatus
from .shared_prefill import PendingPrefixes
from .stats import BlockPromises
from ..utils.arith import cdiv


MAX_PREFILL_DELAY_S = 0.1  # the most a prompt is held for others to join it (a TTFT cost)


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]  # running requests first (oldest first), then the ones admitted

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, cache: PagedKVCache, config: SchedulerConfig, tuning: TuningConfig, max_model_len: int,
                 watermark: float = 0.01, context_cost: float = 0.0, step_overhead: StepOverhead | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """config and tuning resolved (EngineConfig.resolved): every budget is a number."""
        self.policy = config.scheduling_policy
        self.cache = cache
        self.prefill_delay_factor = tuning.prefill_delay_factor
        self.step_overhead = step_overhead  # what sharing a prefill step saves; None: weigh the last one's duration
        self.clock = clock  # the clock of Request.metrics.arrival_time
        self.prefill_step_s = 0.0  # how long the last step with a prefill took (schedule call to the next)
        self._prefill_scheduled_at: float | None = None
        self.context_cost = context_cost  # chunk_cost.context_cost, or 0: every token counts one
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.prefill_only_batched_tokens = tuning.prefill_only_batched_tokens  # a step where nobody decodes
        self.max_model_len = max_model_len
        self.watermark_blocks = int(watermark * cache.max_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.promises = BlockPromises(cache.config.block_size)  # kept as requests come, run and go

    # ------------------------------------------------------------- requests
    def check_fits(self, request: Request) -> None:
        """Refuse at once what could never run, instead of letting it wait forever."""
        if isinstance(request.priority, bool) or not isinstance(request.priority, int):
            raise ConfigError(f"priority={request.priority!r:.40} is invalid; allowed: an integer (lower runs first)")
        if request.priority and self.policy == "fcfs":
            raise ConfigError(f"priority={request.priority!r} needs scheduling_policy='priority'; allowed: 0 under "
                              "'fcfs' (first come, first served)")
        need = len(request.prompt_token_ids) + request.params.max_tokens
        if need > self.max_model_len:
            raise ContextLengthError(f"prompt ({len(request.prompt_token_ids)} tokens) + max_tokens "
                                     f"({request.params.max_tokens}) = {need} exceeds max_model_len={self.max_model_len}",
                                     len(request.prompt_token_ids), request.params.max_tokens, self.max_model_len)
        bs = self.cache.config.block_size
        capacity = self.cache.max_blocks
        if cdiv(need, bs) > capacity:
            raise ConfigError(f"prompt + max_tokens = {need} tokens needs {cdiv(need, bs)} KV blocks, but the whole "
                              f"cache holds {capacity}; raise kv_cache_memory or lower max_tokens")
        samples = request.seqs_to_come  # they need not fit together: a sample preempted is recomputed
        if samples > 1:
            name = "best_of" if request.group.params.ranks_samples else "n"
            if samples > self.max_num_seqs:
                raise ConfigError(f"{name}={samples} is more sequences than this engine runs at once; allowed: at "
                                  f"most max_num_seqs={self.max_num_seqs}")

    def add(self, request: Request) -> None:
        self.check_fits(request)
        self._queue(request)
        self.promises.queued(request)

    def _queue(self, request: Request, front: bool = False) -> None:
        """Into the waiting queue: FCFS at the back (a preempted request at the front), else by
        (priority, arrival)."""
        if self.policy == "fcfs":
            self.waiting.appendleft(request) if front else self.waiting.append(request)
            return
        key = _rank(request)
        self.waiting.insert(next((i for i, r in enumerate(self.waiting) if _rank(r) > key), len(self.waiting)),
                            request)

    def adopt(self, request: Request) -> None:
        """A sample the engine forked from a running parent (its blocks are in the cache already)
        runs from now on; the parent's admission kept its slot."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self.promises.queued(request)
        self.promises.started(request)

    def remove(self, request: Request) -> None:
        """Drop a finished or aborted request and give its blocks back."""
        if request in self.running:
            self.running.remove(request)
            self.cache.free(request.request_id)
            self.promises.left(request, running=True)
        elif request in self.waiting:
            self.waiting.remove(request)
            self.promises.left(request, running=False)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------- schedule
    def schedule(self, step_in_flight: bool = False) -> SchedulerOutput | None:
        """The next step's chunks.

        step_in_flight: the engine launched a step it has not read back (async scheduling), so
        the tokens it samples are placeholders. Requests whose last token it samples are left
        out, and nobody is preempted (a preempted request is recomputed from its tokens): when
        a running request needs a block the pool cannot give, None is returned. The slots
        reserved until then stay reserved; calling again later schedules from there.
        """
        now = self.clock() if self.prefill_delay_factor else 0.0
        if self._prefill_scheduled_at is not None:
            self.prefill_step_s = now - self._prefill_scheduled_at
            self._prefill_scheduled_at = None
        budget = self._step_budget(step_in_flight)
        chunks: list[ScheduledChunk] = []
        preempted = prefilling = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if step_in_flight and request.reached_max_tokens:  # it finishes with the step in flight
                i += 1
                continue
            if not self._reserve_next(request):
                if step_in_flight:
                    return None
                victim = len(self.running) - 1 if self.policy == "fcfs" else max(  # the newest, or the least urgent
                    range(i, len(self.running)), key=lambda j: _rank(self.running[j]))
                self._preempt(self.running.pop(victim))
                preempted = True
                continue  # retry the same request (or stop if it was the victim)
            chunk, used = self._next_chunk(request, request.num_tokens - request.num_computed_tokens, budget)
            chunks.append(chunk)
            prefilling = prefilling or chunk.num_tokens > 1
            budget -= used
            i += 1
        running = len(chunks)
        if not preempted and not self._hold_prompts(chunks, prefilling, now, budget):
            self._admit(chunks, budget)
        if self.prefill_delay_factor and (prefilling or any(c.num_tokens > 1 for c in chunks[running:])):
            self._prefill_scheduled_at = now
        return SchedulerOutput(chunks=chunks)

    def _step_budget(self, step_in_flight: bool) -> int:
        """max_num_batched_tokens where a running sequence decodes this step, else (only prompt chunks:
        no stream's next token waits on the step) prefill_only_batched_tokens. A request the step in
        flight finishes is not scheduled, so it decodes nothing."""
        if self.prefill_only_batched_tokens == self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        for request in self.running:  # decoders come first (admission order): this stops early when any run
            if request.num_tokens - request.num_computed_tokens <= 1 and not (step_in_flight
                                                                              and request.reached_max_tokens):
                return self.max_num_batched_tokens
        return self.prefill_only_batched_tokens

    def _hold_prompts(self, chunks: list[ScheduledChunk], prefilling: bool, now: float, budget: int) -> bool:
        """Whether waiting prompts sit out this step: it is all decode rows (a graph step), the
        oldest prompt has waited less than prefill_delay_factor x what a prefill step would cost
        beyond this one (the step overhead at its rows, else the last prefill step's duration), and
        the prompts waiting now would not fill the step anyway (the wait only lets later prompts
        join the step; when those waiting already take its whole token budget or every free seat,
        it adds latency and nothing else)."""
        if not (self.prefill_delay_factor and self.waiting and chunks) or prefilling:
            return False
        cost = self.step_overhead.at(len(chunks)) if self.step_overhead is not None else self.prefill_step_s
        delay = min(self.prefill_delay_factor * cost, MAX_PREFILL_DELAY_S)
        if now - self.waiting[0].metrics.arrival_time >= delay:
            return False
        return not self._waiting_fill_step(budget)

    def _waiting_fill_step(self, budget: int) -> bool:
        """Whether the waiting prompts, admitted in order, would use the rest of the step's token
        budget or its free seats. A prompt counts its tokens not yet computed, one budget unit each:
        prefix-cache hits are not looked up (a hash walk per prompt per step) and context costs
        (chunk_cost.py) are not added, so this is an estimate, not the admission itself."""
        seats = self.max_num_seqs - self._seats_taken()
        for request in self.waiting:
            seats -= request.seqs_to_come
            budget -= request.num_tokens - request.num_computed_tokens  # no list copy, as all_token_ids makes
            if budget <= 0 or seats <= 0:
                return True
        return False

    def _reserve_next(self, request: Request) -> bool:
        """Slots for tokens the request has but the cache has not reserved (the last sampled one)."""
        held = self.cache.seq_len(request.request_id)
        if held == request.num_tokens:
            return True
        return bool(self.cache.append(request.request_id, request.token_slice(held)))

    def _seats_taken(self) -> int:
        """Sequences the running requests hold: a parent holds its unforked samples' seats."""
        return sum(r.seqs_to_come for r in self.running)

    def _admit(self, chunks: list[ScheduledChunk], budget: int) -> None:
        seats = self._seats_taken()
        pending: PendingPrefixes | None = None  # built at the first prompt that may share a prefix (shared_prefill.py)
        held: list[Request] = []  # prompts waiting a step for a prefix this one computes: they keep their place
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if seats + request.seqs_to_come > self.max_num_seqs:
                break
            tokens = request.all_token_ids
            # The last token is always computed: its logits give the next token. Prompt logprobs
            # need the logits of every prompt position not yet scored: those are computed too.
            max_cached = len(tokens) - 1
            if request.prompt_logits_from is not None:
                max_cached = min(max_cached, request.prompt_logits_from)
            result = self.cache.allocate(request.request_id, tokens, max_cached_tokens=max_cached,
                                         cache_salt=request.cache_salt)
            if not result:
                break
            if self.running and self.cache.available_blocks < self.watermark_blocks:
                self.cache.free(request.request_id)  # keep headroom for running requests to decode
                break
            if self.cache.allocator.enable_prefix_caching and request.prompt_logits_from is None:  # it uses the cache
                if pending is None:
                    pending = PendingPrefixes(self.cache, ((c.request.request_id, c.request.num_tokens)
                                                           for c in chunks if c.num_tokens > 1))
                if pending.holds_back(request.request_id, len(tokens), result.num_cached_tokens):
                    self.cache.free(request.request_id)  # the next step finds that prefix cached
                    held.append(self.waiting.popleft())
                    continue
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = result.num_cached_tokens
            if request.metrics.num_preemptions == 0:
                request.metrics.num_cached_prompt_tokens = result.num_cached_tokens
            self.running.append(request)
            seats += request.seqs_to_come
            self.promises.started(request)
            chunk, used = self._next_chunk(request, len(tokens) - request.num_computed_tokens, budget)
            chunks.append(chunk)
            budget -= used
        self.waiting.extendleft(reversed(held))

    def _next_chunk(self, request: Request, want: int, budget: int) -> tuple[ScheduledChunk, int]:
        """The request's next chunk within `budget` (> 0) and the budget it takes: a decode row one
        token, a prefill chunk what the budget leaves by its chunk_cost (chunk_cost.py)."""
        start = request.num_computed_tokens
        n = 1 if want == 1 else chunk_tokens(want, start, budget, self.context_cost)
        return self._chunk(request, n), (1 if n == 1 else chunk_cost(n, start, self.context_cost))

    def _chunk(self, request: Request, n: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        slots = self.cache.slots(request.request_id, start, start + n)
        return ScheduledChunk(request=request, start=start, num_tokens=n, slots=slots)

    def _preempt(self, request: Request) -> None:
        self.cache.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self._queue(request, front=True)
        self.promises.preempted(request)


def _rank(request: Request) -> tuple[int, float]:
    """Lower runs first under the priority policy (vLLM's order)."""
    return request.priority, request.metrics.arrival_time
