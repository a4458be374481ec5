"""TEI's gRPC door, pure logic: the committed modules are protoc's output of the vendored proto,
and each refusal ends a call with the code TEI's gRPC server gives its error type
(router/src/grpc/server.rs). The calls themselves: tests/end_to_end/test_gateway_grpc.py."""

from __future__ import annotations

import pytest

grpc = pytest.importorskip("grpc")  # the gateway's extra

from embedfleet.gateway.errors import APIError  # noqa: E402
from embedfleet.gateway.tei_grpc.server import grpc_code  # noqa: E402

Code = grpc.StatusCode


def test_the_committed_modules_are_what_protoc_makes_of_the_proto() -> None:
    pytest.importorskip("grpc_tools")  # the dev extra's protoc
    from embedfleet.gateway.tei_grpc import generate

    assert generate.stale() == [], "run python -m embedfleet.gateway.tei_grpc.generate --write"


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        # TEI's error types: Empty and Validation are INVALID_ARGUMENT
        (400, "empty_input", Code.INVALID_ARGUMENT),
        (400, "invalid_input", Code.INVALID_ARGUMENT),
        (422, "invalid_prompt", Code.INVALID_ARGUMENT),
        (413, "too_many_inputs", Code.INVALID_ARGUMENT),
        # Backend (what the served model does not give), Overloaded, Unhealthy
        (424, "representation_not_served", Code.FAILED_PRECONDITION),
        (429, "rate_limit_exceeded", Code.RESOURCE_EXHAUSTED),
        (503, "queue_unavailable", Code.UNAVAILABLE),
        (503, "no_model_card", Code.UNAVAILABLE),
        # what TEI has no error type for: gRPC's own codes
        (401, "invalid_api_key", Code.UNAUTHENTICATED),
        (504, None, Code.DEADLINE_EXCEEDED),
        (500, "internal_error", Code.INTERNAL),
    ],
)
def test_a_refusal_ends_the_call_with_teis_code(
    status: int, code: str | None, expected: object
) -> None:
    assert grpc_code(APIError(status, "refused", code=code)) is expected
