"""The migration record: what ``embedfleet migrate`` and the database sinks agree on.

A live migration moves a vector table (written by model lane A) to a new table written by model
lane B. Its record is one Redis hash, ``Keys.migration(source table)``; the migration
(embedfleet/ops/migration.py) writes it, and every database sink writing the source table reads
two of its fields after each upsert: while ``dual_write`` is set, the sink enqueues a copy of every
chunk it wrote (id, text, job, meta) to lane B's ingest stream, so a chunk enqueued for the index
during the migration lands in both tables.

Why the sink and not the producer: everything that reaches A's table is copied, whoever sent it
(the Python client, the gateway's Batch API, another language's XADD, a dead-letter replay). Why
after the upsert: the migration sets ``dual_write`` before it reads the first page of A's table,
so a row is either committed before the flag was set (the copy's scan reads it) or written after
(its sink sees the flag and copies it). A copy carries no embedding options (B's own defaults
apply) and counts in lane B's job counters as an enqueue does.

Both ways once the copy is verified (or the readers switched): from then on a producer may write
either lane (they move to lane B after the switch, and may move back after a rollback), so the
sinks of the target table copy what they write to lane A too (``dual_write_back``), until
``finish``; a rollback then finds every chunk written since the switch in the old table. A copy
is marked in its stream entry (``COPIED_FROM``, the table it was copied from) and is never
copied again, so the two directions do not send a chunk back and forth. The sink of the target
table finds its migration through ``Keys.migration_targets`` (target -> source).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from embedfleet.shared.keys import Keys
from embedfleet.shared.protocol import PAYLOAD_FIELD, Chunk, Result, encode_chunk

# the record's fields (a hash of strings)
SOURCE = "source"  # the table migrated from
SOURCE_LANE = "source_lane"  # its model lane ('' for the default lane)
TARGET = "target"  # the new table
TARGET_LANE = "target_lane"  # the model lane whose workers write it
ALIAS = "alias"  # the reader name readers follow
READERS = "readers"  # which table the alias points at: 'source' or 'target'
STATE = "state"  # copying, copied, finished
DUAL_WRITE = "dual_write"  # '1' while sinks of the source table copy what they write
# '1' (with dual_write) while sinks of the target table copy what they write to the source lane
DUAL_WRITE_BACK = "dual_write_back"
CURSOR = "cursor"  # the source scan's cursor after the last page enqueued ('' = from the start)
SCANNED = "scanned"  # rows of the source enqueued for lane B so far
SCAN_DONE = "scan_done"  # '1' once the scan reached the end of the source
TOTAL = "total"  # rows in the source when the copy last started
STARTED_MS = "started_ms"  # when the migration was started (unix ms)
COPIED_MS = "copied_ms"  # when the copy was verified complete
RESENT = "resent"  # rows sent again by the verification (missing or different in the target)
ROWS_PER_S = "rows_per_s"  # the target's measured fill rate, last run
TOKENS_PER_ROW = "tokens_per_row"  # measured on the texts scanned (model B's tokenizer or chars/4)
TOKENS_MEASURED = "tokens_measured"  # 'tokenizer' or 'characters'

STATES = ("copying", "copied", "finished")

# the stream entry field that marks a dual write's copy (beside the payload, ``m``): the table
# it was copied from. A worker's sink never copies a copy again.
COPIED_FROM = b"copied_from"


@dataclass(frozen=True)
class DualWrite:
    """Where a sink copies what it writes: the other lane's key set, and the sink's table (the
    copies' mark)."""

    lane: Keys
    table: str


async def dual_writes_of(client: aioredis.Redis, keys: Keys, table: str) -> list[DualWrite]:
    """The dual writes a sink of ``table`` must do now: to the target lane when ``table`` is
    being migrated, to the source lane when it is a migration's target and the copy goes both
    ways. One round trip, two while ``table`` is a migration's target."""
    pipe = client.pipeline(transaction=False)
    pipe.hmget(keys.migration(table), [DUAL_WRITE, TARGET_LANE])
    pipe.hget(keys.migration_targets, table)
    (flag, lane), source = await pipe.execute()
    found = []
    if flag == b"1" and lane is not None:
        found.append(DualWrite(keys.for_model(text(lane) or None), table))
    if source is not None:
        fields = [DUAL_WRITE, DUAL_WRITE_BACK, TARGET, SOURCE_LANE]
        flag, back, target, source_lane = await client.hmget(keys.migration(text(source)), fields)
        if (
            flag == b"1"
            and back == b"1"
            and target is not None
            and text(target) == table
            and source_lane is not None
        ):
            found.append(DualWrite(keys.for_model(text(source_lane) or None), table))
    return found


def queue_copies(
    pipe: Any, dual: DualWrite, results: Sequence[Result], copies: Collection[str] = ()
) -> int:
    """XADD a copy of each result's chunk (those with their text, and not themselves a copy:
    ``copies`` holds their ids) to the other lane's ingest stream of its partition, marked as a
    copy and counted in its job there as an enqueue; returns how many."""
    copied = 0
    for result in results:
        if result.text is None or result.id in copies:
            continue
        partition = dual.lane.partition_for(result.id)
        chunk = Chunk(id=result.id, text=result.text, job=result.job, meta=result.meta)
        pipe.xadd(partition.ingest, {PAYLOAD_FIELD: encode_chunk(chunk), COPIED_FROM: dual.table})
        if result.job is not None:
            pipe.hincrby(partition.job(result.job), "enqueued", 1)
            pipe.sadd(partition.jobs_index, result.job)
        copied += 1
    return copied


def lane_name(lane: str | None) -> str:
    """A lane as the record stores it ('' for the default lane)."""
    return lane or ""


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def decoded(fields: dict[Any, Any]) -> dict[str, str]:
    """HGETALL's answer as text."""
    return {text(key): text(value) for key, value in fields.items()}


def as_mapping(fields: dict[str, str]) -> dict[Any, Any]:
    """Record fields as HSET's mapping (redis-py types its keys and values as a union)."""
    return dict(fields)
