"""Vertex AI's POST /vertex (embedfleet/gateway/vertex_api.py): a body that is not Vertex's
instances is TEI's 422."""

from __future__ import annotations

from tests.unit.gateway.offline import AUTH, offline_gateway, tei_error


def test_instances_must_be_a_list() -> None:
    http = offline_gateway()
    message = tei_error(http.post("/vertex", json={"instances": 3}, headers=AUTH), 422)
    assert message == "invalid request: instances: Input should be a valid list"
    assert http.post("/vertex", json={"instances": 3}).json()["error_type"] == "Unauthorized"
