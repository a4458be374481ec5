"""Reading chunks from JSON Lines: one {"id", "text", "meta"?} object per line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

from embedfleet.shared.protocol import Chunk


@dataclass(frozen=True)
class BadLine:
    line_number: int
    reason: str


def read_chunks(stream: IO[str], job: str | None, rejected: list[BadLine]) -> Iterator[Chunk]:
    """Yield valid chunks; record each bad line (with its number and why) in ``rejected``."""
    for line_number, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            rejected.append(BadLine(line_number, f"not JSON: {error.msg}"))
            continue
        reason = _problem(item)
        if reason:
            rejected.append(BadLine(line_number, reason))
            continue
        yield Chunk(id=item["id"], text=item["text"], job=job, meta=item.get("meta"))


def _problem(item: object) -> str | None:
    if not isinstance(item, dict):
        return "expected a JSON object"
    if not isinstance(item.get("id"), str) or not item["id"]:
        return "'id' must be a non-empty string"
    if not isinstance(item.get("text"), str) or not item["text"].strip():
        return "'text' must be a non-empty string"
    if "meta" in item and item["meta"] is not None and not isinstance(item["meta"], dict):
        return "'meta' must be an object"
    return None
