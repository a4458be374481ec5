"""Stream entries → valid chunks, or rejections with a reason code and a detail to read.

The checks are the protocol's one chunk validator, with the limits Settings holds: the same
the producer applied before sending.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from embedfleet.shared.dead_letters import DeadReason
from embedfleet.shared.migrations import COPIED_FROM
from embedfleet.shared.protocol import Chunk, ProtocolError, decode_chunk
from embedfleet.shared.settings import Settings
from embedfleet.sinks import Delivery
from embedfleet.workers.consumer import StreamEntry
from embedfleet.workers.dead_letter_writer import Rejected


@dataclass(frozen=True)
class Accepted:
    chunk: Chunk
    delivery: Delivery


def decode_entries(
    entries: Sequence[StreamEntry], settings: Settings
) -> tuple[list[Accepted], list[Rejected]]:
    accepted: list[Accepted] = []
    rejected: list[Rejected] = []
    limits = settings.chunk_limits
    for entry in entries:
        if entry.payload is None:
            detail = (
                "entry has no 'm' field (expected msgpack in field m); it has: "
                + _field_names(entry)
            )
            rejected.append(Rejected(entry.stream, entry.entry_id, DeadReason.NO_PAYLOAD, detail))
            continue
        try:
            chunk = decode_chunk(entry.payload, limits)
        except ProtocolError as error:
            rejected.append(
                Rejected(
                    entry.stream,
                    entry.entry_id,
                    error.code,
                    str(error),
                    entry.payload,
                    chunk_id=error.chunk_id,
                    job=error.job,
                    reply=error.reply,
                    tenant=error.tenant,
                )
            )
            continue
        accepted.append(
            Accepted(
                chunk,
                Delivery(
                    entry.stream,
                    entry.entry_id,
                    chunk.job,
                    tenant=chunk.tenant,
                    copy=COPIED_FROM in entry.fields,
                ),
            )
        )
    return accepted, rejected


def _field_names(entry: StreamEntry) -> str:
    """Field names of an entry without ``m``, so the dead letter shows what was sent instead."""
    names = [name.decode("utf-8", "replace")[:64] for name in list(entry.fields)[:16]]
    return ", ".join(names) or "(no fields)"
