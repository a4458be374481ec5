"""The gateway's app (embedfleet/gateway/app.py): the liveness probe open to anyone, every
other route behind the API key, unknown paths answered by their prefix's dialect."""

from __future__ import annotations

from tests.unit.gateway.offline import AUTH, offline_gateway, openai_error, tei_error


def test_healthz_needs_no_key_and_the_routes_do() -> None:
    http = offline_gateway()
    assert http.get("/healthz").json() == {"status": "ok"}
    missing = openai_error(http.post("/v1/embeddings", json={"input": "x"}), 401)
    assert missing["message"].startswith("missing API key")
    tei_error(http.post("/embed", json={"inputs": "x"}), 401)


def test_an_unknown_path_answers_in_its_prefixs_dialect() -> None:
    http = offline_gateway()
    openai_error(http.get("/v1/nothing-here", headers=AUTH), 404)
    tei_error(http.get("/nothing-here", headers=AUTH), 404)
