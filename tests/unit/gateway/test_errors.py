"""The gateway's error envelopes (embedfleet/gateway/errors.py): each dialect's body and
status, and unexpected errors in the route's envelope."""

from __future__ import annotations

from embedfleet.gateway.errors import APIError, error_body, error_status
from embedfleet.shared.settings import Settings


def test_each_dialect_has_its_envelope() -> None:
    error = APIError(429, "slow down", type="rate_limit_error", code="rate_limit_exceeded")
    assert error_body("/v1/embeddings", error) == {
        "error": {
            "message": "slow down",
            "type": "rate_limit_error",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    assert error_body("/embed", error) == {"error": "slow down", "error_type": "Overloaded"}
    assert error_body("/health", APIError(503, "none"))["error_type"] == "Unhealthy"
    # TEI answers its validation errors 422 (too many inputs included), an empty batch 400
    too_many = APIError(413, "2049 inputs", code="too_many_inputs")
    assert (error_status("/embed", too_many), error_status("/v1/embeddings", too_many)) == (
        422,
        413,
    )
    assert error_body("/embed", too_many)["error_type"] == "Validation"
    empty = APIError(400, "empty", code="empty_input")
    assert error_status("/embed", empty) == 400
    assert error_body("/embed", empty)["error_type"] == "Empty"
    assert error_status("/embed", APIError(400, "bad dimensions")) == 422
    body_too_large = APIError(413, "too large", code="request_too_large")
    assert error_status("/embed", body_too_large) == 413


def test_unexpected_errors_answer_in_the_routes_envelope() -> None:
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from redis import exceptions as redis_errors

    from embedfleet.gateway.errors import EXCEPTION_HANDLERS

    app = FastAPI()
    app.state.gateway = SimpleNamespace(settings=Settings(gateway_retry_after_s=3))
    for error_class, handler in EXCEPTION_HANDLERS:
        app.add_exception_handler(error_class, handler)
    raised = {
        "down": redis_errors.ConnectionError("Error 111 connecting to redis:6379"),
        "denied": redis_errors.AuthenticationError("invalid username-password pair"),
        "bug": ValueError("unexpected"),
    }

    for prefix in ("/v1", ""):

        @app.get(prefix + "/fail/{kind}")
        async def fail(kind: str) -> None:
            raise raised[kind]

    http = TestClient(app, raise_server_exceptions=False)
    down = http.get("/v1/fail/down")
    assert down.status_code == 503 and down.headers["retry-after"] == "3"
    assert down.json()["error"]["code"] == "queue_unavailable"
    tei_down = http.get("/fail/down")
    assert tei_down.status_code == 503 and tei_down.json()["error_type"] == "Unhealthy"
    denied = http.get("/v1/fail/denied").json()["error"]
    assert denied["code"] == "queue_error" and "EMBEDFLEET_REDIS_URL" in denied["message"]
    bug = http.get("/v1/fail/bug")
    assert bug.status_code == 500 and bug.json()["error"]["code"] == "internal_error"
    assert http.get("/fail/bug").json()["error_type"] == "Backend"
