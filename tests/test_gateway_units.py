"""The gateway's pure pieces: API keys, input shapes, Matryoshka cut, base64, envelopes."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest

from embedfleet.gateway.auth import KeyChecker, load_api_keys
from embedfleet.gateway.errors import APIError, error_body
from embedfleet.gateway.inputs import as_texts, encode_vector, shape_vectors
from embedfleet.producer.tokens import ModelTokenizer
from embedfleet.shared.modeldir import ModelFiles
from embedfleet.shared.settings import Settings


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(ModelFiles.read("all-MiniLM-L6-v2"))


def test_keys_from_the_setting_and_a_file(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# rotated 2026-11\nsk-file-one\n\nsk-file-two\n")
    settings = Settings(api_keys=" sk-env ,", api_keys_file=str(keys_file))
    checker = KeyChecker(load_api_keys(settings))
    for key in ("sk-env", "sk-file-one", "sk-file-two"):
        checker.check(f"Bearer {key}")
    for header in (None, "", "Bearer", "Basic sk-env", "Bearer sk-env2", "Bearer sk-fil"):
        with pytest.raises(APIError) as caught:
            checker.check(header)
        assert caught.value.status == 401 and caught.value.code == "invalid_api_key"
    KeyChecker([]).check(None)  # no keys configured: open
    with pytest.raises(FileNotFoundError, match="EMBEDFLEET_API_KEYS_FILE"):
        load_api_keys(Settings(api_keys_file=str(tmp_path / "missing")))


def test_input_shapes(tokenizer: ModelTokenizer) -> None:
    ids = tokenizer.tokenizer.encode("hello world", add_special_tokens=False).ids
    assert as_texts("hello world", tokenizer) == ["hello world"]
    assert as_texts(["a", "b"], tokenizer) == ["a", "b"]
    assert as_texts(ids, tokenizer) == ["hello world"]
    assert as_texts([ids, ids], tokenizer) == ["hello world", "hello world"]
    for bad in ([], [""], ["  "], [[10**9]], ["text", 3.5]):
        with pytest.raises(APIError) as caught:
            as_texts(bad, tokenizer)  # type: ignore[arg-type]
        assert caught.value.status == 400 and caught.value.param == "input"


def test_dimensions_cut_and_renormalise() -> None:
    vectors = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    cut = shape_vectors(vectors, 4, normalized=True)
    assert cut.shape == (3, 4) and np.allclose(np.linalg.norm(cut, axis=1), 1.0)
    assert np.allclose(cut / cut[:, :1], vectors[:, :4] / vectors[:, :1])  # same direction
    assert shape_vectors(vectors, None, True) is vectors
    raw = shape_vectors(vectors * 3, 4, normalized=False)
    assert np.allclose(raw, vectors[:, :4] * 3)


def test_base64_is_little_endian_float32() -> None:
    vector = np.array([1.0, -2.5, 0.125], dtype=np.float32)
    encoded = encode_vector(vector, "base64")
    assert isinstance(encoded, str)
    assert base64.b64decode(encoded) == b"\x00\x00\x80?\x00\x00 \xc0\x00\x00\x00>"
    assert encode_vector(vector, "float") == [1.0, -2.5, 0.125]


def test_each_dialect_has_its_envelope() -> None:
    error = APIError(429, "slow down", type="rate_limit_error", code="rate_limit_exceeded")
    assert error_body("/v1/embeddings", error) == {
        "error": {
            "message": "slow down",
            "type": "rate_limit_error",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    assert error_body("/embed", error) == {"error": "slow down", "error_type": "Overloaded"}
    assert error_body("/health", APIError(503, "none"))["error_type"] == "Unhealthy"
