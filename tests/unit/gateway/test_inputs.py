"""The gateway's input pieces (embedfleet/gateway/inputs.py): input shapes, token ids,
truncation, unit length, dimensions, base64."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from embedfleet.gateway.errors import APIError
from embedfleet.gateway.inputs import (
    as_texts,
    check_context,
    check_dimensions,
    encode_vector,
    fit_to_model,
    keep_last_tokens,
    unit_vectors,
)
from embedfleet.producer.tokens import ModelTokenizer
from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.modelcard import ModelCard


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(resolve_model_path("all-MiniLM-L6-v2"))


def test_input_shapes(tokenizer: ModelTokenizer) -> None:
    ids = tokenizer.tokenizer.encode("hello world", add_special_tokens=False).ids
    assert as_texts("hello world", None) == ["hello world"]
    assert as_texts(["a", "b"], None) == ["a", "b"]
    assert as_texts(ids, tokenizer) == ["hello world"]  # read as the model's own ids
    assert as_texts([ids, ids], tokenizer) == ["hello world"] * 2
    assert as_texts(["  ", "\n"], None) == ["  ", "\n"]  # whitespace is text, as in TEI
    for bad in ([], [""], ["text", 3.5]):
        with pytest.raises(APIError) as caught:
            as_texts(bad, tokenizer)  # type: ignore[arg-type]
        assert caught.value.status == 400 and caught.value.param == "input"
    with pytest.raises(APIError) as outside:
        as_texts([[10**9]], tokenizer)
    assert outside.value.code == "invalid_input"


def test_token_ids_are_refused_by_default_naming_the_fix() -> None:
    for ids in ([9906, 1917], [[9906, 1917], [15339]]):  # tiktoken's, as LangChain sends them
        with pytest.raises(APIError) as caught:
            as_texts(ids, None)
        error = caught.value
        assert (error.status, error.code, error.param) == (400, "token_ids_not_accepted", "input")
        assert "check_embedding_ctx_length=False" in error.message
        assert "EMBEDFLEET_GATEWAY_ACCEPT_TOKEN_IDS" in error.message
        assert "EMBEDFLEET_GATEWAY_TIKTOKEN_ENCODING=cl100k_base" in error.message


def test_left_truncation_keeps_the_end_within_the_budget(tokenizer: ModelTokenizer) -> None:
    words = [f"w{n} unbelievably" for n in range(400)]
    text = " ".join(words)
    limit = 256  # all-MiniLM-L6-v2's max_seq_length, as its card says
    assert tokenizer.lengths([text], limit)[0] > limit
    [right] = fit_to_model([text], tokenizer, "", limit, truncate=True, direction="Right")
    assert right == text  # the worker keeps the start itself
    [left] = fit_to_model([text], tokenizer, "", limit, truncate=True, direction="left")
    assert text.endswith(left) and left.endswith("w399 unbelievably")
    assert tokenizer.lengths([left], limit)[0] == limit
    with pytest.raises(APIError) as caught:
        fit_to_model([text], tokenizer, "", limit, truncate=False)
    assert caught.value.status == 422 and "must have less than 256 tokens" in caught.value.message
    short = ["short text"]
    assert fit_to_model(short, tokenizer, "", limit, truncate=False) == short
    # no card yet: the texts go as they are (the worker truncates), but Left needs the maximum
    assert fit_to_model([text], tokenizer, "", None, truncate=True) == [text]
    with pytest.raises(APIError) as unknown:
        fit_to_model([text], tokenizer, "", None, truncate=True, direction="Left")
    assert (unknown.value.status, unknown.value.code) == (503, "no_model_card")
    # a cut inside a word: its continuation pieces re-tokenize from the cut and still fit
    budget = 5
    tail = keep_last_tokens("tokenization unbelievably", tokenizer, budget)
    assert "unbelievably".endswith(tail) or tail.endswith("unbelievably")
    assert len(tokenizer.tokenizer.encode(tail, add_special_tokens=False).ids) <= budget


def test_answers_are_unit_length_only_when_the_model_or_the_caller_says() -> None:
    # what crossed the wire as fp16: a norm of 1 +- 1e-4 comes out at 1 in float32
    vectors = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    wire = vectors.astype(np.float16).astype(np.float32)
    unit = unit_vectors(wire, True)
    assert unit.dtype == np.float32
    assert np.abs(np.linalg.norm(unit, axis=1) - 1.0).max() < 1e-6
    assert np.allclose(unit, vectors, atol=1e-3)  # same direction
    raw = unit_vectors(wire * 3, False)
    assert np.array_equal(raw, wire * 3)  # not normalised when neither asks


def test_dimensions_are_checked_against_the_card_when_there_is_one() -> None:
    card = ModelCard(name="tiny", dim=48, max_length=32, normalize=True)  # its dimension: 48
    check_dimensions(None, None)
    check_dimensions(5000, None)  # no card yet: the worker refuses it, per chunk
    check_dimensions(48, card)
    for dimensions, model_card in ((0, None), (49, card), (-1, card)):
        with pytest.raises(APIError) as caught:
            check_dimensions(dimensions, model_card)
        assert caught.value.status == 400 and caught.value.param == "dimensions"


def test_base64_is_little_endian_float32() -> None:
    vector = np.array([1.0, -2.5, 0.125], dtype=np.float32)
    encoded = encode_vector(vector, "base64")
    assert isinstance(encoded, str)
    assert base64.b64decode(encoded) == b"\x00\x00\x80?\x00\x00 \xc0\x00\x00\x00>"
    assert encode_vector(vector, "float") == [1.0, -2.5, 0.125]


def test_a_refusal_names_the_input_by_its_place_among_images(tokenizer: ModelTokenizer) -> None:
    """A text refused as over the model's maximum is named by its place in the request, which
    images (taken out before tokenizing: gateway/images.py) may share: ``positions``."""
    texts = ["short", "many words " * 100]
    for positions, named in ((None, "[1]"), ([0, 3], "[3]")):
        with pytest.raises(APIError) as context:
            check_context(tokenizer.lengths(texts, 64), 64, "input", positions)
        assert f"'input{named}' has more" in context.value.message
        with pytest.raises(APIError) as fitted:
            fit_to_model(texts, tokenizer, "", 64, truncate=False, positions=positions)
        assert f"(`inputs{named}`)" in fitted.value.message
