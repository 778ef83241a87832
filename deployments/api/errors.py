"""The API's errors: what each exception is answered with, in OpenAI's shape.

{"error": {message, type, param, code}}: pydantic's errors and ConfigError are 400s naming the
field, a prompt over the context is `context_length_exceeded`, BackendUnavailable is 503 with
Retry-After, anything else a 500 whose details stay in the server's log.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ponytail import ConfigError, ContextLengthError

from .limits import LimitExceeded
from .openai_responses import ErrorInfo, ErrorResponse
from .protocol import ModelInfo

logger = logging.getLogger("ponytail.openai")

MAX_MESSAGE_CHARS = 1000  # error messages are cut here, so user input is never echoed back whole
# ConfigError messages start "field=value ..." (or "field.part=value ...", "field[0].part=...": the field is named)
_PARAM = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)(?:[.\[][A-Za-z0-9_.\[\]]*)?\s*=")
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          503: "service_unavailable_error"}


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


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


def find_cause(exc: BaseException | None, kind: type[BaseException]) -> BaseException | None:
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


def api_error(exc: BaseException, request_id: str | None = None,
              field_name: Callable[[str], str] | None = None) -> APIError:
    """The answer for an exception: ours as is, ConfigError 400, BackendUnavailable 503, else 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, LimitExceeded):
        return APIError(exc.status, str(exc), param=exc.param, code=exc.code)
    if (context := find_cause(exc, ContextLengthError)) is not None:  # OpenAI's code for it, and the field at fault
        param = context.too_many_tokens
        return APIError(400, str(context), param=field_name(param) if field_name else param,
                        code="context_length_exceeded")
    if (config := find_cause(exc, ConfigError)) is not None:
        message = str(config)
        match = _PARAM.match(message)
        param = match.group(1) if match else None
        if param and field_name is not None and field_name(param) != param:  # max_completion_tokens
            message = message.replace(param, field_name(param), 1)
            param = field_name(param)
        return APIError(400, message, param=param)
    if (unavailable := find_cause(exc, BackendUnavailable)) is not None:
        return APIError(503, str(unavailable) or "no engine replica is available now; retry later",
                        code="service_unavailable", retry_after_s=getattr(unavailable, "retry_after_s", 1.0))
    logger.error("request %s failed", request_id, exc_info=exc)
    which = f" in request {request_id}" if request_id else ""
    return APIError(500, f"internal server error{which}; the server log has the details")


def parsed(parse: Callable, body: bytes):
    """parse(body), its errors as 400s: pydantic's naming each field, ConfigError's as they are
    (a field this server does not do), json.loads' as not JSON."""
    try:
        return parse(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    except RecursionError:  # JSON nested deeper than the parser recurses
        raise APIError(400, "the body is not valid JSON: it nests too deeply") from None
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise APIError(400, f"the body is not valid JSON: {exc}") from None


def validation_error(exc: ValidationError) -> APIError:
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


def model_not_found(model: str, info: ModelInfo) -> APIError:
    shown = repr(model) if len(model) <= 100 else f"{model[:100]!r}... ({len(model)} characters)"
    names = " or ".join(repr(name) for name in [info.model_id, *info.aliases])
    return APIError(404, f"the model {shown} does not exist; this server serves {names}",
                    param="model", code="model_not_found")


def http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Unknown paths and methods, in OpenAI's shape."""
    return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").response()


def internal_error(request: Request, exc: Exception) -> Response:
    """The last resort for a bug in the API: a 500 without details."""
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return APIError(500, "internal server error; the server log has the details").response()
