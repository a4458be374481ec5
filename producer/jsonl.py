"""Reading chunks from JSON Lines: one {"id", "text", "meta"?, options?} object per line.

Each line goes through the protocol's one chunk validator (``chunk_from_mapping``) with the
configured limits, so a line accepted here is a chunk the worker will embed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

from embedfleet.shared.protocol import (
    DEFAULT_LIMITS,
    OPTION_NAMES,
    Chunk,
    ChunkLimits,
    ProtocolError,
    chunk_from_mapping,
)


@dataclass(frozen=True)
class BadLine:
    line_number: int
    reason: str


def read_chunks(
    stream: IO[str],
    job: str | None,
    rejected: list[BadLine],
    limits: ChunkLimits = DEFAULT_LIMITS,
) -> Iterator[Chunk]:
    """Yield valid chunks; record each bad line (with its number and why) in ``rejected``."""
    for line_number, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            rejected.append(BadLine(line_number, f"not JSON: {error.msg}"))
            continue
        if not isinstance(item, dict):
            rejected.append(BadLine(line_number, "expected a JSON object"))
            continue
        # a line's own reply/deadline would turn it into a query: only these fields count
        fields = {
            name: item.get(name)
            for name in ("id", "text", "meta", "tenant", *OPTION_NAMES, "reembed")
        }
        try:
            yield chunk_from_mapping(fields, limits, job=job)
        except ProtocolError as error:
            rejected.append(BadLine(line_number, str(error)))
