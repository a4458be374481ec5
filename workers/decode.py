"""Stream entries → valid chunks, or rejections with a reason a person can read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from embedfleet.shared.protocol import Chunk, ProtocolError, decode_chunk
from embedfleet.shared.settings import Settings
from embedfleet.workers.consumer import StreamEntry
from embedfleet.workers.deadletter import Rejected
from embedfleet.workers.sinks import Delivery


@dataclass(frozen=True)
class Accepted:
    chunk: Chunk
    delivery: Delivery


def decode_entries(
    entries: Sequence[StreamEntry], settings: Settings
) -> tuple[list[Accepted], list[Rejected]]:
    accepted: list[Accepted] = []
    rejected: list[Rejected] = []
    for entry in entries:
        if entry.payload is None:
            reason = "entry has no 'm' field (expected msgpack in field m)"
            rejected.append(Rejected(entry.stream, entry.entry_id, reason, _fields_preview(entry)))
            continue
        try:
            chunk = decode_chunk(
                entry.payload,
                max_bytes=settings.max_message_bytes,
                max_text_chars=settings.max_text_chars,
                max_meta_bytes=settings.max_meta_bytes,
            )
        except ProtocolError as error:
            rejected.append(Rejected(entry.stream, entry.entry_id, str(error), entry.payload))
            continue
        accepted.append(Accepted(chunk, Delivery(entry.stream, entry.entry_id, chunk.job)))
    return accepted, rejected


def _fields_preview(entry: StreamEntry) -> bytes:
    """Field names of an entry without ``m``, so the dead letter shows what was sent instead."""
    return b" ".join(name for name in list(entry.fields)[:16])
