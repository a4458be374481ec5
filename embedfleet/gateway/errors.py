"""Errors in each dialect's envelope: OpenAI's on /v1 routes, TEI's on TEI's routes.

OpenAI: ``{"error": {"message", "type", "param", "code"}}``. TEI: ``{"error", "error_type"}``.
Every error the gateway raises is an ``APIError``; the app's handler renders it for the route.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

# TEI's routes; everything else speaks OpenAI's dialect (and the ops routes have no errors)
TEI_PATHS = frozenset({"/", "/embed", "/info", "/health"})

# TEI's error_type by status (text-embeddings-inference router/src/lib.rs ErrorType)
_TEI_TYPES = {
    400: "Validation",
    401: "Unauthorized",
    404: "Validation",
    413: "Validation",
    422: "Validation",
    424: "Backend",
    429: "Overloaded",
    503: "Unhealthy",
    504: "Backend",
}


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


def overloaded(message: str, retry_after_s: int) -> APIError:
    return APIError(
        429,
        message,
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry_after_s)},
    )


def error_body(path: str, error: APIError) -> dict[str, Any]:
    if path in TEI_PATHS:
        return {"error": error.message, "error_type": _TEI_TYPES.get(error.status, "Backend")}
    return {
        "error": {
            "message": error.message,
            "type": error.type,
            "param": error.param,
            "code": error.code,
        }
    }


def render(request: Request, error: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(request.url.path, error), status_code=error.status, headers=error.headers
    )


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
    status = 422 if request.url.path in TEI_PATHS else 400
    message = "invalid request: " + "; ".join(problems)
    return render(request, APIError(status, message, param=param, code="invalid_request"))
