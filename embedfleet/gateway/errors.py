"""Errors in each dialect's envelope, and which dialect a route answers in.

OpenAI: ``{"error": {"message", "type", "param", "code"}}``. TEI: ``{"error", "error_type"}``,
with TEI's status for the type. Every error the gateway raises is an ``APIError``; the app's
handlers render it, FastAPI's own 404/405/422 and Redis faults too, in the dialect of the route
that matched: each router module declares its dialect (``dialect_router``), so a route answers
in its module's dialect whatever its path. A path no declared route serves (an unknown path's
404, a route added without a dialect) answers by its prefix: OpenAI's under /v1, TEI's
elsewhere.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, ClassVar

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from redis import exceptions as redis_errors
from starlette.exceptions import HTTPException
from starlette.types import Scope

from embedfleet.shared.fault_kinds import FaultKind, classify
from embedfleet.shared.protocol import ProtocolError

OPENAI_PREFIX = "/v1"

# TEI's error_type by the status an APIError carries (text-embeddings-inference's ErrorType);
# TEI answers validation errors 422 where OpenAI answers 400 or 413, see tei_status. Its 400s
# are an empty input (``Empty``) and a body that is not JSON (axum's rejection, before any
# ErrorType: named ``Validation`` here), told apart by the error's code (_TEI_400)
_TEI_TYPES = {
    400: "Validation",
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


# The codes TEI answers 400 (with their error_type): everything else OpenAI answers 400 is 422
_TEI_400 = {"empty_input": "Empty", "invalid_json": "Validation"}


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


def input_rejected(reason: object) -> APIError:
    """An input the worker dead-lettered (a text the model refuses, an image that does not
    decode): the caller's to fix, answered with the worker's reason, online as in a batch."""
    return APIError(400, f"the worker rejected an input: {reason}", code="input_rejected")


def overloaded(message: str, retry_after_s: int) -> APIError:
    return retry_later(429, message, "rate_limit_exceeded", retry_after_s)


def tei_status(error: APIError) -> int:
    """The status TEI answers for an error: its ``Validation`` type is 422 (too many inputs, a
    text too long, a bad value), ``Empty`` 400, a body that is not JSON 400 (axum's answer);
    a body over the limit stays 413."""
    if error.status == 400:
        return 400 if error.code in _TEI_400 else 422
    if error.status == 413 and error.code != "request_too_large":
        return 422
    return error.status


class ErrorDialect(enum.Enum):
    """How a route answers an error: OpenAI's envelope and statuses, or TEI's."""

    openai = "openai"
    tei = "tei"

    @classmethod
    def of_path(cls, path: str) -> ErrorDialect:
        """The dialect of a path no declared route serves: OpenAI's under /v1, else TEI's."""
        return cls.openai if is_openai_path(path) else cls.tei

    def status(self, error: APIError) -> int:
        return error.status if self is ErrorDialect.openai else tei_status(error)

    def body(self, error: APIError) -> dict[str, Any]:
        if self is ErrorDialect.tei:
            status = tei_status(error)
            error_type = _TEI_400.get(error.code or "") if status == 400 else None
            return {
                "error": error.message,
                "error_type": error_type or _TEI_TYPES.get(status, "Backend"),
            }
        return {
            "error": {
                "message": error.message,
                "type": error.type,
                "param": error.param,
                "code": error.code,
            }
        }

    def response(self, error: APIError) -> JSONResponse:
        return JSONResponse(self.body(error), status_code=self.status(error), headers=error.headers)


class DialectRoute(APIRoute):
    """A route that answers its errors in its router's dialect (``dialect_router``); FastAPI
    keeps a route's class when its router is included, and Starlette puts the matched route in
    the request's scope, where the handlers below read its dialect."""

    dialect: ClassVar[ErrorDialect]


class OpenAIRoute(DialectRoute):
    dialect = ErrorDialect.openai


class TEIRoute(DialectRoute):
    dialect = ErrorDialect.tei


_ROUTE_CLASSES: dict[ErrorDialect, type[DialectRoute]] = {
    ErrorDialect.openai: OpenAIRoute,
    ErrorDialect.tei: TEIRoute,
}


def dialect_router(dialect: ErrorDialect) -> APIRouter:
    """A router module's router: every route of it answers its errors in ``dialect``."""
    return APIRouter(route_class=_ROUTE_CLASSES[dialect])


def declared_dialect(route: object) -> ErrorDialect | None:
    """The dialect a route declares (None: a route made otherwise, the ops routes)."""
    return route.dialect if isinstance(route, DialectRoute) else None


def router_dialect(router: APIRouter) -> ErrorDialect:
    """The dialect a router declares; TypeError for one made without ``dialect_router``."""
    route_class = router.route_class
    if not (isinstance(route_class, type) and issubclass(route_class, DialectRoute)):
        raise TypeError(
            "a gateway router declares its error dialect: make it with "
            "errors.dialect_router(ErrorDialect.openai | ErrorDialect.tei)"
        )
    return route_class.dialect


def dialect_of(scope: Scope) -> ErrorDialect:
    """The dialect of the route a request matched, else by its path's prefix."""
    dialect = declared_dialect(scope.get("route"))
    return dialect if dialect is not None else ErrorDialect.of_path(scope["path"])


def error_status(path: str, error: APIError) -> int:
    """The status an error on ``path`` answers where no declared route serves it."""
    return ErrorDialect.of_path(path).status(error)


def error_body(path: str, error: APIError) -> dict[str, Any]:
    """The body an error on ``path`` answers where no declared route serves it."""
    return ErrorDialect.of_path(path).body(error)


def render(request: Request, error: APIError) -> JSONResponse:
    return dialect_of(request.scope).response(error)


async def api_error_handler(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, APIError)
    return render(request, error)


async def validation_error_handler(request: Request, error: Exception) -> JSONResponse:
    """A body that does not fit the schema: 400 in OpenAI's dialect (what OpenAI answers),
    422 in TEI's (what TEI answers), naming the field and the problem. A body that is not JSON
    at all is 400 in both (TEI's axum answers its syntax error 400, a schema mismatch 422)."""
    assert isinstance(error, RequestValidationError)
    errors = error.errors()
    if any(item.get("type") == "json_invalid" for item in errors):
        detail = next(item for item in errors if item.get("type") == "json_invalid")
        message = (
            f"the body is not valid JSON: {detail.get('ctx', {}).get('error', detail.get('msg'))}"
        )
        return render(request, APIError(400, message, code="invalid_json"))
    return render(request, invalid_request(errors))


def invalid_request(errors: Sequence[Any]) -> APIError:
    """A body that does not fit its request model (pydantic's errors): 400, naming the first
    fields and their problems."""
    problems = []
    param = None
    for item in errors[:5]:
        location = ".".join(str(part) for part in item.get("loc", ()) if part != "body")
        param = param or location or None
        problems.append(f"{location or 'body'}: {item.get('msg')}")
    message = "invalid request: " + "; ".join(problems)
    return APIError(400, message, param=param, code="invalid_request")


async def protocol_error_handler(request: Request, error: Exception) -> JSONResponse:
    """A chunk the protocol's one validator refused as the gateway built it (a number past its
    bound, shared/protocol.py ``check_count``): the caller's error, 400 in OpenAI's dialect and
    422 in TEI's, with the owner's message, which names the field and its range. The door
    translates; it does not check again (the request models bound only what they own)."""
    return render(request, as_api_error(error, _retry_after_s(request)))


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
    return render(request, as_api_error(error, _retry_after_s(request)))


async def unexpected_error_handler(request: Request, error: Exception) -> JSONResponse:
    """Anything else still answers in the route's envelope (the server logs the traceback)."""
    return render(request, as_api_error(error, _retry_after_s(request)))


def _retry_after_s(request: Request) -> int:
    return request.app.state.gateway.settings.gateway_retry_after_s


def as_api_error(error: Exception, retry_after_s: int) -> APIError:
    """The answer an exception a route raised stands for, in any door (the HTTP handlers here,
    TEI's gRPC server): an APIError itself; a chunk the protocol's validator refused, 400 with
    its message (the caller's error); Redis unreachable or hung, 503 ``queue_unavailable`` with
    Retry-After (nothing was lost that cannot be sent again), any other Redis refusal 500
    naming the setting to check (credentials, ACL); anything else 500 (the server logs the
    traceback)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ProtocolError):
        return APIError(400, str(error), code="invalid_request")
    if isinstance(error, redis_errors.RedisError | redis_errors.RedisClusterException):
        fault = classify(error)
        if fault.kind is FaultKind.TRANSIENT:
            return retry_later(
                503,
                f"the queue (Redis) is unavailable ({fault.detail}); retry after the "
                "Retry-After seconds",
                "queue_unavailable",
                retry_after_s,
            )
        return APIError(
            500,
            f"the queue (Redis) refused the gateway ({fault.detail}); check "
            f"{fault.setting} (address, credentials, ACL)",
            type="server_error",
            code="queue_error",
        )
    return APIError(
        500,
        f"internal error ({type(error).__name__}); the gateway's log has the traceback",
        type="server_error",
        code="internal_error",
    )


# (exception class, handler) for the app, in one list so every error has its envelope
EXCEPTION_HANDLERS = (
    (APIError, api_error_handler),
    (RequestValidationError, validation_error_handler),
    (ProtocolError, protocol_error_handler),
    (HTTPException, http_error_handler),
    (redis_errors.RedisError, redis_error_handler),
    (redis_errors.RedisClusterException, redis_error_handler),
    (Exception, unexpected_error_handler),
)
