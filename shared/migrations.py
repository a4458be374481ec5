"""The migration record: what ``embedfleet migrate`` and the database sinks agree on.

A live migration moves a vector table (written by model lane A) to a new table written by model
lane B. Its record is one Redis hash, ``Keys.migration(source table)``; the migration
(producer/migration.py) writes it, and every database sink writing the source table reads two of
its fields after each upsert: while ``dual_write`` is set, the sink enqueues a copy of every
chunk it wrote (id, text, job, meta) to lane B's ingest stream, so a chunk enqueued for the index
during the migration lands in both tables.

Why the sink and not the producer: everything that reaches A's table is copied, whoever sent it
(the Python client, the gateway's Batch API, another language's XADD, a dead-letter replay). Why
after the upsert: the migration sets ``dual_write`` before it reads the first page of A's table,
so a row is either committed before the flag was set (the copy's scan reads it) or written after
(its sink sees the flag and copies it). A copy carries no embedding options (B's own defaults
apply) and counts in lane B's job counters as an enqueue does.
"""

from __future__ import annotations

from collections.abc import Sequence
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


@dataclass(frozen=True)
class DualWrite:
    """Where a sink copies what it writes: the target lane's key set."""

    lane: Keys


async def dual_write_of(client: aioredis.Redis, keys: Keys, table: str) -> DualWrite | None:
    """The dual write a sink of ``table`` must do now, or None (one HMGET)."""
    flag, lane = await client.hmget(keys.migration(table), [DUAL_WRITE, TARGET_LANE])
    if flag != b"1" or lane is None:
        return None
    return DualWrite(keys.for_model(text(lane) or None))


def queue_copies(pipe: Any, dual: DualWrite, results: Sequence[Result]) -> int:
    """XADD a copy of each result's chunk (those with their text) to the target lane's ingest
    stream of its partition, counted in its job there as an enqueue; returns how many."""
    copied = 0
    for result in results:
        if result.text is None:
            continue
        partition = dual.lane.partition_for(result.id)
        chunk = Chunk(id=result.id, text=result.text, job=result.job, meta=result.meta)
        pipe.xadd(partition.ingest, {PAYLOAD_FIELD: encode_chunk(chunk)})
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
