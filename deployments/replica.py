"""One engine replica: owns a device (one GPU, or the CPU) and one Ponytail engine."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import time
from collections.abc import AsyncIterator
from types import MappingProxyType

import ray
from ray import serve

import ponytail
from ponytail import SamplingParams, check_chat_template_options

from .generation_defaults import model_sampling_defaults
from .logprobs import TokenTexts, prompt_logprob_entries, shown_top, token_logprobs
from .metrics import ReplicaMetrics
from .prefix_publisher import LOG_CAPACITY, PrefixPublisher
from .prompts import prompt_token_ids, tokenizer_fingerprint, truncated, use_chat_template, with_template_defaults
from .reasoning import REASONING_PARSERS, THINK, ReasoningTokens, served_reasoning_format, thought_opens
from .tool_parsers import TOOL_CALL_PARSERS, served_tool_call_format
from .segment_tokens import SegmentCache
from .protocol import (BEAM_SEARCH_SAMPLING, STAT_BLOCK_SIZE, STAT_FREE_BLOCKS, STAT_NUM_RUNNING, STAT_NUM_WAITING,
                       STAT_STARTABLE_BLOCKS, STAT_TIME, STAT_TOTAL_BLOCKS, GenerateDelta, GenerateRequest,
                       ModelInfo, ReplicaReport, TokenLogprob)

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
# truncate_prompt_tokens -1 on a request without max_tokens (which would take the rest of the
# context): the prompt's cut leaves this much room for the answer, not a single token.
TRUNCATED_ANSWER_ROOM = 256
logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True, frozen=True)
class PromptSaid:
    """What a request's answer says of its prompt (EngineReplica._prompt_said), once per request."""

    text: str | None  # echo: the prompt's text, which every choice's text starts with
    logprobs: list[TokenLogprob] | None  # echo with logprobs: the prompt tokens', in every choice's logprobs
    entries: list | None  # the prompt_logprobs field, in vLLM's shape (logprobs.prompt_logprob_entries)
    token_ids: list[int] | None = None  # return_token_ids: the prompt's, in every choice's first delta


class EngineReplica:
    """Serve deployment body (see app.py): generate, abort, model_info, record_routing_stats."""

    sampling_defaults = MappingProxyType({})  # fields a request leaves unset; the model's, with generation_config auto
    template_defaults: dict | None = None  # default_chat_template_kwargs

    def __init__(self, model: str | None = None, device: str = "auto", kv_cache_memory: int | str | None = None,
                 max_num_seqs: int = 64, max_model_len: int | None = None, block_size: int = ponytail.DEFAULT_BLOCK_SIZE,
                 model_id: str | None = None, compile_model: bool | None = None, stream_interval_s: float = 0.0,
                 gpu_memory_utilization: float | None = None, max_prompt_tokens: int | None = None,
                 model_alias: str | None = None, max_deltas_per_s: float | None = None,
                 keep_prefix_cache: bool = True, engine_process: bool | None = None,
                 prefill_delay_factor: float | None = None, generation_config: str = "auto",
                 fuse_projections: bool | None = None, prefill_attention: str | None = None,
                 column_major_weights: bool | None = None, chat_template: str | None = None,
                 tool_call_parser: str = "auto", reasoning_parser: str = "auto",
                 default_chat_template_kwargs: dict | None = None, enforce_eager: bool = False,
                 seed: int | None = None, revision: str | None = None, trust_remote_code: bool = False,
                 scheduling_policy: str = "fcfs"):
        """model_id: the served name; unset, it is where the tokenizer loads from (a hub id or a local
        path, as vLLM serves its --model), so clients that load a tokenizer by the served name
        (guidellm) find it. model_alias: another name requests may use (unset with no model_id: the
        short name, e.g. SmolLM2-135M-Instruct). engine_process: the engine's step loop in a child
        process (ponytail.ProcessAsyncLLM); None: on where the engine runs on a GPU. generation_config:
        "auto" fills the sampling fields a request leaves unset from the model's generation_config.json
        (generation_defaults.py), "ponytail" leaves SamplingParams' defaults. chat_template: the template's
        text, served instead of the tokenizer's. tool_call_parser: tool_parsers.TOOL_CALL_PARSERS.
        reasoning_parser: reasoning.REASONING_PARSERS. default_chat_template_kwargs: names every chat's
        template gets unless the request sets them. enforce_eager, seed, revision, trust_remote_code,
        scheduling_policy: LLM's (vLLM's); the model's generation_config.json is read at the same revision."""
        if generation_config not in ("auto", "ponytail"):  # before seconds of loading
            raise ponytail.ConfigError(f"generation_config={generation_config!r} is not supported; allowed: auto "
                                       "(the model's generation_config.json fills unset sampling fields), ponytail")
        if tool_call_parser not in TOOL_CALL_PARSERS:
            raise ponytail.ConfigError(f"tool_call_parser={tool_call_parser!r} is not supported; allowed: "
                                       f"{', '.join(TOOL_CALL_PARSERS)}")
        if default_chat_template_kwargs is not None:
            check_chat_template_options(default_chat_template_kwargs, True, False)
        self.template_defaults = default_chat_template_kwargs or None
        if reasoning_parser not in REASONING_PARSERS:
            raise ponytail.ConfigError(f"reasoning_parser={reasoning_parser!r} is not supported; allowed: "
                                       f"{', '.join(REASONING_PARSERS)}")
        tuning = {name: value for name, value in (("prefill_delay_factor", prefill_delay_factor),
                                                  ("fuse_projections", fuse_projections),
                                                  ("column_major_weights", column_major_weights)) if value is not None}
        llm_kwargs = dict(model=model, device=device, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                          max_model_len=max_model_len, block_size=block_size, compile_model=compile_model,
                          gpu_memory_utilization=gpu_memory_utilization, keep_prefix_cache=keep_prefix_cache,
                          prefill_attention=prefill_attention, tuning=tuning,
                          enforce_eager=enforce_eager, seed=seed, revision=revision,
                          trust_remote_code=trust_remote_code, scheduling_policy=scheduling_policy)
        if engine_process is None:
            engine_process = _on_gpu(device)
        # Merged deltas: one Ray message per stream per interval, not one per token. In one process
        # the event loop that sends them shares the GIL with the engine's step thread: with a child
        # process for the engine, neither slows the other (self.llm is then that process's front).
        if engine_process:
            self.async_llm = ponytail.ProcessAsyncLLM(llm_kwargs, stream_interval_s=stream_interval_s,
                                                      max_deltas_per_s=max_deltas_per_s,
                                                      prefix_log_capacity=LOG_CAPACITY)
            self.llm = self.async_llm
        else:
            self.llm = ponytail.LLM(**llm_kwargs)
            self.async_llm = ponytail.AsyncLLM(self.llm, stream_interval_s=stream_interval_s,
                                               max_deltas_per_s=max_deltas_per_s)
        self.tokenizer = self.llm.tokenizer
        use_chat_template(self.tokenizer, chat_template)
        self.token_texts = TokenTexts(self.tokenizer)
        root = tokenizer_source(self.tokenizer)
        short = os.path.basename(str(model).rstrip("/")) if model else DEFAULT_MODEL_ID
        if model_id is None and model_alias is None:
            model_alias = short
        served = model_id or root or model_alias or short
        if generation_config == "auto":
            self.sampling_defaults = model_sampling_defaults(root, revision)
            if self.sampling_defaults:
                logger.info("requests that leave them unset sample with the model's generation_config.json: %s "
                            "(generation_config: ponytail turns this off)", self.sampling_defaults)
        template = getattr(self.tokenizer, "chat_template", None)
        self.info = ModelInfo(model_id=served, max_model_len=self.llm.max_model_len, block_size=self.llm.block_size,
                              device=str(self.llm.device), device_uuid=self.llm.device_uuid, root=root,
                              aliases=[model_alias] if model_alias and model_alias != served else [],
                              tool_call_format=served_tool_call_format(tool_call_parser, template),
                              reasoning_format=served_reasoning_format(reasoning_parser, template),
                              chat_template_kwargs=self.template_defaults, scheduling_policy=scheduling_policy)
        if self.info.reasoning_format == THINK:  # where answers start: in a thought the prompt opened, or not
            self.info.thought_opens = thought_opens(self.tokenizer, self.template_defaults)
            logger.info("reasoning models' thought is split off (reasoning_parser auto); the generation prompt "
                        "opens one with enable_thinking unset/true/false: %s", self.info.thought_opens)
        context = serve.get_replica_context() if _in_serve() else None
        self.metrics = ReplicaMetrics(context.replica_id.unique_id if context else "local")
        context_len = self.info.max_model_len
        self.max_prompt_tokens = context_len if max_prompt_tokens is None else min(max_prompt_tokens, context_len)
        self.max_token_bytes = _max_token_bytes(self.tokenizer)
        self.num_requests = 0  # generate calls taken: where the router sent requests, for tests and benchmarks
        # Where a request's time to first token goes on this replica (benchmarks split the client's TTFT).
        self.admit_seconds, self.ttft_seconds, self.queue_seconds, self.num_ttft = 0.0, 0.0, 0.0, 0
        # Requests the prefix router tokenized bring ids made with a tokenizer of this fingerprint.
        self._fingerprint = (tokenizer_fingerprint(self.tokenizer, self.template_defaults)
                             if self.tokenizer is not None else None)
        # A conversation's earlier turns and shared system prompts are tokenized once, not every turn.
        self.segments = SegmentCache(self.tokenizer) if self.tokenizer is not None else None
        self.prefix = PrefixPublisher(self.llm.publish_prefix_events(LOG_CAPACITY))  # for the prefix router
        if _in_serve():
            # The replica's process is ours and what it holds now (model, tokenizer, engine) lives as
            # long as it does: out of the collector's sight, as vLLM freezes its engine core's heap.
            # A full collection scanning it took ~200 ms with the default model loaded (bench_engine --small's
            # process), a pause in every stream.
            gc.collect()
            gc.freeze()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Stream a request's deltas. Cancelling the stream aborts the request and frees its blocks."""
        self.num_requests += 1
        called = time.monotonic()
        sampling = request.sampling
        if request.max_tokens_to_context and "max_tokens" not in sampling:  # a handle caller's: the context bounds it
            sampling = {**sampling, "max_tokens": self.info.max_model_len}
        params = SamplingParams(**{**self.sampling_defaults, **sampling})  # ConfigError names the bad field
        # In a worker thread: a 5 MB prompt takes seconds to tokenize, and this event loop also
        # sends every other stream's deltas (the fast tokenizer releases the GIL meanwhile).
        if request.truncate_prompt_tokens is None:  # a prompt cut to fit may be any length
            self._refuse_certainly_too_long(request, params)  # before seconds of tokenizing
        request = self._with_template_options(request)
        prompt = self._given_token_ids(request)
        if prompt is None:
            prompt = await asyncio.to_thread(self._prompt_token_ids, request)
        self.admit_seconds += time.monotonic() - called
        answer_room = params.max_tokens  # what truncate_prompt_tokens -1 leaves room for
        if request.max_tokens_to_context:
            answer_room = min(answer_room, TRUNCATED_ANSWER_ROOM)
        prompt = self._truncated(prompt, request.truncate_prompt_tokens, answer_room, request.truncation_side)
        if isinstance(prompt, list) and len(prompt) > self.max_prompt_tokens:
            raise ponytail.ContextLengthError(
                f"prompt has {len(prompt)} tokens; allowed: at most {self.max_prompt_tokens} (max_prompt_tokens, "
                f"max_model_len={self.info.max_model_len})", len(prompt), params.max_tokens, self.max_prompt_tokens)
        if request.max_tokens_to_context and isinstance(prompt, list):
            params = self._to_context(params, len(prompt))
        if request.beam_search is not None:
            for out in await self._beam_search(prompt, params, request):
                yield out
            return
        if request.cache_salt is not None:  # vLLM's prompt dict carries it to the engine
            prompt = {"prompt" if isinstance(prompt, str) else "prompt_token_ids": prompt,
                      "cache_salt": request.cache_salt}
        if params.ranks_samples:  # best_of: which samples are returned is known only at the end
            async for delta in self.async_llm.generate(prompt, params, request.request_id, request.priority):
                if delta.finished:
                    for out in self._final_deltas(delta, request, params):
                        yield out
            return
        started: set[int] = set()  # choices whose first delta went out
        said = None  # what the choices' first deltas say of the prompt: the same for all, made once
        sent: dict[int, int] = {}  # per choice: output tokens whose logprobs went out
        thoughts: dict[int, ReasoningTokens] = {}  # per choice, where the API splits reasoning
        async for delta in self.async_llm.generate(prompt, params, request.request_id, request.priority):
            output = delta.output
            choice = output.outputs[delta.index]
            out = GenerateDelta(request_id=delta.request_id, text=delta.delta_text, token_ids=delta.new_token_ids,
                                finished=delta.finished, finish_reason=choice.finish_reason,
                                prompt_tokens=len(output.prompt_token_ids), completion_tokens=len(choice.token_ids),
                                error=output.error, index=delta.index, stop_reason=choice.stop_reason,
                                cached_tokens=output.metrics.num_cached_prompt_tokens)
            if request.count_reasoning:
                if delta.index not in thoughts:
                    thoughts[delta.index] = ReasoningTokens(request.starts_in_thought, self.token_texts)
                out.reasoning_tokens = thoughts[delta.index].feed(delta.new_token_ids)
            if delta.index not in started:  # a choice's first delta carries what is said of the prompt
                if said is None:
                    said = self._prompt_said(output, params, request)
                    out.prompt_logprob_entries = said.entries  # the API reads them off the request's first delta
                started.add(delta.index)
                out.prompt_text, out.prompt_logprobs, out.prompt_token_ids = said.text, said.logprobs, said.token_ids
            if params.logprobs is not None and choice.logprobs is not None:
                done = sent.get(delta.index, 0)
                entries = choice.logprobs[done : done + len(delta.new_token_ids)]
                out.logprobs = token_logprobs(self.token_texts, delta.new_token_ids, entries, shown_top(params))
                sent[delta.index] = done + len(entries)
            if delta.finished:
                self._finished(output)
            yield out

    async def _beam_search(self, prompt: str | list[int], params: SamplingParams,
                           request: GenerateRequest) -> list[GenerateDelta]:
        """use_beam_search: params.n beams (ponytail.LLM.beam_search's search on this engine), one
        whole delta per returned sequence, best first, the last one finishing the request."""
        others = sorted(set(request.sampling) - set(BEAM_SEARCH_SAMPLING))
        if others:  # a handle caller's request, which no API checked
            raise ponytail.ConfigError(f"{others[0]}={request.sampling[others[0]]!r:.60} cannot be combined with "
                                       f"beam_search; allowed with it: {', '.join(BEAM_SEARCH_SAMPLING)}")
        if isinstance(prompt, str):  # as every text prompt is tokenized (add_special_tokens)
            prompt = await asyncio.to_thread(prompt_token_ids, self.tokenizer, request)
        beam = ponytail.BeamSearchParams(beam_width=params.n, max_tokens=params.max_tokens,
                                         ignore_eos=params.ignore_eos, temperature=params.temperature,
                                         length_penalty=request.beam_search["length_penalty"],
                                         include_stop_str_in_output=params.include_stop_str_in_output)
        result = await self.async_llm.beam_search(prompt, beam, request.request_id, request.cache_salt,
                                                  request.priority, params.skip_special_tokens)
        outs = []
        for index, sequence in enumerate(result.sequences):
            token_ids = sequence.tokens[len(prompt):]
            out = GenerateDelta(request_id=request.request_id, text=sequence.text or "", token_ids=token_ids,
                                finished=index == len(result.sequences) - 1, finish_reason=sequence.finish_reason,
                                prompt_tokens=len(prompt), completion_tokens=len(token_ids), index=index,
                                prompt_token_ids=list(prompt) if request.return_token_ids else None)
            if request.count_reasoning:
                out.reasoning_tokens = ReasoningTokens(request.starts_in_thought, self.token_texts).feed(token_ids)
            outs.append(out)  # stop_reason stays None: a beam stops on EOS only
        return outs

    def _final_deltas(self, delta, request: GenerateRequest, params: SamplingParams) -> list[GenerateDelta]:
        """best_of: one whole delta per returned choice, the last one finishing the request."""
        output = delta.output
        self._finished(output)
        outs = []
        said = self._prompt_said(output, params, request)
        for i, choice in enumerate(output.outputs):
            out = GenerateDelta(request_id=delta.request_id, text=choice.text, token_ids=list(choice.token_ids),
                                finished=i == len(output.outputs) - 1, finish_reason=choice.finish_reason,
                                prompt_tokens=len(output.prompt_token_ids), completion_tokens=len(choice.token_ids),
                                error=output.error, index=i, stop_reason=choice.stop_reason,
                                cached_tokens=output.metrics.num_cached_prompt_tokens)
            if request.count_reasoning:
                out.reasoning_tokens = ReasoningTokens(request.starts_in_thought, self.token_texts).feed(out.token_ids)
            out.prompt_text, out.prompt_logprobs, out.prompt_token_ids = said.text, said.logprobs, said.token_ids
            out.prompt_logprob_entries = said.entries if i == 0 else None
            if params.logprobs is not None and choice.logprobs is not None:
                out.logprobs = token_logprobs(self.token_texts, out.token_ids, choice.logprobs, shown_top(params))
            outs.append(out)
        return outs

    def _finished(self, output) -> None:
        self.metrics.on_finished(output)
        ttft = output.metrics.time_to_first_token
        if ttft is not None:
            self.ttft_seconds += ttft
            self.queue_seconds += output.metrics.queue_time
            self.num_ttft += 1

    def _prompt_said(self, output, params: SamplingParams, request: GenerateRequest) -> PromptSaid:
        """What a request's answer says of its prompt: with echo its text, and its logprobs when
        the request asked for logprobs; with the prompt_logprobs field, those in vLLM's shape."""
        ids, scored = output.prompt_token_ids, output.prompt_logprobs
        entries = (prompt_logprob_entries(self.token_texts, ids, scored, request.prompt_logprobs)
                   if request.prompt_logprobs is not None and scored is not None else None)
        token_ids = list(ids) if request.return_token_ids else None
        if not request.echo:
            return PromptSaid(None, None, entries, token_ids)
        text = output.prompt if output.prompt is not None else self.tokenizer.decode(ids)
        logprobs = (token_logprobs(self.token_texts, ids, scored, shown_top(params))
                    if params.logprobs is not None and scored is not None else None)  # echo with logprobs
        return PromptSaid(text, logprobs, entries, token_ids)

    async def tokenize(self, prompt: str | None = None, messages: list[dict] | None = None,
                       options: dict | None = None) -> list[int]:
        """The token ids the engine would compute for a completions prompt or chat messages (in a
        worker thread, as generate's: a huge prompt must not stall other streams); options: the chat
        template's (GenerateRequest's tools, chat_template_kwargs, add_generation_prompt, continue_final_message)."""
        request = self._with_template_options(GenerateRequest(prompt=prompt, messages=messages, **(options or {})))
        return list(await asyncio.to_thread(prompt_token_ids, self.tokenizer, request, self.segments))

    async def detokenize(self, token_ids: list[int]) -> str:
        vocab = self.llm.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ponytail.ConfigError(f"tokens={bad[:5]} are outside the vocabulary; allowed: ids in [0, {vocab})")
        return self.tokenizer.decode(token_ids)


    def _refuse_certainly_too_long(self, request: GenerateRequest, params: SamplingParams) -> None:
        """No token covers more than max_token_bytes bytes of text, so a text of more bytes than
        max_prompt_tokens x max_token_bytes is too long whatever it tokenizes to."""
        if self.max_token_bytes is None:
            return
        if request.messages is not None:
            size = sum(len(str(m.get("content") or "").encode()) for m in request.messages)
        elif isinstance(request.prompt, str):
            size = len(request.prompt.encode())
        else:
            return
        least = size // self.max_token_bytes
        if least > self.max_prompt_tokens:
            raise ponytail.ContextLengthError(
                f"prompt has at least {least} tokens ({size} bytes of text, at most {self.max_token_bytes} per "
                f"token); allowed: at most {self.max_prompt_tokens} (max_model_len={self.info.max_model_len})",
                least, params.max_tokens, self.max_prompt_tokens)

    def _with_template_options(self, request: GenerateRequest) -> GenerateRequest:
        """The request with the operator's default template kwargs, its options checked (the
        ingress checked them too; other Ray apps' requests come here directly)."""
        request = with_template_defaults(request, self.template_defaults)
        if request.messages is not None:
            check_chat_template_options(request.chat_template_kwargs, request.add_generation_prompt,
                                        request.continue_final_message, request.messages)
        return request

    def _truncated(self, prompt, keep: int | None, max_tokens: int | None, side: str = "left"):
        """The prompt's last `keep` tokens (vLLM's truncate_prompt_tokens), its first ones with side
        "right"; -1: as many as fit in the context with max_tokens after them (and within max_prompt_tokens)."""
        if keep is None:
            return prompt
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < -1 or keep == 0:
            raise ponytail.ConfigError(f"truncate_prompt_tokens={keep!r} is invalid; allowed: a positive integer "
                                       "(the prompt's last this many tokens) or -1 (as many as the context allows)")
        if not isinstance(prompt, list):
            raise ponytail.ConfigError("truncate_prompt_tokens needs the prompt as token ids, and this model has no "
                                       "tokenizer; allowed: token-id prompts, or no truncate_prompt_tokens")
        if side not in ("left", "right"):
            raise ponytail.ConfigError(f"truncation_side={side!r:.40} is invalid; allowed: left (keep the last "
                                       "tokens), right (keep the first)")
        if keep == -1:
            keep = max(1, min(self.max_prompt_tokens, self.info.max_model_len - (max_tokens or 0)))
        return truncated(prompt, keep, side)

    def _to_context(self, params: SamplingParams, prompt_tokens: int) -> SamplingParams:
        """A request without max_tokens: at most what the prompt leaves of the context, and of the
        whole KV cache where that holds less (the engine refuses a request it could never hold)."""
        context, cache = self.info.max_model_len, self.llm.stats().max_blocks * self.info.block_size
        most, by = (context, f"max_model_len={context}") if context <= cache else (
            cache, f"the KV cache holds {cache} tokens; max_model_len={context}")
        if prompt_tokens >= most:
            raise ponytail.ContextLengthError(
                f"prompt has {prompt_tokens} tokens, which leaves no room for an answer; allowed: at most "
                f"{most - 1} ({by})", prompt_tokens, 1, most)
        return dataclasses.replace(params, max_tokens=min(params.max_tokens, most - prompt_tokens))

    def _given_token_ids(self, request: GenerateRequest) -> list[int] | None:
        """The prompt's token ids when the request brings them: a token-id prompt, or the router's
        tokenizing (GenerateRequest.tokenized) with this replica's tokenizer. None: tokenize it."""
        if isinstance(request.prompt, list) and request.messages is None:
            return list(request.prompt)
        if request.tokenized is None or self._fingerprint is None:
            return None
        fingerprint, ids = request.tokenized
        return list(ids) if fingerprint == self._fingerprint else None

    def _prompt_token_ids(self, request: GenerateRequest) -> str | list[int]:
        """The request's prompt as token ids (as the engine would tokenize it), or as given
        when it is already ids or the engine has no tokenizer."""
        if self.tokenizer is None or (isinstance(request.prompt, str) and not request.prompt):
            return request.prompt
        return prompt_token_ids(self.tokenizer, request, self.segments)  # what the prefix router hashes too

    async def abort(self, request_id: str) -> bool:
        return await self.async_llm.abort(request_id)

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine process died fails it and is replaced."""
        dead = getattr(self.async_llm, "dead", None)
        if dead is not None:
            raise dead

    def __del__(self) -> None:
        """Serve's graceful shutdown: the engine process stops with the replica."""
        shutdown = getattr(getattr(self, "async_llm", None), "shutdown", None)
        if shutdown is not None:
            shutdown()

    async def model_info(self) -> ModelInfo:
        return self.info

    def record_routing_stats(self, advance_prefix_window: bool = True) -> dict:
        """Read by the KV-block router every stats period: cheap, no waiting on the engine step.

        free_blocks is what a new request can count on: the engine's admissible blocks (free now,
        evictable prefix blocks included, plus what the pool may still grow by) less those it has
        promised to the requests already here until they reach max_tokens (TGI reserves the same
        way). A router that sends only where this covers a request never makes the replica preempt.
        startable_blocks is what the engine itself admits by: admissible blocks less the waiting
        queue's tokens and the decode headroom (EngineStats.startable_blocks; vLLM's scheduler
        admits the same way and preempts when running requests outgrow the pool).
        """
        stats = self.llm.stats()  # plain counters: no engine lock, no wait on a running step
        self.metrics.on_stats(stats)
        self.metrics.on_engine_loop(self.async_llm.num_steps, self.async_llm.step_seconds)
        free = stats.admissible_blocks - stats.promised_blocks
        return {STAT_FREE_BLOCKS: max(0, free), STAT_STARTABLE_BLOCKS: max(0, stats.startable_blocks),
                STAT_TOTAL_BLOCKS: stats.max_blocks,
                STAT_NUM_RUNNING: stats.num_running, STAT_NUM_WAITING: stats.num_waiting,
                STAT_BLOCK_SIZE: self.info.block_size, STAT_TIME: time.time(),
                **self.prefix.routing_stats(stats.cached_blocks, advance=advance_prefix_window)}

    def report(self) -> ReplicaReport:
        """Name, model and device, routing stats, requests taken and engine stats, read together."""
        # ray.get_runtime_context() would start a Ray cluster in a process without one (a local replica)
        actor = ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None
        # advance_prefix_window=False: this read must not push events out of the router's next report
        return ReplicaReport(replica=actor or "local", info=self.info,
                             routing=self.record_routing_stats(advance_prefix_window=False),
                             num_requests=self.num_requests,
                             stats=self.llm.stats(), num_steps=self.async_llm.num_steps,
                             step_seconds=self.async_llm.step_seconds, admit_seconds=self.admit_seconds,
                             ttft_seconds=self.ttft_seconds, queue_seconds=self.queue_seconds,
                             num_ttft=self.num_ttft)


def tokenizer_source(tokenizer) -> str | None:
    """What transformers' AutoTokenizer.from_pretrained loads this tokenizer from: a hub id, or a
    local directory as an absolute path; None when there is none (no tokenizer, a .gguf file)."""
    name = getattr(tokenizer, "name_or_path", None) or None
    if name is None:
        return None
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return os.path.abspath(path)
    return None if os.path.exists(path) else name


def _max_token_bytes(tokenizer) -> int | None:
    """An upper bound on the bytes of text one token stands for: twice the longest token string in
    UTF-8 (byte-level and SentencePiece token strings spell each text byte with at least one byte;
    the factor 2 covers normalizers that shorten text). None without a tokenizer."""
    if tokenizer is None:
        return None
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return 2 * max(len(t.encode()) for t in tokens if t)


def _in_serve() -> bool:
    try:
        serve.get_replica_context()
        return True
    except Exception:  # outside a replica (unit tests, local use)
        return False


def _on_gpu(device: str) -> bool:
    """Whether LLM(device=device) runs on a GPU, without creating a CUDA context here."""
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")
