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
from .protocol import (STAT_BLOCK_SIZE, STAT_FREE_BLOCKS, STAT_NUM_RUNNING, STAT_NUM_WAITING, STAT_TIME,
                       STAT_TOTAL_BLOCKS, GenerateDelta, GenerateRequest, ModelInfo, ReplicaReport)

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"


class EngineReplica:
    """Serve deployment body (see app.py): generate, abort, model_info, record_routing_stats."""

    def __init__(self, model: str | None = None, device: str = "auto", kv_cache_memory: int | str | None = None,
                 max_num_seqs: int = 64, max_model_len: int | None = None, block_size: int = 16,
                 model_id: str | None = None, compile_model: bool = False, stream_interval_s: float = 0.0):
        self.llm = ponytail.LLM(model, device=device, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                                max_model_len=max_model_len, block_size=block_size, compile_model=compile_model)
        # Merged deltas: one Ray message per stream per interval, not one per token; the event loop
        # that sends them shares the GIL with the engine's step thread.
        self.engine = ponytail.AsyncLLM(self.llm, stream_interval_s=stream_interval_s)
        self.tokenizer = self.llm.tokenizer
        config = self.llm.engine.cache.config
        self.info = ModelInfo(model_id=model_id or (os.path.basename(str(model).rstrip("/")) if model else DEFAULT_MODEL_ID),
                              max_model_len=self.llm.engine.scheduler.max_model_len, block_size=config.block_size,
                              device=str(config.device), device_uuid=_device_uuid(config.device))
        context = serve.get_replica_context() if _in_serve() else None
        self.metrics = ReplicaMetrics(context.replica_id.unique_id if context else "local")
        self.num_requests = 0  # generate calls taken: where the router sent requests, for tests and benchmarks

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Stream a request's deltas. Cancelling the stream aborts the request and frees its blocks."""
        self.num_requests += 1
        params = SamplingParams(**request.sampling)  # ConfigError names the bad field
        prompt = request.prompt
        if request.messages is not None:
            prompt = self.tokenizer.apply_chat_template(request.messages, tools=request.tools,
                                                        add_generation_prompt=True, tokenize=True,
                                                        return_dict=False)
            if hasattr(prompt, "input_ids") or isinstance(prompt, dict):
                prompt = list(prompt["input_ids"])
        prompt_tokens = None
        async for delta in self.engine.generate(prompt, params, request.request_id):
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
        return await self.engine.abort(request_id)

    async def model_info(self) -> ModelInfo:
        return self.info

    def record_routing_stats(self) -> dict:
        """Read by the KV-block router every stats period: cheap, no waiting on the engine step.

        free_blocks is what a new request can count on: blocks free now (evictable prefix blocks
        included) plus what the pool may still grow by, less what the requests already here will
        still take until they reach max_tokens (TGI reserves the same way). A router that sends
        only where this covers a request never makes the replica preempt.
        """
        stats = self.llm.engine.stats()  # plain counters: no engine lock, no wait on a running step
        self.metrics.on_stats(stats)
        self.metrics.on_engine_loop(self.engine.num_steps, self.engine.step_seconds)
        free = stats.free_blocks + self._growable_blocks() - self._blocks_promised()
        return {STAT_FREE_BLOCKS: max(0, free), STAT_TOTAL_BLOCKS: self._max_blocks(),
                STAT_NUM_RUNNING: stats.num_running, STAT_NUM_WAITING: stats.num_waiting,
                STAT_BLOCK_SIZE: self.info.block_size, STAT_TIME: time.time()}

    def report(self) -> ReplicaReport:
        """Name, model and device, routing stats, requests taken and engine stats, read together."""
        return ReplicaReport(replica=ray.get_runtime_context().get_actor_name() or "local", info=self.info,
                             routing=self.record_routing_stats(), num_requests=self.num_requests,
                             stats=self.llm.stats(), num_steps=self.engine.num_steps,
                             step_seconds=self.engine.step_seconds)

    def _blocks_promised(self) -> int:
        """Blocks queued and running requests will still take to reach prompt + max_tokens.

        A running request holds blocks for its tokens so far; a waiting one (new or preempted)
        holds none. Snapshots of the engine's lists: its thread may change them meanwhile, and a
        request counted twice or missed in one report is corrected by the next.
        """
        block_size = self.info.block_size
        scheduler = self.llm.engine.scheduler
        promised = 0
        for requests, running in ((list(scheduler.waiting), False), (list(scheduler.running), True)):
            for r in requests:
                need = -(-(len(r.prompt_token_ids) + r.params.max_tokens) // block_size)
                held = -(-r.num_tokens // block_size) if running else 0
                promised += max(0, need - held)
        return promised

    def _growable_blocks(self) -> int:
        cache = self.llm.engine.cache
        return (cache.max_chunks - cache.num_chunks) * cache.storage.chunk_blocks

    def _max_blocks(self) -> int:
        cache = self.llm.engine.cache
        return cache.max_chunks * cache.storage.chunk_blocks


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
