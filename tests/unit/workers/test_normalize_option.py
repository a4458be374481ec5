"""TEI's ``normalize: false`` (issue 42): the chunk option ``normalize`` on the wire, and the rows
of a batch computed before the model's Normalize, normalised except those that asked for them
as they are. The parity with sentence-transformers is end to end:
tests/end_to_end/test_gateway_dialects.py."""

from __future__ import annotations

import numpy as np
import pytest

from embedfleet.shared.protocol import (
    Chunk,
    ProtocolError,
    chunk_from_mapping,
    decode_chunk,
    encode_chunk,
)
from embedfleet.workers.long_inputs import before_normalize_wanted, normalized_except


def test_the_option_on_the_wire() -> None:
    chunk = chunk_from_mapping({"id": "a", "text": "x", "normalize": False})
    assert chunk.normalize is False
    assert decode_chunk(encode_chunk(chunk)).normalize is False
    assert chunk_from_mapping({"id": "a", "text": "x"}).normalize is None
    with pytest.raises(ProtocolError, match="'normalize' must be true or false"):
        chunk_from_mapping({"id": "a", "text": "x", "normalize": "no"})


def test_rows_are_normalised_except_those_asking_for_the_vector_before_normalize() -> None:
    rows = np.array([[3.0, 4.0], [6.0, 8.0]], dtype=np.float32)
    chunks = [Chunk("a", "x"), Chunk("b", "y", normalize=False)]
    assert before_normalize_wanted(chunks, model_normalizes=True)
    assert not before_normalize_wanted(chunks, model_normalizes=False)  # nothing to leave out
    assert not before_normalize_wanted(chunks[:1], model_normalizes=True)
    out = normalized_except(rows, chunks, model_normalizes=True)
    np.testing.assert_allclose(out, [[0.6, 0.8], [6.0, 8.0]], rtol=1e-6)
    # a model without Normalize: every row as computed
    np.testing.assert_allclose(normalized_except(rows, chunks, model_normalizes=False), rows)
