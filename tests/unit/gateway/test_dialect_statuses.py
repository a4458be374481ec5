"""Issue 42: each dialect's status for the refusals TEI and OpenAI document, and truncation's
defaults (TEI's --auto-truncate on its routes, OpenAI's refusal on /v1), in the pure pieces
and through the app in process (FastAPI's TestClient, no lifespan: nothing reaches Redis).

The end-to-end side, with a worker and the real clients, is
tests/end_to_end/test_gateway_dialects.py."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from embedfleet.gateway.app import create_app
from embedfleet.gateway.errors import APIError, error_body, error_status
from embedfleet.gateway.inputs import as_texts, check_limits, openai_truncate, tei_truncate
from embedfleet.producer.tokens import ModelTokenizer
from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.settings import Settings

KEY = "sk-dialects"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(resolve_model_path("all-MiniLM-L6-v2"))


def test_truncation_defaults_per_dialect_and_a_request_overrides_them() -> None:
    defaults = Settings()
    assert defaults.gateway_auto_truncate is True  # TEI's router defaults --auto-truncate on
    assert defaults.gateway_openai_truncate is False  # OpenAI refuses an over-long input
    assert tei_truncate(None, defaults) is True and tei_truncate(False, defaults) is False
    assert openai_truncate(None, defaults) is False and openai_truncate(True, defaults) is True
    flipped = Settings(gateway_auto_truncate=False, gateway_openai_truncate=True)
    assert tei_truncate(None, flipped) is False and openai_truncate(None, flipped) is True


def test_only_the_empty_string_is_refused_and_tei_calls_it_empty(
    tokenizer: ModelTokenizer,
) -> None:
    assert as_texts(" ", tokenizer) == [" "]
    with pytest.raises(APIError) as caught:
        as_texts(["hi", ""], tokenizer, "inputs")
    error = caught.value
    assert (error.status, error.code, error.param) == (400, "empty_input", "inputs")
    assert error_status("/embed", error) == 400
    assert error_body("/embed", error)["error_type"] == "Empty"
    assert error_status("/v1/embeddings", error) == 400


def test_too_many_inputs_is_openais_400_and_teis_422() -> None:
    settings = Settings(gateway_max_inputs=4)
    with pytest.raises(APIError) as caught:
        check_limits(["x"] * 5, settings)
    error = caught.value
    assert (error.status, error.code) == (400, "too_many_inputs")
    assert error_status("/v1/embeddings", error) == 400
    assert error_status("/embed", error) == 422
    assert error_body("/embed", error)["error_type"] == "Validation"


def test_characters_over_the_limit_are_cut_when_truncating_else_refused() -> None:
    settings = Settings(gateway_max_input_chars=10)
    text = "abcdefghijklmnop"
    with pytest.raises(APIError) as caught:
        check_limits([text], settings)
    assert (caught.value.status, caught.value.code) == (400, "input_too_long")
    assert "EMBEDFLEET_GATEWAY_MAX_INPUT_CHARS" in caught.value.message
    assert check_limits([text, "short"], settings, truncate=True) == ["abcdefghij", "short"]
    assert check_limits([text], settings, truncate=True, direction="Left") == ["ghijklmnop"]


@pytest.fixture(scope="module")
def http() -> TestClient:
    # Redis is never reached: no lifespan, and a body that is not JSON is refused before
    settings = Settings(api_keys=KEY, redis_url="redis://127.0.0.1:9")
    return TestClient(create_app(settings), raise_server_exceptions=False)


def test_a_body_that_is_not_json_is_400_in_both_dialects(http: TestClient) -> None:
    tei = http.post("/embed", content=b'{"inputs": "hi"', headers=AUTH)
    assert tei.status_code == 400, tei.text  # TEI's (axum's) answer to a JSON syntax error
    assert set(tei.json()) == {"error", "error_type"}
    assert tei.json()["error_type"] == "Validation" and "not valid JSON" in tei.json()["error"]
    openai = http.post("/v1/embeddings", content=b"{not json", headers=AUTH)
    assert openai.status_code == 400, openai.text
    assert openai.json()["error"]["code"] == "invalid_json"
    # JSON of the wrong shape stays TEI's 422 (axum's data error)
    wrong = http.post("/embed", json={"input": "wrong field"}, headers=AUTH)
    assert wrong.status_code == 422 and wrong.json()["error_type"] == "Validation"
