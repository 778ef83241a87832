"""The OpenAI-compatible HTTP API over a backend that streams GenerateDeltas; no Ray in here.

`build_app(backend)` returns a FastAPI app serving /v1/models, /v1/completions,
/v1/chat/completions, /v1/responses, /v1/messages (generate.py), /tokenize, /detokenize,
/v1/messages/count_tokens, /version, /metrics and /health. The backend (streams.Backend) is an
engine replica in this process or the Serve ingress's handle to them; a fake in the tests. Every
request passes the HTTP guard first (http_guard.py: API key 401, JSON only 415, body size 413).
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import ponytail

from . import anthropic_api, anthropic_protocol, responses_protocol
from .api_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .context import ApiContext
from .errors import APIError, api_error, http_error, internal_error, model_not_found, parsed
from .generate import add_generate_routes
from .http_guard import AccessPolicy, install
from .limits import RequestLimits
from .openai_requests import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .openai_responses import DetokenizeResponse, Model, ModelList, TokenizeResponse
from .openapi_bodies import publish_request_models, request_body
from .streams import Backend
from .tools import template_messages


def build_app(backend: Backend, limits: RequestLimits | None = None, policy: AccessPolicy | None = None,
              request_id_header: bool = True) -> FastAPI:
    """The OpenAI-compatible API over `backend`, with the request limits and the HTTP gate (API key,
    JSON only, body size, CORS) given.

    request_id_header: answer with an X-Request-Id header (the request's x-request-id if it had
    one, else its id). False behind Ray Serve: its proxy adds that header itself, from the same
    incoming x-request-id (or its own id, which then reaches this app as x-request-id)."""
    limits = limits or RequestLimits()
    policy = policy or AccessPolicy(max_body_bytes=limits.max_body_bytes)
    ctx = ApiContext(backend, limits, request_id_header)
    app = FastAPI(title="Ponytail OpenAI-compatible API")
    install(app, policy)
    publish_request_models(app, [TokenizeRequest, DetokenizeRequest, CompletionRequest, ChatCompletionRequest,
                                 responses_protocol.ResponsesRequest, anthropic_protocol.MessagesRequest,
                                 anthropic_protocol.CountTokensRequest])
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    add_generate_routes(app, ctx)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return await _metrics_text(ctx)

    @app.get("/version")
    async def version() -> dict:
        return {"version": ponytail.__version__}

    @app.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        return await _tokenize(ctx, request, detokenize=False)

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        return await _tokenize(ctx, request, detokenize=True)

    @app.get("/v1/models")
    async def models() -> Response:
        return await _models(ctx)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        return await _models(ctx, model_id)

    @app.post("/v1/messages/count_tokens", openapi_extra=request_body(anthropic_protocol.CountTokensRequest))
    async def count_message_tokens(request: Request) -> Response:
        return await _count_message_tokens(ctx, request)

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


async def _metrics_text(ctx: ApiContext) -> Response:
    """/metrics: Prometheus text; engine series from the backend's replica reports, if it has any."""
    try:
        info = await ctx.model_info()
        stats = getattr(ctx.backend, "engine_stats", None)
        reports = await stats() if stats is not None else None
        body = ctx.metrics(info).render(reports)
    except Exception as exc:
        return api_error(exc).response()
    return Response(body, media_type=METRICS_CONTENT_TYPE)


async def _models(ctx: ApiContext, model_id: str | None = None) -> Response:
    """The model list, or with model_id the one model (404 when it is not the one served)."""
    try:
        info = await ctx.model_info()
    except Exception as exc:
        return api_error(exc).response()
    models = [Model(id=name, created=ctx.created, max_model_len=info.max_model_len, root=info.root)
              for name in [info.model_id, *info.aliases]]  # the served name first: clients take data[0]
    if model_id is None:
        return Response(ModelList(data=models).model_dump_json(), media_type="application/json")
    if not info.serves(model_id):
        return model_not_found(model_id, info).response()
    model = next(m for m in models if m.id == model_id)
    return Response(model.model_dump_json(), media_type="application/json")


async def _count_message_tokens(ctx: ApiContext, request: Request) -> Response:
    """Anthropic's /v1/messages/count_tokens: the prompt's tokens as a Messages request would run it."""
    try:
        req = parsed(anthropic_protocol.count_tokens_request, await request.body())
        info = await ctx.model_info()
        if not info.serves(req.model):
            raise model_not_found(req.model, info)
        chat = parsed(anthropic_protocol.count_tokens_prompt, req)
        messages = [m.to_dict() for m in chat.messages]
        template_messages(messages, bool(chat.tools), info.tool_call_format)  # as the message renders them
        tokens = await ctx.backend.tokenize(None, messages, chat.template_options())
        return Response(json.dumps({"input_tokens": len(tokens)}), media_type="application/json")
    except Exception as exc:
        return anthropic_api.error_response(api_error(exc))


async def _tokenize(ctx: ApiContext, request: Request, detokenize: bool) -> Response:
    """vLLM's /tokenize and /detokenize, so clients count and cut tokens as the engine does."""
    try:
        kind = DetokenizeRequest if detokenize else TokenizeRequest
        req = parsed(kind.model_validate_json, await request.body())
        info = await ctx.model_info()
        if req.model is not None and not info.serves(req.model):
            raise model_not_found(req.model, info)
        if detokenize:
            body = DetokenizeResponse(prompt=await ctx.backend.detokenize(req.tokens))
        else:
            if (req.prompt is None) == (req.messages is None):
                raise APIError(400, "give exactly one of prompt (a string) and messages", param="prompt")
            messages = None if req.messages is None else [m.to_dict() for m in req.messages]
            template_messages(messages, bool(req.tools), info.tool_call_format)  # as a chat renders them
            options = req.template_options() if messages is not None else {}
            tokens = await ctx.backend.tokenize(req.prompt, messages, options)
            body = TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=info.max_model_len)
        return Response(body.model_dump_json(), media_type="application/json")
    except Exception as exc:
        return api_error(exc).response()
