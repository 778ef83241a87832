"""The engine's step loop in a process of its own, as vLLM's engine core: the child side of
ponytail.ProcessAsyncLLM.

A server's process streams every request's deltas (Ray messages, HTTP chunks); with the engine's
step loop in a thread there, both share one GIL and each slows the other: a small model's steps
run at about half their speed behind a few hundred streams. Here the loop owns a process, so a
GIL, of its own. The parent sends requests and aborts down one pipe; between steps the loop admits
them, and after each step it sends up the other pipe one message for all requests: their new
tokens and text (the whole output only where the parent needs more than that), the engine's
counters and the prefix-cache events since the last message.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from .engine.request import CompletionOutput, Request, RequestOutput
from .engine.stats import EngineStats
from .kv.prefix_events import PrefixEvent, PrefixEventLog
from .llm import LLM

# parent -> core
ADD, ABORT, STOP = "add", "abort", "stop"
# core -> parent
READY, INIT_FAILED, NEWS, STEP_FAILED = "ready", "init_failed", "news", "step_failed"

GRAMMAR_POLL_S = 0.002  # how often an otherwise idle loop looks at a compiling grammar
# engine.stats() costs ~30 us: a busy loop sends it this often (the router reads it every 0.2 s),
# and always once the engine is idle, so the last counters sent are the resting ones.
STATS_PERIOD_S = 0.05


@dataclass(slots=True, frozen=True)
class CoreInfo:
    """What the parent needs to know of the engine once, sent when it is ready."""

    tokenizer: Any  # a transformers tokenizer (pickles), or None
    max_model_len: int
    block_size: int
    vocab_size: int
    device: str  # e.g. "cuda:0": the parent never touches the device itself
    device_uuid: str | None
    stats: EngineStats
    eos_token_ids: frozenset[int] = frozenset()  # what ends an answer (beam search ranks by it)


@dataclass(slots=True)
class StepNews:
    """One message per step (or per batch of admissions and aborts between steps).

    deltas: (request_id, sample index, new text, new token ids, request finished, output) each;
    output is the whole RequestOutput where the parent cannot build it from what it has (a
    request's first delta, its last, logprobs, several samples), else None."""

    deltas: list[tuple[str, int, str, list[int], bool, RequestOutput | None]]
    refused: list[tuple[str, BaseException]]  # requests the engine would not take, and why
    stats: EngineStats | None  # None: unchanged since the last message that had them (STATS_PERIOD_S)
    prefix_events: list[PrefixEvent]
    num_steps: int
    step_seconds: float


def run_engine_core(requests: Connection, news: Connection, llm_kwargs: dict, prefix_log_capacity: int | None) -> None:
    """The child process's entry point: build the engine, say so, run until told to stop or
    until the parent goes away (its end of the pipe closes)."""
    try:
        llm = LLM(**llm_kwargs)
        log = llm.publish_prefix_events(prefix_log_capacity) if prefix_log_capacity else None
        info = CoreInfo(tokenizer=llm.tokenizer, max_model_len=llm.max_model_len, block_size=llm.block_size,
                        vocab_size=llm.vocab_size, device=str(llm.device), device_uuid=llm.device_uuid,
                        stats=llm.stats(), eos_token_ids=llm.engine.eos_token_ids)
    except BaseException as exc:  # the parent raises it from its constructor
        news.send((INIT_FAILED, picklable(exc)))
        return
    news.send((READY, info))
    EngineCore(llm.engine, requests, news, log).run()


class EngineCore:
    def __init__(self, engine, requests: Connection, news: Connection, log: PrefixEventLog | None):
        self.engine = engine
        self.requests, self.news = requests, news
        self.log = log
        self.sent_seq = 0  # the newest prefix event sent up
        self.compiling: list[Request] = []  # admitted, waiting for their grammar
        self.announced: set[str] = set()  # requests whose whole output went up once
        self.deltas: list[tuple] = []
        self.refused: list[tuple[str, BaseException]] = []
        self.num_steps, self.step_seconds = 0, 0.0
        self.stats_sent = 0.0  # time.monotonic() of the last counters sent

    def run(self) -> None:
        engine = self.engine
        while True:
            timeout = self._timeout()
            if self.requests.poll(timeout):
                if not self._receive():
                    return
            elif timeout is not None and not self.compiling and not engine.has_unfinished():
                engine.maintain()  # idle past the release delay: spare KV memory goes back
                self._send()
                continue
            self._admit_compiled()
            if engine.has_unfinished():
                self._step()
            if self.deltas or self.refused or engine.has_unfinished():
                self._send()

    def _timeout(self) -> float | None:
        """How long to wait for the parent: not at all with work to do, else until the pool's
        release delay is up (None: no delay pending, wait for the parent)."""
        if self.engine.has_unfinished():
            return 0
        if self.compiling:
            return GRAMMAR_POLL_S
        delay = self.engine.cache.seconds_until_release()
        return None if delay is None else delay + 0.01

    def _receive(self) -> bool:
        """Apply everything the parent has sent; False when it said stop or went away."""
        try:
            while True:
                message = self.requests.recv()
                if message[0] == ADD:
                    self._add(*message[1:])
                elif message[0] == ABORT:
                    self._abort(message[1])
                else:  # STOP
                    return False
                if not self.requests.poll(0):
                    return True
        except (EOFError, OSError):  # the parent's process is gone
            return False

    def _add(self, request_id: str, prompt, params, priority: int = 0) -> None:
        try:
            request = self.engine.prepare_request(prompt, params, request_id, priority)
            if request.grammar_ready is not None and not request.grammar_ready.done():
                self.compiling.append(request)
            else:
                self.engine.enqueue(request)  # a failed grammar raises its ConfigError here
        except Exception as exc:
            self.refused.append((request_id, picklable(exc)))

    def _admit_compiled(self) -> None:
        for request in [r for r in self.compiling if r.grammar_ready.done()]:
            self.compiling.remove(request)
            try:
                self.engine.enqueue(request)
            except Exception as exc:
                self.refused.append((request.request_id, picklable(exc)))

    def _abort(self, request_id: str) -> None:
        waiting = next((r for r in self.compiling if r.request_id == request_id), None)
        if waiting is not None:
            self.compiling.remove(waiting)
            self.deltas.append((request_id, 0, "", [], True, _aborted_output(waiting)))
        elif self.engine.abort(request_id):
            self.deltas.append((request_id, 0, "", [], True, self.engine.output(self.engine.requests[request_id])))
            self._forget(request_id)

    def _step(self) -> None:
        engine = self.engine
        start = time.perf_counter()
        try:
            outputs = engine.step()
        except Exception as exc:  # a failed step fails its requests, not the engine
            self._fail_all(exc)
            return
        finally:
            self.num_steps += 1
            self.step_seconds += time.perf_counter() - start
        finished = []
        for out in outputs:
            root = out.request.root  # its stream's request (n > 1: the parent of the samples)
            request_id = root.request_id
            whole = (out.done or request_id not in self.announced or root.group is not None
                     or root.params.logprobs is not None)
            self.deltas.append((request_id, out.request.index, out.delta_text, out.new_token_ids, out.done,
                                engine.output(root) if whole else None))
            self.announced.add(request_id)
            if out.done:
                finished.append(request_id)
        for request_id in finished:
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self.announced.discard(request_id)
        request = self.engine.requests.get(request_id)
        if request is not None and request.done:
            self.engine.forget(request_id)

    def _fail_all(self, exc: Exception) -> None:
        """Every request this engine holds ends; the parent fails their streams with `exc`."""
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            self._forget(request_id)
        self.compiling.clear()
        self.deltas.clear()
        self.news.send((STEP_FAILED, picklable(exc)))

    def _send(self) -> None:
        events = self.log.since(self.sent_seq) if self.log is not None else []
        if events:
            self.sent_seq = events[-1].seq
        now = time.monotonic()
        stats = None
        if now - self.stats_sent >= STATS_PERIOD_S or not self.engine.has_unfinished():
            stats, self.stats_sent = self.engine.stats(), now
        self.news.send((NEWS, StepNews(self.deltas, self.refused, stats, events, self.num_steps, self.step_seconds)))
        self.deltas, self.refused = [], []


def _aborted_output(request: Request) -> RequestOutput:
    """The output of a request aborted before the engine took it (its grammar was compiling)."""
    return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                         [CompletionOutput(0, "", [], "abort")], True, request.metrics)


def picklable(exc: BaseException) -> BaseException:
    """`exc` if it crosses a pipe intact, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")

