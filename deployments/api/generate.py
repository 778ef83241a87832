"""The routes that generate: /v1/completions, /v1/chat/completions and, run as chat requests and
answered in their own shapes, /v1/responses (OpenAI's Responses API) and /v1/messages (Anthropic's).

A request's life: parse the body (type errors and OpenAI's ranges -> 400 naming the field), check
`model` (404) and the request limits (limits.py, 400; `context_length_exceeded` when over the
context), build one engine request per prompt with its SamplingParams, built once
(engine_requests.py; a bad value -> 400 naming the field), start the backend streams and wait for
their first deltas, so an error raised there still gets a status code (a prompt too long is a
ConfigError -> 400, BackendUnavailable -> 503 with Retry-After, anything else -> 500). Then either
collect the text into one JSON body or send it as server-sent events; an error after the first
event is a last `data: {"error": ...}` event before `data: [DONE]`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ponytail import ConfigError

from . import anthropic_api, anthropic_protocol, responses_protocol
from .api_metrics import ApiMetrics
from .context import ApiContext
from .cut_streams import STREAM_HEADER
from .engine_requests import set_beam_search, to_drafts
from .errors import APIError, ClientGone, api_error, model_not_found, parsed
from .formats import (ChatFormat, CompletionFormat, add_prompt_logprobs, add_token_ids, echoed, piece,
                      system_fingerprint, usage_of, with_stop_reason, with_token_ids, with_usage)
from .openai_requests import ChatCompletionRequest, CompletionRequest
from .openapi_bodies import request_body
from .prompts import with_template_defaults
from .protocol import GenerateDelta, TokenLogprob
from .reasoning import with_reasoning
from .responses_api import ResponsesShape
from .streams import (DONE, EventStream, Generation, all_or_none, as_sse, check_delta, close_all, merged,
                      unless_disconnected)
from .tools import ToolCallFormat, plan_structured

logger = logging.getLogger("ponytail.openai")


@dataclass(frozen=True, slots=True)
class Dialect:
    """Another API's request run as a chat request: `parse` reads the body into (its request, the
    chat request), `shape` answers in that API's shape (whole, events), `error_response` its errors."""

    parse: Callable[[bytes], tuple]
    shape: Callable
    error_response: Callable[[APIError], Response]


RESPONSES = Dialect(responses_protocol.chat_request, ResponsesShape, APIError.response)
MESSAGES = Dialect(anthropic_protocol.chat_request, anthropic_api.MessagesShape, anthropic_api.error_response)


def add_generate_routes(app: FastAPI, ctx: ApiContext) -> None:
    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await generate(ctx, request, CompletionRequest)

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await generate(ctx, request, ChatCompletionRequest)

    @app.post("/v1/responses", openapi_extra=request_body(responses_protocol.ResponsesRequest))
    async def responses(request: Request) -> Response:
        return await generate(ctx, request, RESPONSES)

    @app.post("/v1/messages", openapi_extra=request_body(anthropic_protocol.MessagesRequest))
    async def messages(request: Request) -> Response:
        return await generate(ctx, request, MESSAGES)


async def generate(ctx: ApiContext, request: Request,
                   kind: type[CompletionRequest | ChatCompletionRequest] | Dialect) -> Response:
    """One generating request, whole or streamed; a Dialect's in its API's shape."""
    request_id, field_name, shape = None, None, None
    dialect = kind if isinstance(kind, Dialect) else None
    try:
        body = await request.body()
        if dialect is not None:
            outer, req = parsed(dialect.parse, body)
            kind, shape = ChatCompletionRequest, dialect.shape(outer, req)
        else:
            req = parsed(kind.model_validate_json, body)
        field_name = getattr(req, "field_name", None)
        info = await ctx.model_info()
        if req.model is not None and not info.serves(req.model):
            raise model_not_found(req.model, info)
        if (for_model := getattr(req, "for_model", None)) is not None:  # what depends on the model served
            req = for_model(info)
        ctx.limits.check(req, info.max_model_len, field_name("max_tokens") if field_name else "max_tokens")
        base_id = request.headers.get("x-request-id") or uuid.uuid4().hex  # vLLM's rule
        drafts = to_drafts(req, base_id)
        for draft in drafts:
            draft.request = with_template_defaults(draft.request, info.chat_template_kwargs)
            if draft.request.max_tokens_to_context:  # the bound; the replica lowers it to what the prompt leaves
                draft.sampling["max_tokens"] = ctx.limits.output_bound(info.max_model_len)
        first = drafts[0].request
        request_id = first.request_id.rsplit("-", 1)[0] if len(drafts) > 1 else first.request_id
        chat = kind is ChatCompletionRequest
        plan = plan_structured(req, drafts[0], info.tool_call_format) if chat else None  # one choice
        fmt = (ChatFormat if chat else CompletionFormat)(request_id, req.model or info.model_id,
                                                         system_fingerprint(info))  # the name it asked for
        fmt.tokens_as_ids = bool(req.return_tokens_as_token_ids)
        if plan is not None:
            fmt = ToolCallFormat(fmt, plan)
        if chat:
            fmt = with_reasoning(fmt, info, drafts[0], plan, req)
            fmt.chat_format.echo = echoed(req)
        generates = [draft.finish(info.sampling_defaults) for draft in drafts]  # SamplingParams, built once
        for draft in drafts:
            set_beam_search(req, draft)
        if req.priority and info.scheduling_policy == "fcfs":  # before it reaches an engine
            raise ConfigError(f"priority={req.priority} needs the server's scheduling_policy: priority; allowed: "
                              "0 (requests are served first come, first served)")
        headers = {"X-Request-Id": base_id} if ctx.request_id_header else {}
        generations = [Generation(ctx.backend, generate) for generate in generates]
        per_prompt = req.n or 1  # choices of prompt g are g * per_prompt + their index
        metrics, started = ctx.metrics(info), time.monotonic()
        streaming = False  # once True, the event stream owns the generations and closes them
        try:  # wait for the first deltas: errors raised there still get a status code
            firsts = await unless_disconnected(request, all_or_none(
                _first(generation, metrics, started) for generation in generations))
            if req.stream:
                events = _events(generations, firsts, fmt, req, per_prompt,
                                 lambda lasts: _record(metrics, lasts, started))
                streaming = True
                sse = as_sse(events) if shape is None else as_sse(shape.events(events), done=False)
                dialect = "openai" if shape is None else shape.stream_dialect  # how a cut stream is ended
                return EventStream(sse, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                                 STREAM_HEADER: dialect, **headers})
            results = await unless_disconnected(request, all_or_none(
                _collect(g, first) for g, first in zip(generations, firsts)))
        finally:
            if not streaming:
                await close_all(generations)
        for collected in results:
            _record(metrics, [last for *_, last in collected], started)
        choices = [with_stop_reason(fmt.choice(g * per_prompt + last.index, text, last.finish_reason, items), last)
                   for g, collected in enumerate(results) for text, items, _, last in collected]
        usage = usage_of([collected[0][-1] for collected in results],
                         [last for collected in results for *_, last in collected])
        full = fmt.full(choices, usage)
        add_prompt_logprobs(full, [first.prompt_logprob_entries for first in firsts], per_prompt)
        if req.return_token_ids:
            add_token_ids(full, [ids for collected in results for _, _, ids, _ in collected],
                          [first.prompt_token_ids for first in firsts], per_prompt)
        body = full.model_dump_json() if shape is None else json.dumps(shape.whole(full))
        return Response(body, media_type="application/json", headers=headers)
    except ClientGone:
        logger.info("client disconnected; request %s aborted", request_id)
        return Response(status_code=499)
    except Exception as exc:
        error = api_error(exc, request_id, field_name)
        return error.response() if dialect is None else dialect.error_response(error)


async def _first(generation: Generation, metrics: ApiMetrics, started: float) -> GenerateDelta:
    delta = check_delta(await generation.next())
    metrics.first_token(time.monotonic() - started)
    return delta


def _record(metrics: ApiMetrics, lasts: list[GenerateDelta], started: float) -> None:
    """One request (one prompt) finished; `lasts`: its choices' last deltas."""
    metrics.finished(lasts[0].prompt_tokens, sum(last.completion_tokens for last in lasts), lasts[0].finish_reason,
                     time.monotonic() - started)


async def _collect(generation: Generation, delta: GenerateDelta
                   ) -> list[tuple[str, list[TokenLogprob] | None, list[int], GenerateDelta]]:
    """(text, token logprobs, token ids, last delta) of each choice of one backend stream, by index."""
    pieces: dict[int, list[str]] = {}
    items: dict[int, list[TokenLogprob] | None] = {}
    token_ids: dict[int, list[int]] = {}
    lasts: dict[int, GenerateDelta] = {}
    while True:
        text, logprobs = piece(delta)  # a choice's first delta carries the echoed prompt
        pieces.setdefault(delta.index, []).append(text)
        token_ids.setdefault(delta.index, []).extend(delta.token_ids)
        if logprobs is not None:
            items[delta.index] = (items.get(delta.index) or []) + logprobs
        lasts[delta.index] = delta
        if delta.finished:
            break
        delta = check_delta(await generation.next())
    return [("".join(pieces[i]), items.get(i), token_ids[i], lasts[i]) for i in sorted(pieces)]


async def _events(generations: list[Generation], firsts: list[GenerateDelta], fmt: CompletionFormat,
                  req, per_prompt: int, on_finished) -> AsyncIterator:
    """The stream's chunks, then the APIError if one cut it short, then DONE; the choices of
    prompt g (n > 1) are g * per_prompt + their index. With continuous usage, every chunk
    carries its choice's usage so far (the opening ones: the prompt's, no output yet)."""
    error = None
    continuous = req.continuous_usage
    try:
        chat = isinstance(getattr(fmt, "chat_format", fmt), ChatFormat)
        prompt_ids = firsts[0].prompt_token_ids if chat else None  # completions: in each choice's first chunk
        for index in range(len(generations) * per_prompt):
            opening = usage_of([firsts[index // per_prompt]], []) if continuous else None
            for chunk in fmt.start(index):
                chunk.prompt_token_ids, prompt_ids = prompt_ids, None  # a chat's: on the first chunk
                yield with_usage(chunk, opening)
        lasts: dict[int, GenerateDelta] = {}  # per choice: the delta that finished it
        prompts: dict[int, GenerateDelta] = {}  # per prompt: its last delta (its tokens counted once, whatever n)
        async for g, delta in merged(generations, firsts):
            index = g * per_prompt + delta.index
            so_far = usage_of([delta], [delta]) if continuous else None
            text, items = piece(delta)
            chunks = list(fmt.text(index, text, items)) if text or items else []
            if delta.finish_reason is not None and index not in lasts:
                lasts[index] = delta
                finishing = fmt.finish(index, delta.finish_reason)
                for chunk in finishing:
                    for choice in chunk.choices:
                        with_stop_reason(choice, delta)
                chunks += finishing
            if req.return_token_ids:
                chunks = with_token_ids(fmt, chunks, index, delta)
            for chunk in chunks:
                yield with_usage(chunk, so_far)
            if delta.finished:
                prompts[g] = delta
                on_finished([d for i, d in lasts.items() if i // per_prompt == g] or [delta])
        if req.include_usage:
            yield fmt.usage(usage_of(list(prompts.values()), list(lasts.values())))
    except Exception as exc:
        error = api_error(exc, generations[0].request_id, getattr(req, "field_name", None))
    finally:  # also on cancellation or close(): aborts the requests unless they finished
        await close_all(generations)
    if error is not None:
        yield error
    yield DONE
