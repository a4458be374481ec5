"""POST /embeddings without /v1 (embedfleet/gateway/openai_alias_api.py): the same handler as
/v1/embeddings, in OpenAI's dialect."""

from __future__ import annotations

from tests.unit.gateway.offline import AUTH, offline_gateway, openai_error


def test_the_alias_answers_as_v1_does() -> None:
    http = offline_gateway()
    bad = {"input": 5, "model": "m"}
    alias = openai_error(http.post("/embeddings", json=bad, headers=AUTH), 400)
    v1 = openai_error(http.post("/v1/embeddings", json=bad, headers=AUTH), 400)
    assert alias == v1 and alias["message"].startswith("invalid request: input")
    assert openai_error(http.post("/embeddings", json=bad), 401)["code"] == "invalid_api_key"
