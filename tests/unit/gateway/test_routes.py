"""Adding an HTTP route to the gateway is one route module, whose router declares its error
dialect, plus one line in gateway/routes.py (issue 41). Its errors answer in that dialect, not
by its path's prefix: the toy (tests/unit/gateway/toy_routes.py) is TEI's under /v1, and one in
OpenAI's dialect answers outside /v1. Unknown paths keep answering by their prefix.

In process (FastAPI's TestClient, the lifespan not run): nothing here reaches Redis or a
worker."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient

from embedfleet.gateway import routes
from embedfleet.gateway.app import create_app, include_routers
from embedfleet.gateway.errors import ErrorDialect, dialect_router
from embedfleet.shared.settings import Settings
from tests.unit.gateway import toy_routes

KEY = "sk-toy"
AUTH = {"Authorization": f"Bearer {KEY}"}

# a toy in OpenAI's dialect, outside /v1 (the reverse of toy_routes')
openai_toy = dialect_router(ErrorDialect.openai)


@openai_toy.post("/toy-openai")
async def post_openai_toy(body: toy_routes.ToyRequest) -> dict[str, int]:
    return toy_routes.counted(body)


def gateway_app() -> TestClient:
    # Redis is never reached: no lifespan, and the toys do not use it
    settings = Settings(api_keys=KEY, redis_url="redis://127.0.0.1:9")
    return TestClient(create_app(settings), raise_server_exceptions=False)


def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    # the one line: the registry of route modules (gateway/routes.py) lists the toys' routers
    monkeypatch.setattr(routes, "ROUTERS", (*routes.ROUTERS, toy_routes.router, openai_toy))


@pytest.fixture(scope="module")
def http() -> Iterator[TestClient]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        registered(monkeypatch)
        yield gateway_app()


def test_a_route_module_answers_once_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    unregistered = gateway_app().post("/v1/toy", json={"n": 2}, headers=AUTH)
    assert unregistered.status_code == 404  # not served before its line
    assert unregistered.json()["error"]["message"].startswith("Invalid URL (POST /v1/toy)")
    registered(monkeypatch)
    http = gateway_app()
    answer = http.post("/v1/toy", json={"n": 2}, headers=AUTH)
    assert answer.status_code == 200 and answer.json() == {"n": 2}
    assert http.post("/toy-openai", json={"n": 3}, headers=AUTH).json() == {"n": 3}


def test_a_tei_route_under_v1_answers_its_errors_in_teis_dialect(http: TestClient) -> None:
    def tei_error(answer, status: int, error_type: str) -> str:
        assert answer.status_code == status, answer.text
        body = answer.json()
        assert set(body) == {"error", "error_type"} and body["error_type"] == error_type
        return body["error"]

    # a body that does not fit the schema: TEI's 422 (OpenAI's would be 400)
    message = tei_error(http.post("/v1/toy", json={"n": "x"}, headers=AUTH), 422, "Validation")
    assert message.startswith("invalid request: n:")
    # the route's own APIError, in TEI's status for it
    message = tei_error(http.post("/v1/toy", json={"n": -1}, headers=AUTH), 422, "Validation")
    assert message == "`n` must not be negative"
    tei_error(http.post("/v1/toy", json={"n": 0}, headers=AUTH), 400, "Empty")
    # Starlette's 405, with its Allow header
    wrong_method = http.get("/v1/toy", headers=AUTH)
    tei_error(wrong_method, 405, "Validation")
    assert wrong_method.headers["allow"] == "POST"
    # the front door's refusals, before routing: a missing key, a body over the limit
    tei_error(http.post("/v1/toy", json={"n": 2}), 401, "Unauthorized")
    too_large = http.post(
        "/v1/toy",
        content=b"x" * (Settings().gateway_max_body_bytes + 1),
        headers={**AUTH, "Content-Type": "application/json"},
    )
    assert "EMBEDFLEET_GATEWAY_MAX_BODY_BYTES" in tei_error(too_large, 413, "Validation")


def test_an_openai_route_outside_v1_answers_in_openais_dialect(http: TestClient) -> None:
    invalid = http.post("/toy-openai", json={"n": "x"}, headers=AUTH)
    assert invalid.status_code == 400
    assert invalid.json()["error"]["param"] == "n"
    assert invalid.json()["error"]["code"] == "invalid_request"
    refused = http.post("/toy-openai", json={"n": -1}, headers=AUTH)
    assert refused.status_code == 400
    assert refused.json() == {
        "error": {
            "message": "`n` must not be negative",
            "type": "invalid_request_error",
            "param": "n",
            "code": "invalid_value",
        }
    }
    assert http.post("/toy-openai", json={"n": 2}).json()["error"]["type"] == (
        "invalid_request_error"  # 401 in OpenAI's envelope
    )


def test_the_gateways_own_routes_and_unknown_paths_answer_as_before(http: TestClient) -> None:
    embeddings = http.post("/v1/embeddings", json={}, headers=AUTH)
    assert embeddings.status_code == 400 and embeddings.json()["error"]["param"] == "input"
    embed = http.post("/embed", json={}, headers=AUTH)
    assert embed.status_code == 422 and embed.json()["error_type"] == "Validation"
    rerank = http.post("/v1/rerank", json={}, headers=AUTH)  # Cohere's: OpenAI's envelope
    assert rerank.status_code == 400 and rerank.json()["error"]["code"] == "invalid_request"
    # no route: the path's prefix decides, as before
    unknown_v1 = http.get("/v1/nope", headers=AUTH)
    assert unknown_v1.status_code == 404 and "error_type" not in unknown_v1.json()
    unknown = http.get("/nope", headers=AUTH)
    assert unknown.status_code == 404 and unknown.json()["error_type"] == "Validation"


def test_a_router_without_a_dialect_is_not_included() -> None:
    with pytest.raises(TypeError, match="declares its error dialect"):
        include_routers(FastAPI(), [APIRouter()])
