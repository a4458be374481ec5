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


def test_infinitys_image_modality_takes_data_uris_alone() -> None:
    """``"modality": "image"`` (Infinity's ``extra_body``): a URL is refused, never embedded
    as the text it is, and nothing is fetched; a modality Infinity's /embeddings has and this
    gateway has not (audio) is a 400 naming it."""
    http = offline_gateway()
    for path in ("/v1/embeddings", "/embeddings"):
        body = {"model": "m", "input": ["https://example.com/cat.jpg"], "modality": "image"}
        error = openai_error(http.post(path, json=body, headers=AUTH), 400)
        assert error["code"] == "url_not_accepted" and error["param"] == "input"
    text = {"model": "m", "input": "a red bicycle", "modality": "image"}
    error = openai_error(http.post("/v1/embeddings", json=text, headers=AUTH), 400)
    assert error["code"] == "invalid_image"
    audio = {"model": "m", "input": "data:audio/wav;base64,UklGRg==", "modality": "audio"}
    error = openai_error(http.post("/v1/embeddings", json=audio, headers=AUTH), 400)
    assert error["param"] == "modality"
