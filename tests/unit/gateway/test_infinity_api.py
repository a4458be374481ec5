"""POST /embeddings_image (embedfleet/gateway/infinity_api.py), Infinity's image route, in
OpenAI's dialect: what it refuses by the inputs' form alone, before anything reaches the fleet
(the app offline: no Redis, no worker)."""

from __future__ import annotations

import pytest

from tests.unit.gateway.offline import AUTH, offline_gateway, openai_error

PIXEL = "data:image/png;base64,iVBORw0KGgo="


@pytest.mark.parametrize("path", ["/embeddings_image", "/v1/embeddings_image"])
def test_a_url_is_refused_and_nothing_is_fetched(path: str) -> None:
    http = offline_gateway()
    body = {"model": "clip", "input": [PIXEL, "http://images.cocodataset.org/val2017/1.jpg"]}
    error = openai_error(http.post(path, json=body, headers=AUTH), 400)
    assert error["code"] == "url_not_accepted" and error["param"] == "input"
    assert "only data URIs are accepted" in str(error["message"])


def test_every_input_is_an_image() -> None:
    http = offline_gateway()
    text = openai_error(
        http.post("/embeddings_image", json={"input": "a red bicycle"}, headers=AUTH), 400
    )
    assert text["code"] == "invalid_image" and "'input[0]' is not an image" in str(text["message"])
    shape = openai_error(http.post("/embeddings_image", json={"input": 5}, headers=AUTH), 400)
    assert shape["code"] == "invalid_request"
    fmt = {"input": PIXEL, "encoding_format": "binary"}
    assert openai_error(http.post("/embeddings_image", json=fmt, headers=AUTH), 400)["param"] == (
        "encoding_format"
    )
    assert openai_error(http.post("/embeddings_image", json=fmt), 401)["code"] == "invalid_api_key"
