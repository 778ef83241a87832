"""The OpenAI-compatible HTTP API over any backend that streams GenerateDeltas; no Ray in here.

`build_app(backend)` returns a FastAPI app serving /v1/models, /v1/completions,
/v1/chat/completions, /v1/responses (a chat request in the Responses API's words: responses_protocol.py
and responses_api.py), /tokenize, /detokenize, /version, /metrics and /health. The backend (the Serve
ingress in app.py, a fake in the tests) needs these methods (the last two for /tokenize and
/detokenize only):

    async def model_info(self) -> ModelInfo
    def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]   # an async generator
    async def abort(self, request_id: str) -> None
    async def tokenize(self, prompt: str | None, messages: list[dict] | None, options: dict) -> list[int]
    async def detokenize(self, token_ids: list[int]) -> str
    async def engine_stats(self) -> dict[str, EngineStats]   # optional: engine series in /metrics

A request's life: the HTTP guard (http_guard.py: API key 401, JSON only 415, body size 413),
parse the body (type errors and OpenAI's ranges -> 400 naming the field), check `model` (404) and
the request limits (limits.py, 400; `context_length_exceeded` when over the context), build
ponytail.SamplingParams from the mapped fields (bad values -> 400 with its message), start
the backend stream and wait for its first delta, so an error raised there (a prompt too long is a
ConfigError -> 400, BackendUnavailable -> 503 with Retry-After, anything else -> 500) still gets
a status code.
Then either collect the text into one JSON body or send it as server-sent events. Errors after
the first event are sent as a last `data: {"error": ...}` event before `data: [DONE]`. A client
that goes away mid-request gets its request aborted: the stream's generator is cancelled or
closed, and its cleanup calls backend.abort(request_id).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

import ponytail
from ponytail import ConfigError, ContextLengthError, SamplingParams

from .openai_protocol import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                              ChatCompletionRequest, ChatDelta, ChatMessage, Completion, CompletionChoice,
                              CompletionChunk, CompletionRequest, DetokenizeRequest, DetokenizeResponse,
                              ErrorInfo, TokenizeRequest, TokenizeResponse, ErrorResponse, Model, ModelList,
                              Usage, set_beam_search, to_generate_requests)
from .api_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .api_metrics import ApiMetrics
from .openai_logprobs import chat_logprobs, completion_logprobs
from .protocol import GenerateDelta, GenerateRequest, ModelInfo, TokenLogprob
from .http_guard import AccessPolicy, install
from .limits import LimitExceeded, RequestLimits
from .openapi_bodies import publish_request_models, request_body
from .prompts import with_template_defaults
from .reasoning import with_reasoning
from . import anthropic_api, anthropic_protocol, responses_protocol
from .responses_api import ResponsesShape
from .tools import ToolCallFormat, plan_structured, template_messages

logger = logging.getLogger("ponytail.openai")

ABORT_TIMEOUT_S = 5.0  # the most a cleanup waits on backend.abort
MAX_MESSAGE_CHARS = 1000  # error messages are cut here, so user input is never echoed back whole
# ConfigError messages start "field=value ..." (or "field.part=value ...", "field[0].part=...": the field is named)
_PARAM = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)(?:[.\[][A-Za-z0-9_.\[\]]*)?\s*=")
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          503: "service_unavailable_error"}


@dataclass(frozen=True, slots=True)
class Dialect:
    """Another API's request run as a chat request: `parse` reads the body into (its request, the
    chat request), `shape` answers in that API's shape (whole, events), `error_response` its errors."""

    parse: Callable[[bytes], tuple]
    shape: Callable
    error_response: Callable[[APIError], Response]


class Backend(Protocol):
    async def model_info(self) -> ModelInfo: ...

    def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]: ...

    async def abort(self, request_id: str) -> None: ...


class BackendUnavailable(Exception):
    """Raised by a backend when no engine replica can take the request now; the API answers 503
    with Retry-After: retry_after_s (rounded up to whole seconds, as HTTP wants)."""

    def __init__(self, message: str = "", retry_after_s: float = 1.0):
        super().__init__(message, retry_after_s)  # all in args: it crosses Ray handles pickled
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return self.args[0]


class APIError(Exception):
    """An error answered as is, in OpenAI's shape {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float = 1.0):
        if len(message) > MAX_MESSAGE_CHARS:  # messages may quote user input: never echo it whole
            message = message[:MAX_MESSAGE_CHARS] + "... (truncated)"
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s
        self.info = ErrorInfo(message=message, type=_TYPES.get(status, "server_error"), param=param, code=code)

    def body(self) -> str:
        return ErrorResponse(error=self.info).model_dump_json()

    def headers(self) -> dict[str, str] | None:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))} if self.status == 503 else None

    def response(self) -> Response:
        return Response(self.body(), status_code=self.status, media_type="application/json", headers=self.headers())


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
    if isinstance(exc, LimitExceeded):
        return APIError(exc.status, str(exc), param=exc.param, code=exc.code)
    if (context := _find(exc, ContextLengthError)) is not None:  # OpenAI's code for it, and the field at fault
        param = context.too_many_tokens
        return APIError(400, str(context), param=field_name(param) if field_name else param,
                        code="context_length_exceeded")
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
                        code="service_unavailable", retry_after_s=getattr(unavailable, "retry_after_s", 1.0))
    logger.error("request %s failed", request_id, exc_info=exc)
    which = f" in request {request_id}" if request_id else ""
    return APIError(500, f"internal server error{which}; the server log has the details")


def _parsed(parse: Callable, body: bytes):
    """parse(body), its errors as 400s: pydantic's naming each field, ConfigError's as they are
    (a field this server does not do), json.loads' as not JSON."""
    try:
        return parse(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise APIError(400, f"the body is not valid JSON: {exc}") from None


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
    shown = repr(model) if len(model) <= 100 else f"{model[:100]!r}... ({len(model)} characters)"
    names = " or ".join(repr(name) for name in [info.model_id, *info.aliases])
    return APIError(404, f"the model {shown} does not exist; this server serves {names}",
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


def _echoed(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's text, when it is the assistant's (continue_final_message)."""
    last = req.messages[-1]
    return (last.to_dict()["content"] or "") if req.echo and last.role == "assistant" else ""


DONE = object()  # the end of a stream: `data: [DONE]` in OpenAI's chat and completions streams


def _sse(payload: BaseModel | dict | str) -> str:
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json()
    elif isinstance(payload, dict):  # a Responses API event: named, as OpenAI sends them
        return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n"
    return f"data: {payload}\n\n"


async def _as_sse(items: AsyncIterator, done: bool = True) -> AsyncIterator[str]:
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


def _piece(delta: GenerateDelta) -> tuple[str, list[TokenLogprob] | None]:
    """A delta's text and token logprobs, the echoed prompt (first delta only) in front."""
    text, items = delta.text, delta.logprobs
    if delta.prompt_text is not None:
        text = delta.prompt_text + text
        if delta.prompt_logprobs is not None:
            items = delta.prompt_logprobs + (items or [])
    return text, items


class _CompletionFormat:
    """Response objects of /v1/completions for one request (one choice per prompt)."""

    def __init__(self, request_id: str, model: str, fingerprint: str | None = None):
        self.common = dict(id=request_id, created=int(time.time()), model=model)
        self.fingerprint = fingerprint
        self.text_offsets: dict[int, int] = {}  # per choice: where its next streamed piece starts
        self.tokens_as_ids = False  # logprobs name tokens "token_id:<id>" (vLLM's return_tokens_as_token_ids)

    def start(self, index: int) -> list[BaseModel]:
        return []

    def _logprobs(self, index: int, text: str, items: list[TokenLogprob] | None):
        offset = self.text_offsets.get(index, 0)
        self.text_offsets[index] = offset + len(text)
        return None if items is None else completion_logprobs(items, offset, self.tokens_as_ids)

    def _chunk(self, choices: list, usage: Usage | None = None) -> BaseModel:
        return CompletionChunk(choices=choices, usage=usage, system_fingerprint=self.fingerprint, **self.common)

    def text(self, index: int, text: str, items: list[TokenLogprob] | None = None) -> list[BaseModel]:
        return [self._chunk([CompletionChoice(index=index, text=text, logprobs=self._logprobs(index, text, items))])]

    def finish(self, index: int, finish_reason: str | None) -> list[BaseModel]:
        return [self._chunk([CompletionChoice(index=index, text="", finish_reason=finish_reason)])]

    def usage(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)

    def choice(self, index: int, text: str, finish_reason: str | None, items: list[TokenLogprob] | None):
        return CompletionChoice(index=index, text=text, finish_reason=finish_reason,
                                logprobs=self._logprobs(index, text, items))

    def full(self, choices: list, usage: Usage) -> BaseModel:
        return Completion(choices=choices, usage=usage, system_fingerprint=self.fingerprint, **self.common)


class _ChatFormat(_CompletionFormat):
    """Response objects of /v1/chat/completions for one request; `echo`: text each answer starts with."""

    echo = ""

    @property
    def chat_format(self) -> _ChatFormat:  # what the wrapping formats (tools, reasoning) call theirs
        return self

    def _delta(self, index: int, delta: ChatDelta, finish_reason: str | None = None,
               items: list[TokenLogprob] | None = None) -> BaseModel:
        logprobs = None if items is None else chat_logprobs(items, self.tokens_as_ids)
        return self._chunk([ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)])

    def _chunk(self, choices: list, usage: Usage | None = None) -> BaseModel:
        return ChatCompletionChunk(choices=choices, usage=usage, system_fingerprint=self.fingerprint, **self.common)

    def start(self, index: int) -> list[BaseModel]:
        return [self._delta(index, ChatDelta(role="assistant", content=self.echo))]

    def text(self, index: int, text: str, items: list[TokenLogprob] | None = None) -> list[BaseModel]:
        return [self._delta(index, ChatDelta(content=text), items=items)]

    def finish(self, index: int, finish_reason: str | None) -> list[BaseModel]:
        return [self._delta(index, ChatDelta(), finish_reason)]

    def choice(self, index: int, text: str, finish_reason: str | None, items: list[TokenLogprob] | None):
        return ChatChoice(index=index, message=ChatMessage(content=self.echo + text), finish_reason=finish_reason,
                          logprobs=None if items is None else chat_logprobs(items, self.tokens_as_ids))

    def full(self, choices: list, usage: Usage) -> BaseModel:
        return ChatCompletion(choices=choices, usage=usage, system_fingerprint=self.fingerprint, **self.common)


class _OpenAIServer:
    def __init__(self, backend: Backend, limits: RequestLimits, request_id_header: bool = True):
        self.backend = backend
        self.limits = limits
        self.request_id_header = request_id_header  # False behind Serve, whose proxy sets x-request-id
        self._info: ModelInfo | None = None  # a deployment serves one model for its whole life
        self._asking: asyncio.Future | None = None  # the one backend.model_info call in flight
        self._metrics: ApiMetrics | None = None  # made with the first model_info: it labels the series
        self.created = int(time.time())

    async def model_info(self) -> ModelInfo:
        """The backend's answer, asked once: a burst of first requests shares one call."""
        if self._info is None:
            if self._asking is None or self._asking.done():
                self._asking = asyncio.ensure_future(self.backend.model_info())
            self._info = await asyncio.shield(self._asking)
        return self._info

    def metrics(self, info: ModelInfo) -> ApiMetrics:
        if self._metrics is None:
            # Labelled with the short name when the served one is a path: stable across machines.
            self._metrics = ApiMetrics(info.aliases[0] if info.aliases else info.model_id)
        return self._metrics

    async def metrics_text(self) -> Response:
        """/metrics: Prometheus text; engine series from the backend's replica reports, if it has any."""
        try:
            info = await self.model_info()
            stats = getattr(self.backend, "engine_stats", None)
            reports = await stats() if stats is not None else None
            body = self.metrics(info).render(reports)
        except Exception as exc:
            return _api_error(exc).response()
        return Response(body, media_type=METRICS_CONTENT_TYPE)

    async def models(self, model_id: str | None = None) -> Response:
        """The model list, or with model_id the one model (404 when it is not the one served)."""
        try:
            info = await self.model_info()
        except Exception as exc:
            return _api_error(exc).response()
        models = [Model(id=name, created=self.created, max_model_len=info.max_model_len, root=info.root)
                  for name in [info.model_id, *info.aliases]]  # the served name first: clients take data[0]
        if model_id is None:
            return Response(ModelList(data=models).model_dump_json(), media_type="application/json")
        if not info.serves(model_id):
            return _model_not_found(model_id, info).response()
        model = next(m for m in models if m.id == model_id)
        return Response(model.model_dump_json(), media_type="application/json")

    async def generate(self, request: Request, kind: type[CompletionRequest | ChatCompletionRequest] | Dialect
                       ) -> Response:
        """/v1/completions, /v1/chat/completions, and with a Dialect /v1/responses and /v1/messages
        (run as a chat request, answered in that API's shape: responses_api.py, anthropic_api.py)."""
        request_id, field_name, shape = None, None, None
        dialect = kind if isinstance(kind, Dialect) else None
        try:
            body = await request.body()
            if dialect is not None:
                outer, req = _parsed(dialect.parse, body)
                kind, shape = ChatCompletionRequest, dialect.shape(outer, req)
            else:
                req = _parsed(kind.model_validate_json, body)
            field_name = getattr(req, "field_name", None)
            info = await self.model_info()
            if req.model is not None and not info.serves(req.model):
                raise _model_not_found(req.model, info)
            if (for_model := getattr(req, "for_model", None)) is not None:  # what depends on the model served
                req = for_model(info)
            self.limits.check(req, info.max_model_len, field_name("max_tokens") if field_name else "max_tokens")
            base_id = request.headers.get("x-request-id") or uuid.uuid4().hex  # vLLM's rule
            generates = [with_template_defaults(g, info.chat_template_kwargs)
                         for g in to_generate_requests(req, base_id)]
            for generate in generates:
                if generate.max_tokens_to_context:  # the bound; the replica lowers it to what the prompt leaves
                    generate.sampling["max_tokens"] = self.limits.output_bound(info.max_model_len)
            request_id = generates[0].request_id.rsplit("-", 1)[0] if len(generates) > 1 else generates[0].request_id
            plan = plan_structured(req, generates[0], info.tool_call_format) if kind is ChatCompletionRequest \
                else None  # one choice
            for generate in generates:
                SamplingParams(**generate.sampling)  # a bad value raises ConfigError naming the field
                set_beam_search(req, generate)
            if req.priority and info.scheduling_policy == "fcfs":  # before it reaches an engine
                raise ConfigError(f"priority={req.priority} needs the server's scheduling_policy: priority; allowed: "
                                  "0 (requests are served first come, first served)")
            fmt = (_ChatFormat if kind is ChatCompletionRequest else _CompletionFormat)(
                request_id, req.model or info.model_id, system_fingerprint(info))  # the name it asked for
            fmt.tokens_as_ids = bool(req.return_tokens_as_token_ids)
            if plan is not None:
                fmt = ToolCallFormat(fmt, plan)
            if kind is ChatCompletionRequest:
                fmt = with_reasoning(fmt, info, generates[0], plan, req)
                fmt.chat_format.echo = _echoed(req)
            headers = {"X-Request-Id": base_id} if self.request_id_header else {}
            generations = [_Generation(self.backend, generate) for generate in generates]
            per_prompt = req.n or 1  # choices of prompt g are g * per_prompt + their index
            metrics, started = self.metrics(info), time.monotonic()
            streaming = False  # once True, the event stream owns the generations and closes them
            try:  # wait for the first deltas: errors raised there still get a status code
                firsts = await _unless_disconnected(request, _all_or_none(
                    _first(generation, metrics, started) for generation in generations))
                if req.stream:
                    events = self._events(generations, firsts, fmt, req, per_prompt,
                                          lambda lasts: _record(metrics, lasts, started))
                    streaming = True
                    sse = _as_sse(events) if shape is None else _as_sse(shape.events(events), done=False)
                    return _EventStream(sse, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                                      **headers})
                results = await _unless_disconnected(request, _all_or_none(
                    self._collect(g, first) for g, first in zip(generations, firsts)))
            finally:
                if not streaming:
                    await _close_all(generations)
            for collected in results:
                _record(metrics, [last for *_, last in collected], started)
            choices = [_with_stop_reason(fmt.choice(g * per_prompt + last.index, text, last.finish_reason, items), last)
                       for g, collected in enumerate(results) for text, items, _, last in collected]
            usage = _usage([collected[0][-1] for collected in results],
                           [last for collected in results for *_, last in collected])
            full = fmt.full(choices, usage)
            _add_prompt_logprobs(full, [first.prompt_logprob_entries for first in firsts], per_prompt)
            if req.return_token_ids:
                _add_token_ids(full, [ids for collected in results for _, _, ids, _ in collected],
                               [first.prompt_token_ids for first in firsts], per_prompt)
            body = full.model_dump_json() if shape is None else json.dumps(shape.whole(full))
            return Response(body, media_type="application/json", headers=headers)
        except _ClientGone:
            logger.info("client disconnected; request %s aborted", request_id)
            return Response(status_code=499)
        except Exception as exc:
            error = _api_error(exc, request_id, field_name)
            return error.response() if dialect is None else dialect.error_response(error)

    async def count_message_tokens(self, request: Request) -> Response:
        """Anthropic's /v1/messages/count_tokens: the prompt's tokens as a Messages request would run it."""
        try:
            req = _parsed(anthropic_protocol.count_tokens_request, await request.body())
            info = await self.model_info()
            if not info.serves(req.model):
                raise _model_not_found(req.model, info)
            chat = _parsed(anthropic_protocol.count_tokens_prompt, req)
            messages = [m.to_dict() for m in chat.messages]
            template_messages(messages, bool(chat.tools), info.tool_call_format)  # as the message renders them
            tokens = await self.backend.tokenize(None, messages, chat.template_options())
            return Response(json.dumps({"input_tokens": len(tokens)}), media_type="application/json")
        except Exception as exc:
            return anthropic_api.error_response(_api_error(exc))

    async def tokenize(self, request: Request, detokenize: bool) -> Response:
        """vLLM's /tokenize and /detokenize, so clients count and cut tokens as the engine does."""
        try:
            kind = DetokenizeRequest if detokenize else TokenizeRequest
            req = _parsed(kind.model_validate_json, await request.body())
            info = await self.model_info()
            if req.model is not None and not info.serves(req.model):
                raise _model_not_found(req.model, info)
            if detokenize:
                body = DetokenizeResponse(prompt=await self.backend.detokenize(req.tokens))
            else:
                if (req.prompt is None) == (req.messages is None):
                    raise APIError(400, "give exactly one of prompt (a string) and messages", param="prompt")
                messages = None if req.messages is None else [m.to_dict() for m in req.messages]
                template_messages(messages, bool(req.tools), info.tool_call_format)  # as a chat renders them
                options = req.template_options() if messages is not None else {}
                tokens = await self.backend.tokenize(req.prompt, messages, options)
                body = TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=info.max_model_len)
            return Response(body.model_dump_json(), media_type="application/json")
        except Exception as exc:
            return _api_error(exc).response()

    @staticmethod
    async def _collect(generation: _Generation, delta: GenerateDelta
                       ) -> list[tuple[str, list[TokenLogprob] | None, list[int], GenerateDelta]]:
        """(text, token logprobs, token ids, last delta) of each choice of one backend stream, by index."""
        pieces: dict[int, list[str]] = {}
        items: dict[int, list[TokenLogprob] | None] = {}
        token_ids: dict[int, list[int]] = {}
        lasts: dict[int, GenerateDelta] = {}
        while True:
            text, logprobs = _piece(delta)  # a choice's first delta carries the echoed prompt
            pieces.setdefault(delta.index, []).append(text)
            token_ids.setdefault(delta.index, []).extend(delta.token_ids)
            if logprobs is not None:
                items[delta.index] = (items.get(delta.index) or []) + logprobs
            lasts[delta.index] = delta
            if delta.finished:
                break
            delta = _check(await generation.next())
        return [("".join(pieces[i]), items.get(i), token_ids[i], lasts[i]) for i in sorted(pieces)]

    @staticmethod
    async def _events(generations: list[_Generation], firsts: list[GenerateDelta], fmt: _CompletionFormat,
                      req, per_prompt: int, on_finished) -> AsyncIterator:
        """The stream's chunks, then the APIError if one cut it short, then DONE; the choices of
        prompt g (n > 1) are g * per_prompt + their index. With continuous usage, every chunk
        carries its choice's usage so far (the opening ones: the prompt's, no output yet)."""
        error = None
        continuous = req.continuous_usage
        try:
            chat = isinstance(getattr(fmt, "chat_format", fmt), _ChatFormat)
            prompt_ids = firsts[0].prompt_token_ids if chat else None  # completions: in each choice's first chunk
            for index in range(len(generations) * per_prompt):
                opening = _usage([firsts[index // per_prompt]], []) if continuous else None
                for chunk in fmt.start(index):
                    chunk.prompt_token_ids, prompt_ids = prompt_ids, None  # a chat's: on the first chunk
                    yield _with_usage(chunk, opening)
            lasts: dict[int, GenerateDelta] = {}  # per choice: the delta that finished it
            prompts: dict[int, GenerateDelta] = {}  # per prompt: its last delta (its tokens counted once, whatever n)
            async for g, delta in _merged(generations, firsts):
                index = g * per_prompt + delta.index
                so_far = _usage([delta], [delta]) if continuous else None
                text, items = _piece(delta)
                chunks = list(fmt.text(index, text, items)) if text or items else []
                if delta.finish_reason is not None and index not in lasts:
                    lasts[index] = delta
                    finishing = fmt.finish(index, delta.finish_reason)
                    for chunk in finishing:
                        for choice in chunk.choices:
                            _with_stop_reason(choice, delta)
                    chunks += finishing
                if req.return_token_ids:
                    chunks = _with_token_ids(fmt, chunks, index, delta)
                for chunk in chunks:
                    yield _with_usage(chunk, so_far)
                if delta.finished:
                    prompts[g] = delta
                    on_finished([d for i, d in lasts.items() if i // per_prompt == g] or [delta])
            if req.include_usage:
                yield fmt.usage(_usage(list(prompts.values()), list(lasts.values())))
        except Exception as exc:
            error = _api_error(exc, generations[0].request_id, getattr(req, "field_name", None))
        finally:  # also on cancellation or close(): aborts the requests unless they finished
            await _close_all(generations)
        if error is not None:
            yield error
        yield DONE


async def _all_or_none(coroutines) -> list:
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


async def _close_all(generations: list[_Generation]) -> None:
    """One after another: each close() shields itself at once, which tasks started inside a
    cancelled scope (asyncio.gather) would not get to do."""
    for generation in generations:
        await generation.close()


async def _first(generation: _Generation, metrics: ApiMetrics, started: float) -> GenerateDelta:
    delta = _check(await generation.next())
    metrics.first_token(time.monotonic() - started)
    return delta


def _with_stop_reason(choice, delta: GenerateDelta):
    if choice.finish_reason is not None:
        choice.stop_reason = delta.stop_reason
    return choice


def _add_prompt_logprobs(full, entries: list, per_prompt: int) -> None:
    """vLLM's prompt_logprobs field: a chat's beside its choices, each completion choice its prompt's."""
    if all(e is None for e in entries):
        return
    if isinstance(full, ChatCompletion):
        full.prompt_logprobs = entries[0]
        return
    for choice in full.choices:
        choice.prompt_logprobs = entries[choice.index // per_prompt]


def _add_token_ids(full, token_ids: list[list[int]], prompts: list[list[int] | None], per_prompt: int) -> None:
    """vLLM's return_token_ids: each choice's token ids; the prompt's beside a chat's choices, in
    each completion choice its prompt's."""
    for choice, ids in zip(full.choices, token_ids):
        choice.token_ids = ids
    if isinstance(full, ChatCompletion):
        full.prompt_token_ids = prompts[0]
        return
    for choice in full.choices:
        choice.prompt_token_ids = prompts[choice.index // per_prompt]


def _with_token_ids(fmt, chunks: list, index: int, delta: GenerateDelta) -> list:
    """vLLM's return_token_ids, streamed: a delta's new token ids (and a completion choice's prompt
    ids, with its first tokens) on the first of its chunks with that choice, or on an empty chunk
    of their own where the format holds the text back (a tool call or a thought being parsed)."""
    if not delta.token_ids and delta.prompt_token_ids is None:
        return chunks
    carrier = next((choice for chunk in chunks for choice in chunk.choices if choice.index == index), None)
    if carrier is None:
        own = getattr(fmt, "chat_format", fmt).finish(index, None)  # an empty delta, nothing finished
        chunks, carrier = chunks + own, own[0].choices[0]
    carrier.token_ids = list(delta.token_ids)
    if isinstance(carrier, CompletionChoice):
        carrier.prompt_token_ids = delta.prompt_token_ids
    return chunks


def _with_usage(chunk, usage: Usage | None):
    if usage is not None:
        chunk.usage = usage
    return chunk


def _usage(prompts: list[GenerateDelta], lasts: list[GenerateDelta]) -> Usage:
    """A request's usage: `prompts` one delta per prompt (its tokens counted once, whatever n),
    `lasts` each choice's last delta. Reasoning tokens where the replica counted them."""
    counted = [last.reasoning_tokens for last in lasts if last.reasoning_tokens is not None]
    return Usage.of(sum(d.prompt_tokens for d in prompts), sum(last.completion_tokens for last in lasts),
                    cached_tokens=sum(d.cached_tokens for d in prompts),
                    reasoning_tokens=sum(counted) if counted else None)


def _record(metrics: ApiMetrics, lasts: list[GenerateDelta], started: float) -> None:
    """One request (one prompt) finished; `lasts`: its choices' last deltas."""
    metrics.finished(lasts[0].prompt_tokens, sum(last.completion_tokens for last in lasts), lasts[0].finish_reason,
                     time.monotonic() - started)


async def _merged(generations: list[_Generation], firsts: list[GenerateDelta]
                  ) -> AsyncIterator[tuple[int, GenerateDelta]]:
    """(choice index, delta) of several streams as they come; the first deltas first. One
    stream's error ends the whole merge (the caller closes, and so aborts, the others)."""
    for index, first in enumerate(firsts):
        yield index, first
    pending = {index for index, first in enumerate(firsts) if not first.finished}
    if len(pending) == 1:  # the common case: no tasks
        index = pending.pop()
        delta = firsts[index]
        while not delta.finished:
            delta = _check(await generations[index].next())
            yield index, delta
        return
    tasks = {asyncio.ensure_future(generations[i].next()): i for i in pending}
    try:
        while tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = tasks.pop(task)
                delta = _check(task.result())
                yield index, delta
                if not delta.finished:
                    tasks[asyncio.ensure_future(generations[index].next())] = index
    finally:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)


def system_fingerprint(info: ModelInfo) -> str:
    """OpenAI's system_fingerprint: changes when what produces the tokens changes (Ponytail's version,
    the model, its context and block size, the device kind), so clients can tell runs apart."""
    device = info.device.split(":")[0]
    key = f"{ponytail.__version__}|{info.model_id}|{info.max_model_len}|{info.block_size}|{device}"
    return "fp_" + hashlib.sha256(key.encode()).hexdigest()[:10]


def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Unknown paths and methods, in OpenAI's shape."""
    return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").response()


def _internal_error(request: Request, exc: Exception) -> Response:
    """The last resort for a bug in this module: a 500 without details."""
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return APIError(500, "internal server error; the server log has the details").response()


RESPONSES = Dialect(responses_protocol.chat_request, ResponsesShape, APIError.response)
MESSAGES = Dialect(anthropic_protocol.chat_request, anthropic_api.MessagesShape, anthropic_api.error_response)


def build_app(backend: Backend, limits: RequestLimits | None = None, policy: AccessPolicy | None = None,
              request_id_header: bool = True) -> FastAPI:
    """The OpenAI-compatible API over `backend` (see the module docstring for what it must provide),
    with the request limits and the HTTP gate (API key, JSON only, body size, CORS) given.

    request_id_header: answer with an X-Request-Id header (the request's x-request-id if it had
    one, else its id). False behind Ray Serve: its proxy adds that header itself, from the same
    incoming x-request-id (or its own id, which then reaches this app as x-request-id)."""
    limits = limits or RequestLimits()
    policy = policy or AccessPolicy(max_body_bytes=limits.max_body_bytes)
    server = _OpenAIServer(backend, limits, request_id_header)
    app = FastAPI(title="Ponytail OpenAI-compatible API")
    install(app, policy)
    publish_request_models(app, [TokenizeRequest, DetokenizeRequest, CompletionRequest, ChatCompletionRequest,
                                 responses_protocol.ResponsesRequest, anthropic_protocol.MessagesRequest,
                                 anthropic_protocol.CountTokensRequest])
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return await server.metrics_text()

    @app.get("/version")
    async def version() -> dict:
        return {"version": ponytail.__version__}

    @app.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        return await server.tokenize(request, detokenize=False)

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        return await server.tokenize(request, detokenize=True)

    @app.get("/v1/models")
    async def models() -> Response:
        return await server.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        return await server.models(model_id)

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await server.generate(request, CompletionRequest)

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await server.generate(request, ChatCompletionRequest)

    @app.post("/v1/responses", openapi_extra=request_body(responses_protocol.ResponsesRequest))
    async def responses(request: Request) -> Response:
        return await server.generate(request, RESPONSES)

    @app.post("/v1/messages", openapi_extra=request_body(anthropic_protocol.MessagesRequest))
    async def messages(request: Request) -> Response:
        return await server.generate(request, MESSAGES)

    @app.post("/v1/messages/count_tokens", openapi_extra=request_body(anthropic_protocol.CountTokensRequest))
    async def count_message_tokens(request: Request) -> Response:
        return await server.count_message_tokens(request)

    # One method a route: FastAPI names an operation by its route's first method, and OpenAPI ids are unique.
    @app.get("/v1/responses/{response_id}")
    @app.delete("/v1/responses/{response_id}")
    @app.get("/v1/responses/{response_id}/{action}")
    @app.post("/v1/responses/{response_id}/{action}")
    async def stored_response(response_id: str, action: str | None = None) -> Response:
        return APIError(404, f"response {response_id!r:.80} is not stored: this server keeps no responses (store "
                             "changes nothing); send the whole conversation as input", param="response_id",
                        code="not_found").response()

    return app
