"""Errors in each dialect's envelope: OpenAI's on /v1 routes, TEI's on every other route.

OpenAI: ``{"error": {"message", "type", "param", "code"}}``. TEI: ``{"error", "error_type"}``,
with TEI's status for the type. Every error the gateway raises is an ``APIError``; the app's
handlers render it, FastAPI's own 404/405/422 and Redis faults too, for the route's dialect.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis import exceptions as redis_errors
from starlette.exceptions import HTTPException

from embedfleet.shared.fault_kinds import FaultKind, classify

OPENAI_PREFIX = "/v1"

# TEI's error_type by the status an APIError carries (text-embeddings-inference's ErrorType);
# TEI answers validation errors 422 where OpenAI answers 400 or 413, see tei_status
_TEI_TYPES = {
    400: "Empty",
    401: "Unauthorized",
    404: "Validation",
    405: "Validation",
    413: "Validation",
    422: "Validation",
    424: "Backend",
    429: "Overloaded",
    500: "Backend",
    503: "Unhealthy",
    504: "Backend",
}


def is_openai_path(path: str) -> bool:
    return path == OPENAI_PREFIX or path.startswith(OPENAI_PREFIX + "/")


class APIError(Exception):
    """An error answer: status, a message that says what to do, OpenAI's type/param/code."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}


def retry_later(status: int, message: str, code: str, retry_after_s: int) -> APIError:
    """A refusal the client should send again after ``retry_after_s`` (its Retry-After header):
    429 is OpenAI's ``rate_limit_error``, any other status (503) a ``server_error``."""
    return APIError(
        status,
        message,
        type="rate_limit_error" if status == 429 else "server_error",
        code=code,
        headers={"Retry-After": str(retry_after_s)},
    )


def overloaded(message: str, retry_after_s: int) -> APIError:
    return retry_later(429, message, "rate_limit_exceeded", retry_after_s)


def tei_status(error: APIError) -> int:
    """The status TEI answers for an error: its ``Validation`` type is 422 (too many inputs, a
    text too long, a bad value), ``Empty`` 400; a body over the limit stays 413."""
    if error.status == 400:
        return 400 if error.code == "empty_input" else 422
    if error.status == 413 and error.code != "request_too_large":
        return 422
    return error.status


def error_status(path: str, error: APIError) -> int:
    return error.status if is_openai_path(path) else tei_status(error)


def error_body(path: str, error: APIError) -> dict[str, Any]:
    if not is_openai_path(path):
        status = tei_status(error)
        return {"error": error.message, "error_type": _TEI_TYPES.get(status, "Backend")}
    return {
        "error": {
            "message": error.message,
            "type": error.type,
            "param": error.param,
            "code": error.code,
        }
    }


def error_response(path: str, error: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(path, error), status_code=error_status(path, error), headers=error.headers
    )


def render(request: Request, error: APIError) -> JSONResponse:
    return error_response(request.url.path, error)


async def api_error_handler(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, APIError)
    return render(request, error)


async def validation_error_handler(request: Request, error: Exception) -> JSONResponse:
    """A body that does not fit the schema: 400 on OpenAI's routes (what OpenAI answers),
    422 on TEI's (what TEI answers), naming the field and the problem."""
    assert isinstance(error, RequestValidationError)
    problems = []
    param = None
    for item in error.errors()[:5]:
        location = ".".join(str(part) for part in item.get("loc", ()) if part != "body")
        param = param or location or None
        problems.append(f"{location or 'body'}: {item.get('msg')}")
    message = "invalid request: " + "; ".join(problems)
    return render(request, APIError(400, message, param=param, code="invalid_request"))


async def http_error_handler(request: Request, error: Exception) -> JSONResponse:
    """Starlette's own answers (no such route, a method the route does not take) in the
    route's envelope, with their headers (``Allow`` on a 405)."""
    assert isinstance(error, HTTPException)
    where = f"{request.method} {request.url.path}"
    if error.status_code == 404:
        message = f"Invalid URL ({where}): no such route here"
    elif error.status_code == 405:
        allowed = (error.headers or {}).get("allow") or (error.headers or {}).get("Allow")
        message = f"Invalid method for URL ({where})" + (f"; use {allowed}" if allowed else "")
    else:
        message = str(error.detail)
    return render(
        request,
        APIError(error.status_code, message, code=None, headers=dict(error.headers or {})),
    )


async def redis_error_handler(request: Request, error: Exception) -> JSONResponse:
    """Redis unreachable, timing out or failing over: 503 with Retry-After, the request lost
    nothing it could not send again. Any other Redis refusal (credentials, ACL) is the
    gateway's configuration: 500, naming the setting."""
    fault = classify(error)
    settings = request.app.state.gateway.settings
    if fault.kind is FaultKind.TRANSIENT:
        api_error = retry_later(
            503,
            f"the queue (Redis) is unavailable ({fault.detail}); retry after the Retry-After "
            "seconds",
            "queue_unavailable",
            settings.gateway_retry_after_s,
        )
    else:
        api_error = APIError(
            500,
            f"the queue (Redis) refused the gateway ({fault.detail}); check "
            f"{fault.setting} (address, credentials, ACL)",
            type="server_error",
            code="queue_error",
        )
    return render(request, api_error)


async def unexpected_error_handler(request: Request, error: Exception) -> JSONResponse:
    """Anything else still answers in the route's envelope (the server logs the traceback)."""
    return render(
        request,
        APIError(
            500,
            f"internal error ({type(error).__name__}); the gateway's log has the traceback",
            type="server_error",
            code="internal_error",
        ),
    )


# (exception class, handler) for the app, in one list so every error has its envelope
EXCEPTION_HANDLERS = (
    (APIError, api_error_handler),
    (RequestValidationError, validation_error_handler),
    (HTTPException, http_error_handler),
    (redis_errors.RedisError, redis_error_handler),
    (redis_errors.RedisClusterException, redis_error_handler),
    (Exception, unexpected_error_handler),
)
