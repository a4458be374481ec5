"""workers/calibration.py's pure parts: a calibration's JSON round trip and what a malformed one
says, the variant labels (one per truncation and renormalisation), the fixed built-in corpus and
the ranges computed from it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from embedfleet.workers.calibration import (
    Calibration,
    CalibrationError,
    calibration_texts,
    compute,
    variant_label,
)


def sample() -> Calibration:
    ranges = np.array([[-0.5, -0.25, 0.0], [0.5, 0.75, 1.0]], dtype=np.float32)
    return Calibration("minilm", "3", ranges, texts=7, source="test")


def test_a_calibration_round_trips_through_its_json() -> None:
    calibration = sample()
    back = Calibration.from_json(calibration.to_json().encode(), "redis key")
    assert (back.model, back.variant, back.texts, back.source) == ("minilm", "3", 7, "test")
    assert back.ranges.dtype == np.float32
    np.testing.assert_array_equal(back.ranges, calibration.ranges)
    assert json.loads(calibration.to_json())["dim"] == 3


def test_a_file_without_texts_or_source_is_named_by_where_it_came_from() -> None:
    text = json.dumps({"model": "m", "variant": "2", "dim": 2, "min": [0, 0], "max": [1, 1]})
    calibration = Calibration.from_json(text, "calibration.json")
    assert (calibration.texts, calibration.source) == (0, "calibration.json")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("not json", "calibration.json is not a calibration"),
        (json.dumps({"model": "m", "variant": "2", "dim": 2, "min": [0, 0]}), "'max'"),
        (
            json.dumps({"model": "m", "variant": "3", "dim": 3, "min": [0, 0], "max": [1, 1]}),
            "min/max have 2 values, dim is 3",
        ),
    ],
)
def test_a_malformed_calibration_says_where_and_why(text: str, says: str) -> None:
    with pytest.raises(CalibrationError, match=r"calibration\.json is not a calibration") as error:
        Calibration.from_json(text, "calibration.json")
    assert says in str(error.value)


def test_each_truncation_and_renormalisation_has_its_own_variant() -> None:
    assert variant_label(384, 384, renormalized=True) == "384"
    assert variant_label(512, 384, renormalized=False) == "384", "not truncated: the model's"
    assert variant_label(128, 384, renormalized=True) == "128"
    assert variant_label(128, 384, renormalized=False) == "128-raw"


def test_the_built_in_corpus_is_fixed_long_lines() -> None:
    texts = calibration_texts(50)
    assert len(texts) == 50
    assert all(len(text) > 20 and text == text.strip() for text in texts)
    assert calibration_texts(50) == texts, "every worker computes the same corpus"
    assert len(set(calibration_texts())) > 900


def test_the_ranges_are_each_dimensions_minimum_and_maximum() -> None:
    vectors = np.array([[1.0, -2.0], [3.0, 0.5], [-1.0, 4.0]])
    calibration = compute("m", "2", lambda texts: vectors[: len(texts)], ["a", "b", "c"])
    np.testing.assert_array_equal(calibration.ranges, [[-1.0, -2.0], [3.0, 4.0]])
    assert calibration.ranges.dtype == np.float32
    assert (calibration.texts, calibration.variant) == (3, "2")
