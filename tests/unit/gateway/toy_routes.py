"""A toy route module, written as the gateway's are (gateway/tei_api.py, gateway/cohere_api.py):
its router declares its error dialect, TEI's, though its path is under /v1 (OpenAI's prefix).
tests/unit/gateway/test_routes.py registers it with one line."""

from __future__ import annotations

from pydantic import BaseModel

from embedfleet.gateway.errors import APIError, ErrorDialect, dialect_router

router = dialect_router(ErrorDialect.tei)


class ToyRequest(BaseModel):
    n: int


def counted(body: ToyRequest) -> dict[str, int]:
    """The toys' answer, and their owner's check: the same error whichever dialect renders it."""
    if body.n < 0:
        raise APIError(400, "`n` must not be negative", param="n", code="invalid_value")
    return {"n": body.n}


@router.post("/v1/toy")
async def toy(body: ToyRequest) -> dict[str, int]:
    if body.n == 0:
        raise APIError(400, "`n` cannot be empty", param="n", code="empty_input")
    return counted(body)
