"""`ProcessAsyncLLM`: AsyncLLM with the engine in a child process (vLLM's engine core and its
client). Same streams, intervals and aborts; the steps no longer share this process's GIL.

    llm = ponytail.ProcessAsyncLLM(dict(model="HuggingFaceTB/SmolLM2-135M-Instruct"), stream_interval_s=0.05)
    async for delta in llm.generate("Hello", ponytail.SamplingParams(max_tokens=16)): ...
    llm.shutdown()

The child (engine_core.py) is started with the "spawn" method, so it builds its own CUDA
context: this process never touches the device (it reads the device's name and UUID from the
child). A reader thread takes the child's one message per step and hands it to the event loop
that called `generate`; a request the engine refuses raises its error from the stream, as
AsyncLLM's do. If the child dies, every open stream and every later request raise EngineDeadError
(a server's health check reports it through `dead`). The child exits by itself when this process
goes away (its pipe closes), so a killed server never leaves an engine holding the GPU.
"""

from __future__ import annotations

import asyncio
import atexit
import multiprocessing
import threading
import uuid
import weakref
from collections.abc import Callable

import torch

from .async_llm import AsyncLLM, RequestDelta
from .engine_core import (ABORT, ADD, INIT_FAILED, NEWS, STEP_FAILED, STOP, CoreInfo, StepNews,
                                  run_engine_core)
from .engine.request import RequestOutput
from .engine.stats import EngineStats
from .errors import ConfigError, EngineDeadError
from .kv.prefix_events import PrefixEventLog
from .sampling.params import SamplingParams

STOP_TIMEOUT_S = 10.0  # shutdown(): how long the child may take to exit before it is killed


class ProcessAsyncLLM(AsyncLLM):
    """llm_kwargs: ponytail.LLM's arguments (picklable: a model name or path, or a small model
    object). prefix_log_capacity: record prefix-cache events for a router (LLM.publish_prefix_events)
    from the start; `publish_prefix_events` returns this process's copy of them."""

    def __init__(self, llm_kwargs: dict, stream_interval_s: float = 0.0, max_deltas_per_s: float | None = None,
                 prefix_log_capacity: int | None = None):
        super().__init__(None, stream_interval_s=stream_interval_s, max_deltas_per_s=max_deltas_per_s)
        self.dead: EngineDeadError | None = None
        self._stopped = False
        self._reaping = threading.Lock()  # one thread waits for the child at a time (two would race in waitpid)
        context = multiprocessing.get_context("spawn")  # a fork would copy a CUDA context and Ray's threads
        child_requests, self._requests = context.Pipe(duplex=False)  # (receiving end, sending end)
        self._news, child_news = context.Pipe(duplex=False)
        self._process = context.Process(target=run_engine_core, name="ponytail-engine-core",
                                        args=(child_requests, child_news, llm_kwargs, prefix_log_capacity))
        self._process.start()
        child_requests.close()  # the child's ends: closed here, so its exit reads as EOF
        child_news.close()
        # The parent process exiting normally stops the child first (a killed one closes the pipe).
        atexit.register(_shutdown_ref, weakref.ref(self))
        info = self._wait_until_ready()
        self.tokenizer, self.eos_token_ids = info.tokenizer, info.eos_token_ids
        self.max_model_len, self.block_size, self.vocab_size = info.max_model_len, info.block_size, info.vocab_size
        self.device, self.device_uuid = torch.device(info.device), info.device_uuid
        self._stats: EngineStats = info.stats
        self._log = PrefixEventLog(prefix_log_capacity) if prefix_log_capacity else None
        self._outputs: dict[str, RequestOutput] = {}  # each running request's output as of its latest delta
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader = threading.Thread(target=self._read, name="ponytail-engine-news", daemon=True)
        self._reader.start()

    def _wait_until_ready(self) -> CoreInfo:
        while not self._news.poll(1.0):
            if not self._process.is_alive():
                raise EngineDeadError(f"the engine process exited with code {self._process.exitcode} before "
                                      "it was ready (its log says why)")
        kind, payload = self._news.recv()
        if kind == INIT_FAILED:
            self._process.join(STOP_TIMEOUT_S)
            raise payload
        return payload

    # ------------------------------------------------------------ what LLM offers a server
    def stats(self) -> EngineStats:
        """The engine's counters as of its latest step, or STATS_PERIOD_S older while it runs."""
        return self._stats

    def publish_prefix_events(self, capacity: int) -> PrefixEventLog:
        if self._log is None or self._log.capacity != capacity:
            raise ConfigError(f"capacity={capacity!r}: this engine records prefix events only as asked when it "
                              f"started; allowed: prefix_log_capacity={self._log.capacity if self._log else None}")
        return self._log

    # ------------------------------------------------------------ AsyncLLM's hooks
    async def _admit(self, prompt: str | list[int], params: SamplingParams | None,
                     request_id: str | None, priority: int = 0) -> tuple[str, Callable[[], None]]:
        """The engine checks the request in its process: a refusal raises from the stream."""
        if self.dead is not None:
            raise self.dead
        if self._stopped:
            raise EngineDeadError("the engine process stopped (it was shut down); requests fail until the "
                                  "server restarts it")
        if params is not None and not isinstance(params, SamplingParams):
            raise ConfigError(f"params must be a ponytail.SamplingParams, got {type(params).__name__}")
        self._loop = asyncio.get_running_loop()  # where the reader delivers
        request_id = uuid.uuid4().hex if request_id is None else str(request_id)
        return request_id, lambda: self._send((ADD, request_id, prompt, params, priority))

    def _ensure_loop(self) -> None:
        """Aborts go down the pipe at once; the child forgets finished requests by itself."""
        while self._aborts:
            self._send((ABORT, self._aborts.popleft()))
        self._forget.clear()

    def _send(self, message: tuple) -> None:
        if self.dead is not None:
            return
        try:
            self._requests.send(message)
        except (OSError, ValueError):  # the child is gone: the reader says so
            pass

    # ------------------------------------------------------------ the child's news
    def _read(self) -> None:
        """Reader thread: each message of the child goes to the event loop of the streams."""
        try:
            while True:
                message = self._news.recv()
                self._deliver(self._on_message, message)
        except (EOFError, OSError):
            pass
        with self._reaping:
            self._process.join(STOP_TIMEOUT_S)
        reason = ("it was shut down" if self._stopped else
                  f"it exited with code {self._process.exitcode}; its log says why")
        self._deliver(self._on_dead, EngineDeadError(f"the engine process stopped ({reason}); requests fail "
                                                     "until the server restarts it"))

    def _deliver(self, callback, argument) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            callback(argument)  # nobody streams: apply it here (counters, the dead flag)
            return
        try:
            loop.call_soon_threadsafe(callback, argument)
        except RuntimeError:  # the loop closed meanwhile
            callback(argument)

    def _on_message(self, message: tuple) -> None:
        kind, payload = message
        if kind == NEWS:
            self._on_news(payload)
        elif kind == STEP_FAILED:  # the child ended every request: their streams raise the step's error
            self._outputs.clear()
            for stream in list(self._streams.values()):
                stream.put(payload)

    def _on_news(self, news: StepNews) -> None:
        self.num_steps, self.step_seconds = news.num_steps, news.step_seconds
        if news.stats is not None:
            self._stats = news.stats
        if self._log is not None:
            self._log.extend(news.prefix_events)
        for request_id, exc in news.refused:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put(exc)
        for request_id, index, text, token_ids, finished, output in news.deltas:
            if output is None:  # a running request's plain delta: extend what the last whole output said
                output = self._outputs.get(request_id)
                if output is None:  # its consumer left (the child was told to abort it)
                    continue
                choice = output.outputs[index]
                choice.token_ids.extend(token_ids)
                choice.text += text
            elif finished:
                self._outputs.pop(request_id, None)
            else:
                self._outputs[request_id] = output
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put(RequestDelta(request_id, text, token_ids, finished, output, index))

    def _on_dead(self, error: EngineDeadError) -> None:
        self.dead = error
        self._outputs.clear()
        for stream in list(self._streams.values()):
            stream.put(error)

    # ------------------------------------------------------------ stopping
    def shutdown(self) -> None:
        """Stop the engine process (its requests end); idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._send((STOP,))
        with self._reaping:
            self._process.join(STOP_TIMEOUT_S)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(STOP_TIMEOUT_S)
        self._requests.close()


def _shutdown_ref(ref: weakref.ref) -> None:
    llm = ref()
    if llm is not None:
        llm.shutdown()
