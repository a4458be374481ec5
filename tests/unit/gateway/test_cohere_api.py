"""Cohere's POST /v1/rerank (embedfleet/gateway/cohere_api.py): its required fields, refused
in the /v1 dialect."""

from __future__ import annotations

from tests.unit.gateway.offline import AUTH, offline_gateway, openai_error


def test_model_and_documents_are_required() -> None:
    http = offline_gateway()
    error = openai_error(http.post("/v1/rerank", json={"query": "q"}, headers=AUTH), 400)
    assert error["message"] == "invalid request: model: Field required; documents: Field required"
    assert (error["param"], error["code"]) == ("model", "invalid_request")
