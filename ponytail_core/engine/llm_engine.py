"""The continuous-batching engine: schedule, run the model once, sample, detokenize, repeat.

Async scheduling (vLLM v1's) keeps the device busy while the host works: step N+1 is scheduled
and launched before step N's sampled tokens are read back. A request sampling in a launched step
gets a placeholder output token, so the scheduler reserves its next slot, and step N+1 takes
the real token from step N's samples on the device. Reading step N back turns placeholders into
tokens, in the request and in the block allocator, before step N+1's blocks are offered to the
prefix cache; a request that stopped at step N (EOS, stop string, NaN logits, abort) drops its
step N+1 token, and that row is ignored. Step N is read back before step N+1 is built when a
row of it applied penalties or when the scheduler must preempt (see step()).

A row with a grammar (structured outputs) needs step N's token in its matcher before its step
N+1 mask exists: when step N+1 has such a row, its forward pass is launched first, step N is read
back while it runs, and only then are the masks filled and step N+1 sampled. Free rows in the
same batch lose nothing but that wait; the device stays busy with the forward pass meanwhile.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
import logging
import time
from dataclasses import dataclass

import torch

from .detokenizer import IncrementalDetokenizer, make_detokenizer
from ..config import EngineConfig
from ..errors import ConfigError
from ..runner.model_runner import ModelRunner
from ..kv.paged_cache import PagedKVCache
from .request import (PLACEHOLDER_TOKEN, Request, RequestOutput, checked_prompt_ids, truncated_prompt,
                      unpack_prompt)
from ..sampling.grammar import GrammarCompiler, RequestGrammar
from ..sampling.sampler import HostSamples, SamplerOutput, request_generator, sample
from ..sampling.params import SamplingParams
from ..sampling.logprob import TokenTexts
from ..runner.inputs import ScheduledChunk
from .samples import deferred_output, fork_samples, request_output, start_group
from .scheduler import Scheduler
from .chunk_cost import context_cost
from .logprobs import logprob_entry, record_prompt_logprobs
from .stats import EngineStats
from .step_sampling import StepBatches
from ..utils.arith import cdiv

logger = logging.getLogger("ponytail.engine")


@dataclass(slots=True)
class StepOutput:
    """What one step did to one request: the text and tokens it added."""

    request: Request  # with several samples (n > 1, best_of), the one that produced this
    new_token_ids: list[int]
    delta_text: str
    finished: bool  # this sequence finished; done: the whole request (every sample), on its last output
    done: bool = False


@dataclass(slots=True)
class _Launched:
    """A step whose forward pass and sampling are queued on the device, results not read yet."""

    chunks: list[ScheduledChunk]
    requests: list[Request]  # the sampling requests, in row order
    indexes: list[int]  # per row: where its placeholder sits in request.output_token_ids
    result: SamplerOutput | None  # on the device (the next step takes its inputs from token_ids)
    host: HostSamples | None  # the same, on its way to the host
    penalized: bool  # some row applied penalties, which read its history: no step may overlap it
    rescheduled: bool = False  # the scheduler ran since: the cache may hold this step's placeholders


class LLMEngine:
    """async_scheduling: launch step N+1 before reading step N's tokens back, so the device always
    has queued work while the host processes outputs and schedules (vLLM v1's async scheduling).
    Outputs are the same as without it. `cache` is the KV pool (LLM sizes it); `config` is resolved
    (EngineConfig.resolved): the runner and the scheduler each take their part of it."""

    MAINTAIN_EVERY = 16  # steps between pool maintenance (grow / defragment / give memory back)

    def __init__(self, model, tokenizer, cache: PagedKVCache, config: EngineConfig):
        self.model, self.tokenizer = model, tokenizer
        self.max_model_len = config.model.max_model_len
        self.cache = cache
        self.runner = ModelRunner(model, self.cache, config.runner, config.tuning,
                                  max_num_seqs=config.scheduler.max_num_seqs, max_model_len=self.max_model_len,
                                  max_step_tokens=max(config.scheduler.max_num_batched_tokens,
                                                      config.tuning.prefill_only_batched_tokens))
        cost = context_cost(model.config.get_text_config()) if config.tuning.context_aware_chunks else 0.0
        self.scheduler = Scheduler(self.cache, config.scheduler, config.tuning, self.max_model_len, context_cost=cost,
                                   step_overhead=self.runner.step_overhead)
        self.vocab_size = model.config.get_text_config().vocab_size
        eos = getattr(model.generation_config, "eos_token_id", None)
        if eos is None and tokenizer is not None:
            eos = tokenizer.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.async_scheduling = config.runner.async_scheduling
        # Structured outputs compile in the compiler's own thread (it starts none until asked).
        self.grammars = (GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids)
                         if tokenizer is not None else None)
        self._in_flight: _Launched | None = None  # async scheduling: the step launched, not read back
        self.requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._generators: dict[str, torch.Generator | None] = {}
        self._batches = StepBatches(self._generators, self.eos_token_ids, tokenizer)  # each step's SamplingBatch
        self._texts = TokenTexts(tokenizer)  # logprobs' decoded_token
        self._ids = itertools.count()
        self._steps = self._prefix_queries = self._prefix_hits = 0

    # ------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0) -> Request:
        """Check, tokenize and queue a request; ConfigError names what is wrong.

        With structured_outputs this waits for the grammar's compile (cached per schema) in the
        caller's thread; AsyncLLM waits on its event loop instead, so no step ever waits.
        """
        request = self.prepare_request(prompt, params, request_id, priority)
        self.enqueue(request)
        return request

    def prepare_request(self, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                        request_id: str | None = None, priority: int = 0) -> Request:
        """add_request's checks, no engine state touched (any thread may call it); prompt dicts: vLLM's."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"params must be a ponytail.SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ConfigError(f"stop={params.stop!r} needs text, but this engine has no tokenizer; "
                              "use stop_token_ids")
        params = self._batches.checked(params, self.vocab_size)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ConfigError(f"request_id={request_id!r} is already in use")
        prompt, salt = unpack_prompt(prompt)
        request = Request(request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
                          prompt_token_ids=self.prompt_token_ids(prompt, params.truncate_prompt_tokens), params=params,
                          eos_token_ids=self.eos_token_ids, cache_salt=salt, priority=priority)
        start_group(request)  # n > 1 / best_of: the request's first sample, the others fork from it
        self.scheduler.check_fits(request)  # refuses what can never fit
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise ConfigError("structured_outputs needs a tokenizer, but this engine has none (tokenizer=None)")
            request.grammar_ready = self.grammars.submit(params.structured_outputs)
        return request

    def enqueue(self, request: Request) -> None:
        """Queue a prepared request (the engine's thread only). A grammar still compiling is waited
        for here: callers that must not wait (AsyncLLM) wait for request.grammar_ready first."""
        if request.request_id in self.requests:
            raise ConfigError(f"request_id={request.request_id!r} is already in use")
        if request.grammar_ready is not None and request.grammar is None:
            request.grammar = RequestGrammar(request.grammar_ready.result())  # ConfigError if it failed
        self.scheduler.add(request)
        self.requests[request.request_id] = request
        self.track(request)

    def track(self, request: Request) -> None:  # a sequence's detokenizer and generator
        self._detokenizers[request.request_id] = make_detokenizer(self.tokenizer, request.prompt_token_ids,
                                                                  request.params)
        self._generators[request.request_id] = request_generator(request.params, self.cache.config.device)

    def prompt_token_ids(self, prompt, keep: int | None = None) -> list[int]:
        """A prompt's token ids as the engine runs them: text tokenized, ids checked, the last `keep` kept."""
        return truncated_prompt(checked_prompt_ids(prompt, self.tokenizer, self.vocab_size), keep, self.max_model_len)

    def abort(self, request_id: str) -> bool:
        """Stop a request now (every sample); its blocks go back to the pool. False if unknown or done."""
        request = self.requests.get(request_id)
        if request is None or request.done:
            return False
        for member in [m for m in request.members if not m.finished]:
            member.finish("abort")
            member.drop_placeholder()  # a step in flight still samples for it: that row is ignored
            self._release(member)
        return True

    def has_unfinished(self) -> bool:
        """Requests wait or run, or a launched step is still to be read back."""
        return self._in_flight is not None or self.scheduler.has_work

    # ---------------------------------------------------------------- step
    def step(self) -> list[StepOutput]:
        """Schedule and run one step; returns what the requests produced.

        With async scheduling the step is launched and left running on the device: what is
        returned is the previous step's results, read back and processed while this one runs.
        """
        outputs: list[StepOutput] = []
        if self._in_flight is not None and self._in_flight.penalized:
            # Penalties read each row's output history on the host side (SamplingBatch.build):
            # the previous step's tokens must be real before the next batch is built.
            outputs = self._finish_in_flight()
        if self._in_flight is None:
            scheduled = self.scheduler.schedule()
        else:
            self._in_flight.rescheduled = True  # slots may now hold its placeholders
            scheduled = self.scheduler.schedule(step_in_flight=True)
        if scheduled is None:
            # The pool is full and a request must be preempted, which recomputes it from its
            # tokens: all of them must be known, so the step in flight is read back first.
            outputs = self._finish_in_flight()
            scheduled = self.scheduler.schedule()
        launched = None
        if scheduled.chunks:
            logits = self._forward(scheduled.chunks)
            if self._in_flight is not None and _constrained(scheduled.chunks):
                # Grammar masks need the tokens of the step in flight: read it back while this
                # step's forward pass runs, then mask and sample.
                outputs = self._finish_in_flight()
            launched = self._sample(scheduled.chunks, logits)
        if self._in_flight is not None:
            outputs = self._finish_in_flight()  # while the step just launched runs
        if launched is not None:
            # Offer the new full blocks to the prefix cache only now: the placeholders the
            # previous step left in them were just replaced by real tokens.
            for chunk in launched.chunks:
                if not chunk.request.finished:
                    self.cache.mark_computed(chunk.request.request_id, chunk.request.num_computed_tokens)
            self._in_flight = launched
            if not self.async_scheduling:
                outputs = self._finish_in_flight()
            self._steps += 1
            if self._steps % self.MAINTAIN_EVERY == 0:
                self.maintain()
        return outputs

    def maintain(self) -> None:
        """The pool's maintenance: every MAINTAIN_EVERY steps, and from AsyncLLM when idle (so
        memory spare for `cache.release_after_s` goes back even when no step runs)."""
        # Decoding requests take at most a block each per block_size steps until the next run.
        per_request = cdiv(self.MAINTAIN_EVERY, self.cache.config.block_size)
        self.cache.maintain(reserve_blocks=len(self.scheduler.running) * per_request)

    def _forward(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Queue the model forward of a step; returns its logits (on the device, not read)."""
        for chunk in chunks:
            if chunk.request.metrics.first_scheduled_time is None:
                chunk.request.metrics.first_scheduled_time = time.monotonic()
                self._prefix_queries += len(chunk.request.prompt_token_ids)
                self._prefix_hits += chunk.request.metrics.num_cached_prompt_tokens
        prev = self._in_flight
        if prev is None or prev.result is None:
            logits = self.runner.execute(chunks)
        else:
            logits = self.runner.execute(chunks, prev.result.token_ids)
        # Right after the forward (before num_computed_tokens moves): the prompt rows go, the sampling rows stay.
        logits = record_prompt_logprobs(chunks, logits, sum(1 for chunk in chunks if chunk.samples), self._texts)
        for chunk in chunks:
            chunk.request.num_computed_tokens += chunk.num_tokens
        return logits

    def _sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> _Launched:
        """Queue the sampling of a step; read nothing back.

        Every sampling request gets a placeholder token at the end of its output (so the
        scheduler reserves its slot for the next step) and `pending_row`, its row in the sampled
        tokens, from which the next step takes its input on the device. A request that finished
        since the forward pass was launched (its grammar row forced the previous step to be read
        back first) still has a row, sampled and ignored.
        """
        requests = [chunk.request for chunk in chunks if chunk.samples]
        if not requests:
            return _Launched(chunks, [], [], None, None, penalized=False)
        requests, logits = fork_samples(self, requests, logits)  # n > 1: prefills that just ended fork
        live = [not r.finished for r in requests]  # a finished row samples greedily, for nobody
        batch = self._batches.build(requests, live, logits.shape[1], logits.device)
        result = sample(logits, batch)
        host = result.to_host(with_logprobs=batch.max_logprobs is not None)
        indexes = []
        promises = self.scheduler.promises
        for row, request in enumerate(requests):
            indexes.append(len(request.output_token_ids))
            if request.finished:
                continue
            request.output_token_ids.append(PLACEHOLDER_TOKEN)
            request.pending_row = row
            promises.grew(request)
        return _Launched(chunks, requests, indexes, result, host, penalized=batch.output_tokens is not None)

    def _finish_in_flight(self) -> list[StepOutput]:
        launched, self._in_flight = self._in_flight, None
        return self._finish(launched)

    def _finish(self, launched: _Launched) -> list[StepOutput]:
        """Read a launched step's samples back and turn them into outputs (tokens, text, stops)."""
        if not launched.requests:
            return []
        host = launched.host
        host.wait()  # the step's one host sync
        tokens = host.token_ids.tolist()
        bad = host.bad_rows.tolist()
        chosen_logprobs = host.logprobs.tolist() if host.logprobs is not None else None
        now = time.monotonic()
        outputs = []
        for row, (request, index, token) in enumerate(zip(launched.requests, launched.indexes, tokens)):
            if request.finished:  # aborted while the step ran
                continue
            out = request.output_token_ids
            if bad[row]:
                self._fail(request, index, "the model produced NaN or inf logits, or the request's allowed_token_ids, "
                           "bad_words and min_tokens left no token to take; the request was stopped")
                outputs.append(StepOutput(request, [], "", True, request.done))
                continue
            out[index] = token
            if len(out) == index + 1:  # not in the step launched since: every token is known
                request.pending_row = None
            if request.grammar is not None and not request.grammar.accept(token):
                self._fail(request, index, f"token {token} does not match the request's structured_outputs")
                outputs.append(StepOutput(request, [], "", True, request.done))
                continue
            if chosen_logprobs is not None and request.params.logprobs is not None:
                request.cumulative_logprob += chosen_logprobs[row]
                request.logprobs = request.logprobs or []
                request.logprobs.append(logprob_entry(host, row, token, chosen_logprobs[row],
                                                      request.params, self._texts))
            metrics = request.metrics
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
            request.check_stop_token(token, index + 1)
            detok = self._detokenizers[request.request_id]
            hide = (request.finished and request.finish_reason == "stop"
                    and not request.params.include_stop_str_in_output)
            delta = detok.step([] if hide else [token])  # EOS / stop token: no text, as in vLLM
            if detok.finished_by_stop is not None and not request.finished:
                request.finish("stop", detok.finished_by_stop)
            if request.finished:
                delta += detok.flush()
                request.drop_placeholder()  # the step launched since computes a token nobody reads
                self._release(request)
            elif launched.rescheduled:
                position = len(request.prompt_token_ids) + index
                if position < self.cache.seq_len(request.request_id):  # the next step reserved its slot
                    self.cache.replace_token(request.request_id, position, token)
            outputs.append(StepOutput(request, [token], delta, request.finished, request.done))
        return outputs

    def _fail(self, request: Request, index: int, error: str) -> None:
        """End a request with an error at output position `index` (the token read back there)."""
        del request.output_token_ids[index:]  # this step's token, and the next step's placeholder
        request.pending_row = None
        request.error = error
        request.finish("error")
        logger.error("request %s: %s", request.request_id, request.error)
        self._release(request)

    def _release(self, request: Request) -> None:
        self.scheduler.remove(request)
        self._generators.pop(request.request_id, None)

    # ------------------------------------------------------------- results
    def output(self, request: Request) -> RequestOutput:
        """A request's output so far: one completion per sample (see samples.returned for best_of)."""
        return request_output(request, lambda member: self._detokenizers[member.request_id].text)

    def output_later(self, request: Request) -> Callable[[], RequestOutput]:
        """output(request) as it stands now, built when called (a running request of one sample)."""
        return deferred_output(request, self._detokenizers[request.request_id].text)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's bookkeeping once its output was delivered."""
        request = self.requests.pop(request_id, None)
        for member in (request.members if request is not None else []):
            self._detokenizers.pop(member.request_id, None)

    def stats(self) -> EngineStats:
        """Plain counters: any thread may call it without waiting for a step (the numbers are
        those of the engine's latest change; a report a step stale is corrected by the next)."""
        s = self.cache.stats()
        return EngineStats(total_blocks=s.total_blocks, max_blocks=s.max_blocks, free_blocks=s.free_blocks,
                           admissible_blocks=s.free_blocks + self.cache.growable_blocks,
                           promised_blocks=self.scheduler.promises.total, used_blocks=s.used_blocks,
                           queued_blocks=self.scheduler.promises.queued_total, headroom_blocks=self.scheduler.watermark_blocks,
                           cached_blocks=s.evictable_blocks,
                           num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                           fragmentation=s.fragmentation, num_preemptions=self.scheduler.num_preemptions,
                           num_defragmentations=self.cache.num_defragmentations,
                           num_blocks_moved=self.cache.num_blocks_moved,
                           prefix_cache_queries=self._prefix_queries, prefix_cache_hits=self._prefix_hits,
                           allocated_bytes=s.allocated_bytes)


def _constrained(chunks: list[ScheduledChunk]) -> bool:
    """Some row sampled in this step takes what its tokens so far allow (Request.follows_its_tokens)."""
    return any(chunk.request.follows_its_tokens and chunk.samples for chunk in chunks)
