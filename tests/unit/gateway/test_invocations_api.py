"""SageMaker's POST /invocations (embedfleet/gateway/invocations_api.py): a body goes to the
route its shape names, and its problems answer as that route's would."""

from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError

from embedfleet.gateway.invocations_api import is_rerank, parsed
from embedfleet.gateway.rerank_api import RerankRequest
from tests.unit.gateway.offline import AUTH, offline_gateway, tei_error


def test_a_rerank_body_has_a_query_and_texts() -> None:
    assert is_rerank({"query": "q", "texts": ["a"]})
    assert not is_rerank({"query": "q"}) and not is_rerank({"inputs": "x"})
    assert not is_rerank([("query", "texts")])


def test_a_body_is_parsed_as_its_route_or_refused_as_fastapi_would() -> None:
    body = parsed(RerankRequest, {"query": "q", "texts": ["a", "b"]})
    assert (body.query, body.texts) == ("q", ["a", "b"])
    with pytest.raises(RequestValidationError) as caught:
        parsed(RerankRequest, {"query": "q", "texts": 3})
    assert caught.value.errors()[0]["loc"] == ("texts",)


def test_each_shapes_error_is_the_routes_own() -> None:
    http = offline_gateway()
    rerank = http.post("/invocations", json={"query": "q", "texts": 3}, headers=AUTH)
    assert tei_error(rerank, 422) == "invalid request: texts: Input should be a valid list"
    similar = http.post("/invocations", json={"inputs": {"source_sentence": "a"}}, headers=AUTH)
    assert tei_error(similar, 422) == "invalid request: inputs.sentences: Field required"
