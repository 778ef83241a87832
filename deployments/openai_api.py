"""The OpenAI-compatible HTTP API over any backend that streams GenerateDeltas; no Ray in here.

`build_app(backend)` returns a FastAPI app serving /v1/models, /v1/completions,
/v1/chat/completions and /health. The backend (the Serve ingress in app.py, a fake in the tests)
needs three methods:

    async def model_info(self) -> ModelInfo
    def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]   # an async generator
    async def abort(self, request_id: str) -> None

A request's life: parse the body (type errors -> 400 naming the field), check `model` (404),
build ponytail.SamplingParams from the mapped fields (bad values -> 400 with its message), start
the backend stream and wait for its first delta, so an error raised there (a prompt too long is a
ConfigError -> 400, BackendUnavailable -> 503, anything else -> 500) still gets a status code.
Then either collect the text into one JSON body or send it as server-sent events. Errors after
the first event are sent as a last `data: {"error": ...}` event before `data: [DONE]`. A client
that goes away mid-request gets its request aborted: the stream's generator is cancelled or
closed, and its cleanup calls backend.abort(request_id).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ponytail import ConfigError, SamplingParams

from .openai_protocol import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                              ChatCompletionRequest, ChatDelta, ChatMessage, Completion, CompletionChoice,
                              CompletionChunk, CompletionRequest, ErrorInfo, ErrorResponse, Model, ModelList,
                              Usage, to_generate_request)
from .protocol import GenerateDelta, GenerateRequest, ModelInfo
from .tools import ToolCallFormat, plan_structured

logger = logging.getLogger("ponytail.openai")

ABORT_TIMEOUT_S = 5.0  # the most a cleanup waits on backend.abort
_PARAM = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=")  # ConfigError messages start "field=value ..."
_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
          503: "service_unavailable_error"}


class Backend(Protocol):
    async def model_info(self) -> ModelInfo: ...

    def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]: ...

    async def abort(self, request_id: str) -> None: ...


class BackendUnavailable(Exception):
    """Raised by a backend when no engine replica can take the request now; the API answers 503."""


class APIError(Exception):
    """An error answered as is, in OpenAI's shape {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=_TYPES.get(status, "server_error"), param=param, code=code)

    def body(self) -> str:
        return ErrorResponse(error=self.info).model_dump_json()

    def response(self) -> Response:
        headers = {"Retry-After": "1"} if self.status == 503 else None
        return Response(self.body(), status_code=self.status, media_type="application/json", headers=headers)


class _ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


def _find(exc: BaseException | None, kind: type[BaseException]) -> BaseException | None:
    """exc, or the error it wraps: Ray's RayTaskError keeps it in `.cause`, `raise ... from` in __cause__."""
    for _ in range(8):  # chains are short; never loop on a cycle
        if exc is None:
            return None
        cause = getattr(exc, "cause", None)
        if isinstance(cause, kind):
            return cause
        if isinstance(exc, kind):
            return exc
        exc = cause if isinstance(cause, BaseException) else exc.__cause__
    return None


def _api_error(exc: BaseException, request_id: str | None = None,
               field_name: Callable[[str], str] | None = None) -> APIError:
    """The answer for an exception: ours as is, ConfigError 400, BackendUnavailable 503, else 500."""
    if isinstance(exc, APIError):
        return exc
    if (config := _find(exc, ConfigError)) is not None:
        message = str(config)
        match = _PARAM.match(message)
        param = match.group(1) if match else None
        if param and field_name is not None and field_name(param) != param:  # max_completion_tokens
            message = message.replace(param, field_name(param), 1)
            param = field_name(param)
        return APIError(400, message, param=param)
    if (unavailable := _find(exc, BackendUnavailable)) is not None:
        return APIError(503, str(unavailable) or "no engine replica is available now; retry later",
                        code="service_unavailable")
    logger.error("request %s failed", request_id, exc_info=exc)
    which = f" in request {request_id}" if request_id else ""
    return APIError(500, f"internal server error{which}; the server log has the details")


def _validation_error(exc: ValidationError) -> APIError:
    """pydantic's errors as one 400 whose message names each field path, e.g. messages[0].content."""
    parts, first = [], None
    for error in exc.errors(include_url=False):
        if error["type"] == "json_invalid":
            return APIError(400, f"the body is not valid JSON: {error['ctx']['error']}")
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"]).lstrip(".") or "body"
        first = first or path
        given = "" if error["type"] == "missing" else f" (got {error['input']!r:.60})"
        parts.append(f"{path}: {error['msg']}{given}")
    return APIError(400, "; ".join(parts), param=first)


def _model_not_found(model: str, info: ModelInfo) -> APIError:
    return APIError(404, f"the model {model!r} does not exist; this server serves {info.model_id!r}",
                    param="model", code="model_not_found")


def _check(delta: GenerateDelta | None) -> GenerateDelta:
    if delta is None:
        raise RuntimeError("the backend stream ended before the request finished")
    if delta.error is not None or delta.finish_reason == "error":
        raise RuntimeError(f"the engine failed request {delta.request_id}: {delta.error}")
    return delta


class _Generation:
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


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body was read, so the next message is the disconnect)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # a server that cannot tell: never claim the client left
        logger.debug("cannot watch for a disconnect", exc_info=True)
        await asyncio.get_running_loop().create_future()


async def _unless_disconnected(request: Request, work):
    """Await `work`, cancelling it and raising _ClientGone if the client disconnects first."""
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
        raise _ClientGone()
    return task.result()


class _EventStream(StreamingResponse):
    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:  # ASGI spec >= 2.4 servers: the client left; nobody to answer
            pass
        finally:  # starlette may stop iterating without closing; closing runs the abort
            await self.body_iterator.aclose()


def _listed(chunks: BaseModel | list[BaseModel]) -> list[BaseModel]:
    return chunks if isinstance(chunks, list) else [chunks]  # a tool-call format may send 0 or several


def _sse(payload: BaseModel | str) -> str:
    return f"data: {payload if isinstance(payload, str) else payload.model_dump_json()}\n\n"


class _CompletionFormat:
    """Response objects of /v1/completions for one request."""

    def __init__(self, request_id: str, model: str):
        self.common = dict(id=request_id, created=int(time.time()), model=model)

    def start(self) -> list[BaseModel]:
        return []

    def text(self, text: str) -> BaseModel:
        return CompletionChunk(choices=[CompletionChoice(text=text)], **self.common)

    def finish(self, finish_reason: str | None) -> BaseModel:
        return CompletionChunk(choices=[CompletionChoice(text="", finish_reason=finish_reason)], **self.common)

    def usage(self, usage: Usage) -> BaseModel:
        return CompletionChunk(choices=[], usage=usage, **self.common)

    def full(self, text: str, finish_reason: str | None, usage: Usage) -> BaseModel:
        return Completion(choices=[CompletionChoice(text=text, finish_reason=finish_reason)], usage=usage,
                          **self.common)


class _ChatFormat(_CompletionFormat):
    """Response objects of /v1/chat/completions for one request."""

    def _chunk(self, delta: ChatDelta, finish_reason: str | None = None) -> BaseModel:
        return ChatCompletionChunk(choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)],
                                   **self.common)

    def start(self) -> list[BaseModel]:
        return [self._chunk(ChatDelta(role="assistant", content=""))]

    def text(self, text: str) -> BaseModel:
        return self._chunk(ChatDelta(content=text))

    def finish(self, finish_reason: str | None) -> BaseModel:
        return self._chunk(ChatDelta(), finish_reason)

    def usage(self, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(choices=[], usage=usage, **self.common)

    def full(self, text: str, finish_reason: str | None, usage: Usage) -> BaseModel:
        return ChatCompletion(choices=[ChatChoice(message=ChatMessage(content=text), finish_reason=finish_reason)],
                              usage=usage, **self.common)


class _OpenAIServer:
    def __init__(self, backend: Backend):
        self.backend = backend
        self._info: ModelInfo | None = None  # a deployment serves one model for its whole life
        self.created = int(time.time())

    async def model_info(self) -> ModelInfo:
        if self._info is None:
            self._info = await self.backend.model_info()
        return self._info

    async def models(self, model_id: str | None = None) -> Response:
        """The model list, or with model_id the one model (404 when it is not the one served)."""
        try:
            info = await self.model_info()
        except Exception as exc:
            return _api_error(exc).response()
        model = Model(id=info.model_id, created=self.created, max_model_len=info.max_model_len)
        if model_id is None:
            return Response(ModelList(data=[model]).model_dump_json(), media_type="application/json")
        if model_id != info.model_id:
            return _model_not_found(model_id, info).response()
        return Response(model.model_dump_json(), media_type="application/json")

    async def generate(self, request: Request, kind: type[CompletionRequest | ChatCompletionRequest]) -> Response:
        request_id, field_name = None, None
        try:
            try:
                req = kind.model_validate_json(await request.body())
            except ValidationError as exc:
                raise _validation_error(exc) from None
            field_name = getattr(req, "field_name", None)
            info = await self.model_info()
            if req.model is not None and req.model != info.model_id:
                raise _model_not_found(req.model, info)
            generate = to_generate_request(req)
            request_id = generate.request_id
            plan = plan_structured(req, generate) if kind is ChatCompletionRequest else None
            SamplingParams(**generate.sampling)  # a bad value raises ConfigError naming the field
            fmt = (_ChatFormat if kind is ChatCompletionRequest else _CompletionFormat)(request_id, info.model_id)
            if plan is not None:
                fmt = ToolCallFormat(fmt, plan)
            generation = _Generation(self.backend, generate)
            streaming = False  # once True, the event stream owns the generation and closes it
            try:  # wait for the first delta: errors raised there still get a status code
                first = _check(await _unless_disconnected(request, generation.next()))
                if req.stream:
                    events = self._events(generation, first, fmt, req.include_usage, field_name)
                    streaming = True
                    return _EventStream(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                                         "X-Request-Id": request_id})
                text, last = await _unless_disconnected(request, self._collect(generation, first))
            finally:
                if not streaming:
                    await generation.close()
            usage = Usage.of(last.prompt_tokens, last.completion_tokens)
            body = fmt.full(text, last.finish_reason, usage).model_dump_json()
            return Response(body, media_type="application/json", headers={"X-Request-Id": request_id})
        except _ClientGone:
            logger.info("client disconnected; request %s aborted", request_id)
            return Response(status_code=499)
        except Exception as exc:
            return _api_error(exc, request_id, field_name).response()

    @staticmethod
    async def _collect(generation: _Generation, delta: GenerateDelta) -> tuple[str, GenerateDelta]:
        pieces = [delta.text]
        while not delta.finished:
            delta = _check(await generation.next())
            pieces.append(delta.text)
        return "".join(pieces), delta

    @staticmethod
    async def _events(generation: _Generation, delta: GenerateDelta, fmt: _CompletionFormat,
                      include_usage: bool, field_name) -> AsyncIterator[str]:
        error = None
        try:
            for chunk in fmt.start():
                yield _sse(chunk)
            while True:
                if delta.text:
                    for chunk in _listed(fmt.text(delta.text)):
                        yield _sse(chunk)
                if delta.finished:
                    break
                delta = _check(await generation.next())
            for chunk in _listed(fmt.finish(delta.finish_reason)):
                yield _sse(chunk)
            if include_usage:
                yield _sse(fmt.usage(Usage.of(delta.prompt_tokens, delta.completion_tokens)))
        except Exception as exc:
            error = _api_error(exc, generation.request_id, field_name)
        finally:  # also on cancellation or close(): aborts the request unless it finished
            await generation.close()
        if error is not None:
            yield _sse(error.body())
        yield _sse("[DONE]")


def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Unknown paths and methods, in OpenAI's shape."""
    return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").response()


def _internal_error(request: Request, exc: Exception) -> Response:
    """The last resort for a bug in this module: a 500 without details."""
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return APIError(500, "internal server error; the server log has the details").response()


def build_app(backend: Backend) -> FastAPI:
    """The OpenAI-compatible API over `backend` (see the module docstring for what it must provide)."""
    server = _OpenAIServer(backend)
    app = FastAPI(title="Ponytail OpenAI-compatible API")
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> Response:
        return await server.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        return await server.models(model_id)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.generate(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.generate(request, ChatCompletionRequest)

    return app
