"""workers/model/precision.py's pure parts: probe texts embedded a batch at a time."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from embedfleet.workers.model.precision import embed_in_batches


def test_probe_batches_go_in_by_length_and_vectors_come_back_in_the_texts_order() -> None:
    texts = ["a much longer text than the others", "hi", "a mid text", "x", "longest of them all!!"]
    batches: list[list[str]] = []

    def embed(batch: Sequence[str]) -> np.ndarray:
        batches.append(list(batch))
        return np.array([[float(len(text))] for text in batch])

    vectors = embed_in_batches(embed, texts, size=2)

    # each batch pads to its longest text: short ones together, long ones together
    assert batches == [["x", "hi"], ["a mid text", "longest of them all!!"], [texts[0]]]
    assert vectors[:, 0].tolist() == [float(len(text)) for text in texts]
