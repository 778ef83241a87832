"""An asyncio front for the engine, for servers: add a request, iterate over its deltas, abort.

One background task drives the engine; each step runs in a worker thread so the event loop stays
responsive while the GPU works. Requests added or aborted between steps take effect at the next.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from .llm import LLM
from .llm_engine import EngineStats, LLMEngine
from .request import RequestOutput
from .sampling_params import SamplingParams


@dataclass(slots=True)
class RequestDelta:
    """What a request produced since the last delta; `output` is the cumulative view."""

    request_id: str
    delta_text: str
    new_token_ids: list[int]
    finished: bool
    output: RequestOutput


class AsyncLLM:
    def __init__(self, llm: LLM | LLMEngine):
        self.engine = llm.engine if isinstance(llm, LLM) else llm
        self._lock = threading.Lock()  # the engine is touched by one thread at a time
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop_task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestDelta]:
        """Add a request and yield its deltas as they come; aborts it if the consumer stops early."""
        with self._lock:
            request = self.engine.add_request(prompt, params, request_id)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request.request_id] = queue
        self._ensure_loop()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request.request_id, None)
            if not finished:
                await self.abort(request.request_id)
            with self._lock:
                self.engine.forget(request.request_id)

    async def abort(self, request_id: str) -> bool:
        with self._lock:
            aborted = self.engine.abort(request_id)
        queue = self._queues.get(request_id)
        if aborted and queue is not None:
            with self._lock:
                output = self.engine.output(self.engine.requests[request_id])
            queue.put_nowait(RequestDelta(request_id, "", [], True, output))
        return aborted

    def stats(self) -> EngineStats:
        with self._lock:
            return self.engine.stats()

    # ------------------------------------------------------------ the loop
    def _ensure_loop(self) -> None:
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        self._wakeup.set()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _step(self):
        with self._lock:
            outputs = self.engine.step()
            return [(o, self.engine.output(o.request)) for o in outputs]

    async def _run(self) -> None:
        while True:
            with self._lock:
                busy = self.engine.has_unfinished()
            if not busy:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                results = await asyncio.to_thread(self._step)
            except Exception as exc:  # a failed step fails its requests, not the server
                for queue in list(self._queues.values()):
                    queue.put_nowait(exc)
                with self._lock:
                    for request_id in list(self.engine.requests):
                        self.engine.abort(request_id)
                continue
            for step_output, output in results:
                queue = self._queues.get(step_output.request.request_id)
                if queue is not None:
                    queue.put_nowait(RequestDelta(step_output.request.request_id, step_output.delta_text,
                                                  step_output.new_token_ids, step_output.finished, output))
