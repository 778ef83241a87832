"""One engine replica: owns a device (one GPU, or the CPU) and one Ponytail engine."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator

import ray
from ray import serve

import ponytail
from ponytail import SamplingParams

from .metrics import ReplicaMetrics
from .prefix_publisher import PrefixPublisher
from .prompts import chat_token_ids
from .protocol import (STAT_BLOCK_SIZE, STAT_FREE_BLOCKS, STAT_NUM_RUNNING, STAT_NUM_WAITING, STAT_TIME,
                       STAT_TOTAL_BLOCKS, GenerateDelta, GenerateRequest, ModelInfo, ReplicaReport)

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"


class EngineReplica:
    """Serve deployment body (see app.py): generate, abort, model_info, record_routing_stats."""

    def __init__(self, model: str | None = None, device: str = "auto", kv_cache_memory: int | str | None = None,
                 max_num_seqs: int = 64, max_model_len: int | None = None,
                 block_size: int = ponytail.DEFAULT_BLOCK_SIZE, model_id: str | None = None,
                 compile_model: bool = False, stream_interval_s: float = 0.0):
        self.llm = ponytail.LLM(model, device=device, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                                max_model_len=max_model_len, block_size=block_size, compile_model=compile_model)
        # Merged deltas: one Ray message per stream per interval, not one per token; the event loop
        # that sends them shares the GIL with the engine's step thread.
        self.async_llm = ponytail.AsyncLLM(self.llm, stream_interval_s=stream_interval_s)
        self.tokenizer = self.llm.tokenizer
        self.info = ModelInfo(model_id=model_id or (os.path.basename(str(model).rstrip("/")) if model else DEFAULT_MODEL_ID),
                              max_model_len=self.llm.max_model_len, block_size=self.llm.block_size,
                              device=str(self.llm.device), device_uuid=_device_uuid(self.llm.device))
        context = serve.get_replica_context() if _in_serve() else None
        self.metrics = ReplicaMetrics(context.replica_id.unique_id if context else "local")
        self.num_requests = 0  # generate calls taken: where the router sent requests, for tests and benchmarks
        self.prefix = PrefixPublisher(self.llm.engine.cache.allocator)  # cached prefix blocks, for the router

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Stream a request's deltas. Cancelling the stream aborts the request and frees its blocks."""
        self.num_requests += 1
        params = SamplingParams(**request.sampling)  # ConfigError names the bad field
        prompt = request.prompt
        if request.messages is not None:
            prompt = chat_token_ids(self.tokenizer, request.messages)  # what the prefix router hashes too
        prompt_tokens = None
        async for delta in self.async_llm.generate(prompt, params, request.request_id):
            output = delta.output
            if prompt_tokens is None:
                prompt_tokens = len(output.prompt_token_ids)
            if delta.finished:
                self.metrics.on_finished(output)
            yield GenerateDelta(request_id=delta.request_id, text=delta.delta_text, token_ids=delta.new_token_ids,
                                finished=delta.finished, finish_reason=output.finish_reason if delta.finished else None,
                                prompt_tokens=prompt_tokens, completion_tokens=len(output.token_ids),
                                error=output.error)

    async def abort(self, request_id: str) -> bool:
        return await self.async_llm.abort(request_id)

    async def model_info(self) -> ModelInfo:
        return self.info

    def record_routing_stats(self) -> dict:
        """Read by the KV-block router every stats period: cheap, no waiting on the engine step.

        free_blocks is what a new request can count on: the engine's admissible blocks (free now,
        evictable prefix blocks included, plus what the pool may still grow by) less those it has
        promised to the requests already here until they reach max_tokens (TGI reserves the same
        way). A router that sends only where this covers a request never makes the replica preempt.
        """
        stats = self.llm.stats()  # plain counters: no engine lock, no wait on a running step
        self.metrics.on_stats(stats)
        self.metrics.on_engine_loop(self.async_llm.num_steps, self.async_llm.step_seconds)
        free = stats.admissible_blocks - stats.promised_blocks
        return {STAT_FREE_BLOCKS: max(0, free), STAT_TOTAL_BLOCKS: stats.max_blocks,
                STAT_NUM_RUNNING: stats.num_running, STAT_NUM_WAITING: stats.num_waiting,
                STAT_BLOCK_SIZE: self.info.block_size, STAT_TIME: time.time(), **self.prefix.routing_stats()}

    def report(self) -> ReplicaReport:
        """Name, model and device, routing stats, requests taken and engine stats, read together."""
        return ReplicaReport(replica=ray.get_runtime_context().get_actor_name() or "local", info=self.info,
                             routing=self.record_routing_stats(), num_requests=self.num_requests,
                             stats=self.llm.stats(), num_steps=self.async_llm.num_steps,
                             step_seconds=self.async_llm.step_seconds)


def _in_serve() -> bool:
    try:
        serve.get_replica_context()
        return True
    except Exception:  # outside a replica (unit tests, local use)
        return False


def _device_uuid(device) -> str | None:
    if device.type != "cuda":
        return None
    import torch

    return str(torch.cuda.get_device_properties(device).uuid)
