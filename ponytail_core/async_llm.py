"""An asyncio front for the engine, for servers: add a request, iterate over its deltas, abort.

One background task drives the engine; each step runs in a worker thread so the event loop stays
responsive while the device works. The event loop never waits for a step: new requests, aborts
and clean-ups are handed over through thread-safe deques and applied by the worker between steps.
Requests are checked (and refused with ConfigError) on the caller's side before they are queued;
a structured-output request waits there for its grammar (compiled in its own thread, cached).
With async scheduling (the default on CUDA) a step hands back the previous step's deltas while the
new one runs on the device; an abort between steps drops the token still being sampled. A consumer
that falls behind gets what waits for it as one delta (as vLLM's output collector merges them), so
a slow stream costs one hand-over per read, not one per token. With `stream_interval_s` a stream
also waits that long after each delta but the first, so a server hands its transport (Ray, HTTP)
one message per interval instead of one per token (Ray Serve LLM batches every 50 ms the same
way); the first token and the finished delta are never held back. `max_deltas_per_s` bounds the
messages of all streams together: with many streams past their first delta each waits streams /
max_deltas_per_s (never less than stream_interval_s; queued requests send nothing and do not
count), so a server's per-message work stops growing with the number of streams (it shares the
process, and the GIL, with the engine's host work).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial

from .errors import ConfigError
from .llm import LLM
from .engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search_async
from .engine.llm_engine import LLMEngine
from .engine.stats import EngineStats
from .engine.request import Request, RequestOutput
from .sampling.params import SamplingParams
from .utils.units import is_seconds


@dataclass(slots=True)
class RequestDelta:
    """What one sample (`index`) of a request produced since the last delta; `output` is the
    cumulative view of every sample as of this delta (built when first read). `finished`: the
    whole request is over (its last delta)."""

    request_id: str
    delta_text: str
    new_token_ids: list[int]
    finished: bool
    snapshot: RequestOutput | Callable[[], RequestOutput]  # the output, or what builds it at the first read
    index: int = 0  # the sample (n > 1): output.outputs[index] while the request runs

    @property
    def output(self) -> RequestOutput:
        if not isinstance(self.snapshot, RequestOutput):
            self.snapshot = self.snapshot()
        return self.snapshot

    def merged_with(self, later: RequestDelta) -> RequestDelta:
        """This delta followed by a later one of the same request and sample, as one."""
        return RequestDelta(self.request_id, self.delta_text + later.delta_text,
                            self.new_token_ids + later.new_token_ids, later.finished, later.snapshot, self.index)


@dataclass(slots=True)
class _Stream:
    """One request's deliveries. `wake` ends a stream's wait between deltas early: set once what
    ends the request (a finished delta or an error) is queued, or by the wait's own timer."""

    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    ended: bool = False
    held: RequestDelta | None = None  # taken from the queue while merging, another sample's: next out

    def put(self, item: RequestDelta | BaseException) -> None:
        self.queue.put_nowait(item)
        if isinstance(item, BaseException) or item.finished:
            self.ended = True
            self.wake.set()

    async def wait_until(self, deadline: float) -> None:
        """Until the loop's clock reaches `deadline`, or at once when the request has ended."""
        loop = asyncio.get_running_loop()
        if self.ended or deadline <= loop.time():
            return
        self.wake.clear()
        timer = loop.call_at(deadline, self.wake.set)
        try:
            await self.wake.wait()
        finally:
            timer.cancel()


class AsyncLLM:
    def __init__(self, llm: LLM | LLMEngine, stream_interval_s: float = 0.0, max_deltas_per_s: float | None = None):
        if not is_seconds(stream_interval_s):
            raise ConfigError(f"stream_interval_s={stream_interval_s!r} is not supported; allowed: seconds >= 0 "
                              "(0: a delta per engine step)")
        if max_deltas_per_s is not None and not (is_seconds(max_deltas_per_s) and max_deltas_per_s > 0):
            raise ConfigError(f"max_deltas_per_s={max_deltas_per_s!r} is not supported; allowed: a number > 0, "
                              "or None (no bound)")
        self.engine = llm.engine if isinstance(llm, LLM) else llm
        # ProcessAsyncLLM (no engine here) sets both from its engine's process.
        self.tokenizer = None if self.engine is None else self.engine.tokenizer
        self.eos_token_ids: frozenset[int] = frozenset() if self.engine is None else self.engine.eos_token_ids
        self.stream_interval_s = float(stream_interval_s)
        self.max_deltas_per_s = None if max_deltas_per_s is None else float(max_deltas_per_s)
        self._incoming: deque[Request] = deque()  # prepared on the loop, enqueued by the worker
        self._aborts: deque[str] = deque()
        self._forget: deque[str] = deque()
        self._streams: dict[str, _Stream] = {}
        self._num_streaming = 0  # streams past their first delta: the ones max_deltas_per_s shares out
        self._loop_task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self.num_steps = 0  # engine steps driven so far
        self.step_seconds = 0.0  # their time in the worker thread: with the wall clock, how busy the engine is

    async def beam_search(self, prompt_ids: list[int], params: BeamSearchParams, request_id: str,
                          cache_salt: str | None = None, priority: int = 0,
                          skip_special_tokens: bool = True) -> BeamSearchOutput:
        """LLM.beam_search for one prompt on this engine's loop (engine/beam_search.py)."""
        decode = None if self.tokenizer is None else partial(self.tokenizer.decode,
                                                             skip_special_tokens=skip_special_tokens)
        return await beam_search_async(self.generate, prompt_ids, params, self.eos_token_ids, request_id, decode,
                                       cache_salt, priority)

    def stream_interval(self) -> float:
        """Seconds a stream waits after a delta: stream_interval_s, or longer with more streams past
        their first delta than max_deltas_per_s x stream_interval_s."""
        if self.max_deltas_per_s is None:
            return self.stream_interval_s
        return max(self.stream_interval_s, self._num_streaming / self.max_deltas_per_s)

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestDelta]:
        """Add a request and yield its deltas as they come; aborts it if the consumer stops early.
        priority: the engine's scheduling_policy "priority" runs lower first (vLLM's)."""
        request_id, submit = await self._admit(prompt, params, request_id, priority)
        if request_id in self._streams:
            raise ConfigError(f"request_id={request_id!r} is already in use")
        stream = _Stream()
        queue = stream.queue
        self._streams[request_id] = stream
        submit()
        finished = False
        error: BaseException | None = None  # met while merging: raised after the merged delta
        last_yield: float | None = None
        streaming = False  # counted in _num_streaming
        try:
            while not finished:
                if error is not None:
                    raise error
                if last_yield is not None and (interval := self.stream_interval()):
                    await stream.wait_until(last_yield + interval)
                item, stream.held = stream.held or await queue.get(), None
                if isinstance(item, BaseException):
                    raise item
                while not item.finished and not queue.empty():  # the consumer fell behind
                    later = queue.get_nowait()
                    if isinstance(later, BaseException):
                        error = later
                        break
                    if later.index != item.index:  # another sample's text: its own delta, next
                        stream.held = later
                        break
                    item = item.merged_with(later)
                finished = item.finished
                if not streaming:
                    streaming = True
                    self._num_streaming += 1
                yield item
                last_yield = asyncio.get_running_loop().time()
        finally:
            if streaming:
                self._num_streaming -= 1
            self._streams.pop(request_id, None)
            if not finished:
                self._aborts.append(request_id)
            self._forget.append(request_id)
            try:
                self._ensure_loop()
            except RuntimeError:  # the event loop is shutting down: nothing more to drive
                pass

    async def _admit(self, prompt: str | list[int], params: SamplingParams | None,
                     request_id: str | None, priority: int = 0) -> tuple[str, Callable[[], None]]:
        """Check a request on the caller's side (ConfigError names what is wrong) and wait for its
        grammar; returns its id and what hands it to the engine once its stream is registered."""
        request = self.engine.prepare_request(prompt, params, request_id, priority)
        if request.grammar_ready is not None:  # compiled in the grammar thread; ConfigError if it cannot be
            await asyncio.wrap_future(request.grammar_ready)

        def submit() -> None:
            self._incoming.append(request)
            self._ensure_loop()

        return request.request_id, submit

    async def abort(self, request_id: str) -> bool:
        """Ask for a request to stop; its stream ends with a finished delta (reason "abort")."""
        if request_id not in self._streams:
            return False
        self._aborts.append(request_id)
        self._ensure_loop()
        return True

    def stats(self) -> EngineStats:
        return self.engine.stats()  # counters only: safe to read while a step runs

    # ------------------------------------------------------------ the loop
    def _ensure_loop(self) -> None:
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        self._wakeup.set()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _idle(self) -> None:
        """Wait for work. With KV memory to spare, maintain the pool when the cache's release
        delay is up, so an idle server gives that memory back (no step runs to do it)."""
        delay = self.engine.cache.seconds_until_release()
        if delay is None:
            await self._wakeup.wait()
            return
        # Not wait_for: on Python < 3.12 it returns normally when the event is set as the task is
        # cancelled (a stream's last hand-over at asyncio.run's exit), and the loop then never ends.
        expired = False

        def time_up():
            nonlocal expired
            expired = True
            self._wakeup.set()

        deadline = asyncio.get_running_loop().call_later(delay + 0.01, time_up)
        try:
            await self._wakeup.wait()
        finally:
            deadline.cancel()
        if expired and not self._has_work():
            await asyncio.to_thread(self.engine.maintain)

    def _has_work(self) -> bool:
        return bool(self._incoming or self._aborts or self._forget) or self.engine.has_unfinished()

    def _step(self):
        """Worker thread: apply hand-overs, then one engine step. Returns what to deliver."""
        start = time.perf_counter()
        try:
            return self._step_untimed()
        finally:
            self.num_steps += 1
            self.step_seconds += time.perf_counter() - start

    def _step_untimed(self):
        engine = self.engine
        delivered, failed = [], []
        while self._incoming:
            request = self._incoming.popleft()
            try:
                engine.enqueue(request)
            except Exception as exc:
                failed.append((request.request_id, exc))
        while self._aborts:
            request_id = self._aborts.popleft()
            if engine.abort(request_id):
                request = engine.requests[request_id]
                delivered.append(RequestDelta(request_id, "", [], True, engine.output(request)))
        while self._forget:
            request_id = self._forget.popleft()
            request = engine.requests.get(request_id)
            if request is not None and request.done:
                engine.forget(request_id)
        for out in engine.step():
            root = out.request.root  # its stream's request (n > 1: the parent of the samples)
            # Built when read: a stream merging its deltas reads one per message, not one per step.
            output = engine.output(root) if out.done or root.group is not None else engine.output_later(root)
            delivered.append(RequestDelta(root.request_id, out.delta_text, out.new_token_ids, out.done, output,
                                          out.request.index))
        return delivered, failed

    async def _run(self) -> None:
        while True:
            if not self._has_work():
                self._wakeup.clear()
                if self._has_work():  # a hand-over raced with the clear
                    continue
                await self._idle()
                continue
            try:
                delivered, failed = await asyncio.to_thread(self._step)
            except Exception as exc:  # a failed step fails its requests, not the server
                for request_id, stream in list(self._streams.items()):
                    stream.put(exc)
                    self._aborts.append(request_id)
                continue
            for request_id, exc in failed:
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream.put(exc)
            for delta in delivered:
                stream = self._streams.get(delta.request_id)
                if stream is not None:
                    stream.put(delta)
