"""TEI's /similarity (embedfleet/gateway/similarity_api.py): the cosines, how POST / tells a
similarity body, and an empty list refused."""

from __future__ import annotations

import numpy as np

from embedfleet.gateway.similarity_api import cosines, is_similarity
from tests.unit.gateway.offline import AUTH, offline_gateway, tei_error


def test_cosines_of_each_row_with_the_source() -> None:
    source = np.array([1.0, 0.0], dtype=np.float32)
    others = np.array([[2.0, 0.0], [0.0, 3.0], [-1.0, 0.0], [1.0, 1.0], [0.0, 0.0]], np.float32)
    expected = [1.0, 0.0, -1.0, np.sqrt(0.5), 0.0]  # a zero vector: 0, not NaN
    assert np.allclose(cosines(source, others), expected)


def test_a_similarity_body_is_told_by_its_source_sentence() -> None:
    assert is_similarity({"inputs": {"source_sentence": "a", "sentences": ["b"]}})
    assert not is_similarity({"inputs": ["a", "b"]})
    assert not is_similarity({"inputs": {"sentences": ["b"]}})
    assert not is_similarity(["inputs"])


def test_no_sentences_is_teis_empty() -> None:
    body = {"inputs": {"source_sentence": "a", "sentences": []}}
    answer = offline_gateway().post("/similarity", json=body, headers=AUTH)
    assert tei_error(answer, 400) == "`sentences` cannot be empty"
    assert answer.json()["error_type"] == "Empty"
