"""One engine replica: owns a device (one GPU, or the CPU) and one Ponytail engine.

It is the API's backend (api/streams.Backend) in its own process (api_in_engines) and behind the
ingress's handle otherwise; other Ray apps call `generate` on a handle to it. Its routers read
`record_routing_stats` every period.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import time
from collections.abc import AsyncIterator

import ray
from ray import serve

import ponytail
from ponytail import SamplingParams, check_chat_template_options

from deployments.api.deltas import DeltaWriter
from deployments.api.generation_defaults import model_sampling_defaults
from deployments.api.logprobs import TokenTexts
from deployments.api.prompt_bounds import PromptBounds
from deployments.api.prompts import prompt_token_ids, tokenizer_fingerprint, use_chat_template, with_template_defaults
from deployments.api.protocol import BEAM_SEARCH_SAMPLING, GenerateDelta, GenerateRequest, ModelInfo
from deployments.api.reasoning import THINK, served_reasoning_format, thought_opens
from deployments.api.segment_tokens import SegmentCache
from deployments.api.stream_gate import StreamGate
from deployments.api.tool_parsers import served_tool_call_format

from .metrics import ReplicaMetrics
from .prefix_publisher import LOG_CAPACITY, PrefixPublisher
from .replica_options import DEFAULT_SERVED_NAME, SERVING_ENGINE_DEFAULTS, ReplicaOptions, replica_options
from .routing_stats import (STAT_BLOCK_SIZE, STAT_FREE_BLOCKS, STAT_NUM_RUNNING, STAT_NUM_WAITING,
                            STAT_STARTABLE_BLOCKS, STAT_TIME, STAT_TOTAL_BLOCKS, ReplicaReport)

logger = logging.getLogger(__name__)


class EngineReplica:
    """Serve deployment body (builder.py): generate, abort, model_info, record_routing_stats."""

    gate: StreamGate | None = None  # bounds the HTTP streams where the replica serves the API (engine_api.py)

    def __init__(self, model: str | None = None, *, engine: dict | None = None, model_alias: str | None = None,
                 **options):
        """model: what LLM loads (a path, .gguf file or hub id; None: the embedded default). engine:
        LLM's other arguments (ponytail.config.EngineConfig's fields) over SERVING_ENGINE_DEFAULTS.
        options: ReplicaOptions' fields.
        model_alias: another name requests may use (unset with no served_model_name: the short name,
        e.g. SmolLM2-135M-Instruct)."""
        settings = replica_options(**options)  # before seconds of loading
        self.template_defaults = settings.default_chat_template_kwargs
        llm_kwargs = {"model": model, **SERVING_ENGINE_DEFAULTS, **(engine or {})}
        engine_process = settings.engine_process
        if engine_process is None:
            engine_process = _on_gpu(llm_kwargs.get("device", "auto"))
        # Merged deltas: one Ray message per stream per interval, not one per token. In one process
        # the event loop that sends them shares the GIL with the engine's step thread: with a child
        # process for the engine, neither slows the other (self.llm is then that process's front).
        stream = dict(stream_interval_s=settings.stream_interval_s, max_deltas_per_s=settings.max_deltas_per_s)
        if engine_process:
            self.async_llm = ponytail.ProcessAsyncLLM(llm_kwargs, prefix_log_capacity=LOG_CAPACITY, **stream)
            self.llm = self.async_llm
        else:
            self.llm = ponytail.LLM(**llm_kwargs)
            self.async_llm = ponytail.AsyncLLM(self.llm, **stream)
        self.tokenizer = self.llm.tokenizer
        use_chat_template(self.tokenizer, settings.chat_template)
        self.token_texts = TokenTexts(self.tokenizer)
        self.info = self._model_info(model, settings, model_alias, llm_kwargs)
        context = serve.get_replica_context() if _in_serve() else None
        self.metrics = ReplicaMetrics(context.replica_id.unique_id if context else "local")
        self.bounds = PromptBounds.of(self.tokenizer, self.info.max_model_len, settings.max_prompt_tokens)
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
            # long as it does: out of the collector's sight, as vLLM freezes its engine core's heap,
            # so a full collection never scans it in the middle of the streams.
            gc.collect()
            gc.freeze()

    def _model_info(self, model: str | None, settings: ReplicaOptions, model_alias: str | None,
                    engine: dict) -> ModelInfo:
        """The served name is where the tokenizer loads from unless set (a hub id or a local path, as
        vLLM serves its --model), so clients that load a tokenizer by it (guidellm) find it."""
        root = tokenizer_source(self.tokenizer)
        short = os.path.basename(str(model).rstrip("/")) if model else DEFAULT_SERVED_NAME
        if settings.served_model_name is None and model_alias is None:
            model_alias = short
        served = settings.served_model_name or root or model_alias or short
        auto = settings.generation_config == "auto"
        defaults = model_sampling_defaults(root, engine.get("revision")) if auto else {}
        if defaults:
            logger.info("requests that leave them unset sample with the model's generation_config.json: %s "
                        "(generation_config: ponytail turns this off)", defaults)
        template = getattr(self.tokenizer, "chat_template", None)
        info = ModelInfo(model_id=served, max_model_len=self.llm.max_model_len, block_size=self.llm.block_size,
                         device=str(self.llm.device), device_uuid=self.llm.device_uuid, root=root,
                         aliases=[model_alias] if model_alias and model_alias != served else [],
                         tool_call_format=served_tool_call_format(settings.tool_call_parser, template),
                         reasoning_format=served_reasoning_format(settings.reasoning_parser, template),
                         chat_template_kwargs=self.template_defaults,
                         scheduling_policy=engine.get("scheduling_policy", "fcfs"), sampling_defaults=defaults)
        if info.reasoning_format == THINK:  # where answers start: in a thought the prompt opened, or not
            info.thought_opens = thought_opens(self.tokenizer, self.template_defaults)
            logger.info("reasoning models' thought is split off (reasoning_parser auto); the generation prompt "
                        "opens one with enable_thinking unset/true/false: %s", info.thought_opens)
        return info

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Stream a request's deltas. Cancelling the stream aborts the request and frees its blocks."""
        self.num_requests += 1
        called = time.monotonic()
        params = request.sampling
        if not isinstance(params, SamplingParams):  # a handle caller's, which no API built
            raise ponytail.ConfigError(f"sampling={params!r:.60} is not supported; allowed: a ponytail.SamplingParams")
        if request.truncate_prompt_tokens is None:  # a prompt cut to fit may be any length
            self.bounds.refuse_certainly_too_long(request)  # before seconds of tokenizing
        request = self._with_template_options(request)
        prompt = self._given_token_ids(request)
        if prompt is None:
            # In a worker thread: a 5 MB prompt takes seconds to tokenize, and this event loop also
            # sends every other stream's deltas (the fast tokenizer releases the GIL meanwhile).
            prompt = await asyncio.to_thread(self._prompt_token_ids, request)
        self.admit_seconds += time.monotonic() - called
        prompt = self.bounds.truncated(prompt, request)
        self.bounds.check(prompt, params)
        if request.max_tokens_to_context and isinstance(prompt, list):
            cache_tokens = self.llm.stats().max_blocks * self.info.block_size
            params = self.bounds.to_context(params, len(prompt), cache_tokens)
            request = dataclasses.replace(request, sampling=params)
        writer = DeltaWriter(request, self.token_texts, self.tokenizer)
        if request.beam_search is not None:
            for out in await self._beam_search(prompt, request, writer):
                yield out
            return
        if request.cache_salt is not None:  # vLLM's prompt dict carries it to the engine
            prompt = {"prompt" if isinstance(prompt, str) else "prompt_token_ids": prompt,
                      "cache_salt": request.cache_salt}
        async for delta in self.async_llm.generate(prompt, params, request.request_id, request.priority):
            if delta.finished:
                self._finished(delta.output)
            if params.ranks_samples:  # best_of: which samples are returned is known only at the end
                if delta.finished:
                    for out in writer.whole(delta):
                        yield out
                continue
            yield writer.write(delta)

    def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """The API's backend stream: generate, bounded by the gate where this replica serves HTTP."""
        if self.gate is None:
            return self.generate(request)
        return self.gate.stream(self.generate, request)

    async def _beam_search(self, prompt: str | list[int], request: GenerateRequest,
                           writer: DeltaWriter) -> list[GenerateDelta]:
        """use_beam_search: params.n beams (ponytail.LLM.beam_search's search on this engine)."""
        params = request.sampling
        plain = self.info.sampling_params()  # what a request that sets nothing samples with
        others = [f.name for f in dataclasses.fields(SamplingParams)
                  if f.name not in BEAM_SEARCH_SAMPLING and getattr(params, f.name) != getattr(plain, f.name)]
        if others:  # a handle caller's request, which no API checked
            raise ponytail.ConfigError(f"{others[0]}={getattr(params, others[0])!r:.60} cannot be combined with "
                                       f"beam_search; allowed with it: {', '.join(BEAM_SEARCH_SAMPLING)}")
        if isinstance(prompt, str):  # as every text prompt is tokenized (add_special_tokens)
            prompt = await asyncio.to_thread(prompt_token_ids, self.tokenizer, request)
        beam = ponytail.BeamSearchParams(beam_width=params.n, max_tokens=params.max_tokens,
                                         ignore_eos=params.ignore_eos, temperature=params.temperature,
                                         length_penalty=request.beam_search["length_penalty"],
                                         include_stop_str_in_output=params.include_stop_str_in_output)
        result = await self.async_llm.beam_search(prompt, beam, request.request_id, request.cache_salt,
                                                  request.priority, params.skip_special_tokens)
        return writer.beams(prompt, result.sequences)

    def _finished(self, output) -> None:
        self.metrics.on_finished(output)
        ttft = output.metrics.time_to_first_token
        if ttft is not None:
            self.ttft_seconds += ttft
            self.queue_seconds += output.metrics.queue_time
            self.num_ttft += 1

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

    def _with_template_options(self, request: GenerateRequest) -> GenerateRequest:
        """The request with the operator's default template kwargs, its options checked (the
        API checked them too; other Ray apps' requests come here directly)."""
        request = with_template_defaults(request, self.template_defaults)
        if request.messages is not None:
            check_chat_template_options(request.chat_template_kwargs, request.add_generation_prompt,
                                        request.continue_final_message, request.messages)
        return request

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

    async def engine_stats(self) -> dict:
        """For the API's /metrics: this replica's engine counters, by its actor name."""
        return {_actor_name() or "local": self.llm.stats()}

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
        # advance_prefix_window=False: this read must not push events out of the router's next report
        return ReplicaReport(replica=_actor_name() or "local", info=self.info,
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


def _actor_name() -> str | None:
    # ray.get_runtime_context() would start a Ray cluster in a process without one (a local replica)
    return ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None


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
