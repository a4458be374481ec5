"""OpenAI's /v1/embeddings and /v1/models (embedfleet/gateway/openai_api.py): the response's
shape, and a body refused in OpenAI's dialect before the fleet."""

from __future__ import annotations

import base64

import numpy as np

from embedfleet.gateway.openai_api import embeddings_response
from tests.unit.gateway.offline import AUTH, offline_gateway, openai_error


def test_the_response_lists_each_vector_in_order_with_its_usage() -> None:
    vectors = np.array([[1.0, 0.5], [0.25, -2.0]], dtype=np.float32)
    answer = embeddings_response("mini", vectors, "float", 7)
    assert answer["object"] == "list" and answer["model"] == "mini"
    assert answer["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    data = answer["data"]
    assert isinstance(data, list)
    assert [(d["index"], d["embedding"]) for d in data] == [(0, [1.0, 0.5]), (1, [0.25, -2.0])]
    packed = embeddings_response("mini", vectors, "base64", 7)["data"]
    assert isinstance(packed, list)
    decoded = np.frombuffer(base64.b64decode(packed[1]["embedding"]), dtype="<f4")
    assert decoded.tolist() == [0.25, -2.0]


def test_a_bad_body_is_openais_400() -> None:
    http = offline_gateway()
    error = openai_error(http.post("/v1/embeddings", json={"model": "m"}, headers=AUTH), 400)
    assert error["message"] == "invalid request: input: Field required"
    assert error["type"] == "invalid_request_error"
