"""A request's backend streams: the Backend an API serves from, reading its deltas, merging several
requests' streams, watching for the client to leave, and writing server-sent events.

A client that goes away mid-request gets its request aborted: the stream's generator is cancelled
or closed, and its cleanup calls backend.abort(request_id).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Protocol

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from .errors import APIError, ClientGone
from .protocol import GenerateDelta, GenerateRequest, ModelInfo

logger = logging.getLogger("ponytail.openai")

ABORT_TIMEOUT_S = 5.0  # the most a cleanup waits on backend.abort
DONE = object()  # the end of a stream: `data: [DONE]` in OpenAI's chat and completions streams


class Backend(Protocol):
    """What the API serves from: an engine replica in this process, or a Serve handle to them.
    /tokenize and /detokenize also call `tokenize` and `detokenize`; /metrics calls `engine_stats`
    where the backend has it (engine series beside the API's)."""

    async def model_info(self) -> ModelInfo: ...

    def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]: ...

    async def abort(self, request_id: str) -> None: ...


def check_delta(delta: GenerateDelta | None) -> GenerateDelta:
    if delta is None:
        raise RuntimeError("the backend stream ended before the request finished")
    if delta.error is not None or delta.finish_reason == "error":
        raise RuntimeError(f"the engine failed request {delta.request_id}: {delta.error}")
    return delta


class Generation:
    """One request's backend stream; close() aborts the request unless it finished."""

    def __init__(self, backend: Backend, request: GenerateRequest):
        self.backend = backend
        self.request_id = request.request_id
        self.deltas = backend.stream(request)
        self.finished = False

    async def next(self) -> GenerateDelta | None:
        try:
            delta = await anext(self.deltas)
        except StopAsyncIteration:
            self.finished = True
            return None
        self.finished = delta.finished
        return delta

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):  # runs while the response is being cancelled
            if not self.finished:
                try:  # before aclose: a backend may forget the request once its stream closes
                    await asyncio.wait_for(self.backend.abort(self.request_id), ABORT_TIMEOUT_S)
                except Exception:
                    logger.warning("aborting request %s failed", self.request_id, exc_info=True)
            try:
                await self.deltas.aclose()
            except Exception:
                logger.warning("closing the stream of request %s failed", self.request_id, exc_info=True)


async def all_or_none(coroutines) -> list:
    """asyncio.gather's results, except that the first failure cancels the other tasks and waits for
    them before it propagates: gather leaves them running, still reading their streams, which close()
    then cannot close (a prompt refused among good ones: "generator is already running")."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    finally:
        pending = [task for task in tasks if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)


async def close_all(generations: list[Generation]) -> None:
    """One after another: each close() shields itself at once, which tasks started inside a
    cancelled scope (asyncio.gather) would not get to do."""
    for generation in generations:
        await generation.close()


async def merged(generations: list[Generation], firsts: list[GenerateDelta]
                 ) -> AsyncIterator[tuple[int, GenerateDelta]]:
    """(stream index, delta) of several streams as they come; the first deltas first. One
    stream's error ends the whole merge (the caller closes, and so aborts, the others)."""
    for index, first in enumerate(firsts):
        yield index, first
    pending = {index for index, first in enumerate(firsts) if not first.finished}
    if len(pending) == 1:  # the common case: no tasks
        index = pending.pop()
        delta = firsts[index]
        while not delta.finished:
            delta = check_delta(await generations[index].next())
            yield index, delta
        return
    tasks = {asyncio.ensure_future(generations[i].next()): i for i in pending}
    try:
        while tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = tasks.pop(task)
                delta = check_delta(task.result())
                yield index, delta
                if not delta.finished:
                    tasks[asyncio.ensure_future(generations[index].next())] = index
    finally:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body was read, so the next message is the disconnect)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # a server that cannot tell: never claim the client left
        logger.debug("cannot watch for a disconnect", exc_info=True)
        await asyncio.get_running_loop().create_future()


async def unless_disconnected(request: Request, work):
    """Await `work`, cancelling it and raising ClientGone if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        raise ClientGone()
    return task.result()


class EventStream(StreamingResponse):
    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:  # ASGI spec >= 2.4 servers: the client left; nobody to answer
            pass
        finally:  # starlette may stop iterating without closing; closing runs the abort
            await self.body_iterator.aclose()


def _sse(payload: BaseModel | dict | str) -> str:
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json()
    elif isinstance(payload, dict):  # a Responses API event: named, as OpenAI sends them
        return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n"
    return f"data: {payload}\n\n"


async def as_sse(items: AsyncIterator, done: bool = True) -> AsyncIterator[str]:
    """Server-sent events of a stream's objects (chunks, an APIError, DONE); the Responses API
    sends no `[DONE]` (done=False). Closing this closes the stream below, which aborts its requests."""
    try:
        async for item in items:
            if item is DONE:
                if done:
                    yield _sse("[DONE]")
            elif isinstance(item, APIError):
                yield _sse(item.body())
            else:
                yield _sse(item)
    finally:
        await items.aclose()
