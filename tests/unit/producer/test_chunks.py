"""A chunk as the producer takes it (producer/chunks.py): a Chunk or a JSONL-like mapping,
the job's options filled in where the chunk has none, checked by the protocol's validator."""

from __future__ import annotations

import pytest

from embedfleet.producer.chunks import EmbeddingOptions, as_chunk
from embedfleet.shared.protocol import Chunk, ProtocolError


def test_options_fill_only_what_the_chunk_leaves_unset() -> None:
    options = EmbeddingOptions(prompt_name="query", dimensions=64)
    own = Chunk(id="a", text="t", dimensions=32)
    applied = options.apply(own)
    assert (applied.prompt_name, applied.dimensions) == ("query", 32)
    bare = Chunk(id="b", text="t")
    assert EmbeddingOptions().apply(bare) is bare  # nothing to fill: the same object


def test_a_mapping_becomes_a_chunk_of_the_job() -> None:
    chunk = as_chunk({"id": "x1", "text": "hello", "meta": {"k": 1}}, "job-7")
    assert (chunk.id, chunk.text, chunk.meta, chunk.job) == ("x1", "hello", {"k": 1}, "job-7")
    # a mapping's own job is kept when the call names none
    assert as_chunk({"id": "x2", "text": "t", "job": "theirs"}, None).job == "theirs"
    # a Chunk is moved to the call's job
    assert as_chunk(Chunk(id="c", text="t", job="old"), "new").job == "new"


def test_a_bad_chunk_is_refused_naming_its_id() -> None:
    with pytest.raises(ProtocolError, match="'dimensions' must be an integer"):
        as_chunk({"id": "e1", "text": "t", "dimensions": -3}, None)
    with pytest.raises(ProtocolError, match="chunk 'e2'"):
        as_chunk(Chunk(id="e2", text="t", dimensions=-3), None)
    with pytest.raises(ValueError):
        as_chunk({"text": "no id"}, None)
