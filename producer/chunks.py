"""What a caller hands the producer, made into a checked Chunk: ``as_chunk`` and the per-job
(or per-query) ``EmbeddingOptions`` it fills in.

The one builder of the client's chunks: ``Producer.enqueue``, the priority streams' client
(producer/queries.py) and the JSONL reader (producer/jsonl.py) all build through it, so what a
worker would dead-letter is refused here, before anything is sent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from embedfleet.shared.protocol import (
    DEFAULT_LIMITS,
    OPTION_NAMES,
    REPRESENTATION_OPTION_NAMES,
    Chunk,
    ChunkLimits,
    ChunkOptions,
    ProtocolError,
    chunk_from_mapping,
    validate_chunk,
)

ChunkLike = Chunk | Mapping[str, Any]


class EmbeddingOptions(ChunkOptions):
    """Per-job (or per-query) embedding options, the ones a chunk carries (shared/protocol.py
    ``ChunkOptions``, keyword-only); None leaves the chunk's own or the worker's."""

    def apply(self, chunk: Chunk) -> Chunk:
        """The chunk with these options filled in where the chunk has none of its own."""
        changes = {
            name: getattr(self, name)
            for name in OPTION_NAMES
            if getattr(self, name) is not None and getattr(chunk, name) is None
        }
        return dataclasses.replace(chunk, **changes) if changes else chunk


def as_chunk(
    item: ChunkLike,
    job: str | None,
    options: EmbeddingOptions | None = None,
    limits: ChunkLimits = DEFAULT_LIMITS,
) -> Chunk:
    """Accept a Chunk or a mapping like one JSONL line: {"id", "text", "meta"?, options?} (or
    an image: "image" bytes in place of "text", and "image_ref", where they came from),
    checked by the protocol's one validator with ``limits`` (what the worker would
    dead-letter is refused here, with a ``ValueError``, a ``ProtocolError``, saying why)."""
    if isinstance(item, Chunk):
        chunk = item if job is None or item.job == job else dataclasses.replace(item, job=job)
    else:
        fields = {
            name: item.get(name)
            for name in (
                "id",
                "text",
                "meta",
                "tenant",
                *OPTION_NAMES,
                *REPRESENTATION_OPTION_NAMES,
                "reembed",
                "image",
                "image_ref",
            )
        }
        chunk = chunk_from_mapping(fields, limits, job=job or item.get("job"))
    if options is not None:
        chunk = options.apply(chunk)
    try:
        return validate_chunk(chunk, limits)
    except ProtocolError as error:
        raise ProtocolError(f"chunk {chunk.id!r}: {error}", error.code) from None
