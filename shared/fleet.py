"""The fleet's state, read from Redis once: one reader, two renderings.

``embedfleet status`` (``producer/status.py``: tables and JSON) and the worker's stream gauges
(``workers/metrics.py``: Prometheus) both call ``read_fleet``, so they read the same streams
with the same commands an operator would type (XLEN, XINFO GROUPS, XINFO CONSUMERS, XREVRANGE
on the dead-letter stream, the job hashes) and can never disagree. The gauges ask for the
streams only (one pipelined round trip per scrape); the status view adds consumers, jobs and the
latest dead letters (a second round trip).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from embedfleet.shared.keys import Keys
from embedfleet.shared.streams import (
    ConsumerState,
    GroupState,
    find_group,
    is_missing_key,
    parse_consumers,
    text,
)

INPUT_STREAMS = ("ingest", "query")  # read through the consumer group
FLEET_STREAMS = ("ingest", "query", "results", "dead")


def stream_keys(keys: Keys) -> dict[str, str]:
    """Each stream of FLEET_STREAMS by name, with its key."""
    return {"ingest": keys.ingest, "query": keys.query, "results": keys.results, "dead": keys.dead}


@dataclass(frozen=True)
class StreamState:
    name: str
    key: str
    length: int
    group: GroupState | None = None  # input streams only; None while the group does not exist
    consumers: tuple[ConsumerState, ...] = ()

    @property
    def lag(self) -> int | None:
        """Entries not yet delivered. With no group yet, all of them: it is created at id 0."""
        return self.length if self.group is None else self.group.lag

    @property
    def pending(self) -> int:
        return 0 if self.group is None else self.group.pending

    @property
    def finished(self) -> int | None:
        return 0 if self.group is None else self.group.acknowledged

    @property
    def group_consumers(self) -> int:
        """Consumers registered in the group (XINFO GROUPS), live or not."""
        return 0 if self.group is None else self.group.consumers


@dataclass(frozen=True)
class JobState:
    job: str
    enqueued: int
    done: int
    dead: int

    @property
    def remaining(self) -> int:
        return max(0, self.enqueued - self.done - self.dead)


@dataclass(frozen=True)
class DeadLetter:
    entry_id: str
    reason: str
    chunk_id: str | None
    stream: str | None


@dataclass(frozen=True)
class FleetState:
    taken_at: float  # time.time()
    monotonic: float  # time.monotonic(), for rates that survive a clock change
    streams: dict[str, StreamState]
    jobs: tuple[JobState, ...] = ()
    dead_latest: tuple[DeadLetter, ...] = ()


async def read_fleet(
    client: aioredis.Redis,
    keys: Keys,
    *,
    consumers: bool = False,
    jobs: bool = False,
    dead_latest: int = 0,
) -> FleetState:
    """Every stream's length and group state; with the flags, consumers, jobs, dead letters.

    One pipelined round trip for the streams (and the dead letters and job names); a second
    one, only when asked for, for the consumers and each job's counters. A Redis error raises.
    """
    names = stream_keys(keys)
    pipe = client.pipeline(transaction=False)
    for key in names.values():
        pipe.xlen(key)
    for stream in INPUT_STREAMS:
        pipe.xinfo_groups(names[stream])
    if dead_latest:
        pipe.xrevrange(keys.dead, count=dead_latest)
    if jobs:
        pipe.smembers(keys.jobs_index)
    replies = await pipe.execute(raise_on_error=False)
    lengths = dict(zip(FLEET_STREAMS, _raise_errors(replies[:4]), strict=True))
    group_replies = dict(zip(INPUT_STREAMS, replies[4:6], strict=True))
    extras = _raise_errors(replies[6:])
    dead_entries = extras.pop(0) if dead_latest else []
    job_names = sorted(text(name) for name in extras.pop(0)) if jobs else []

    groups: dict[str, GroupState | None] = {}
    for stream, reply in group_replies.items():
        if isinstance(reply, Exception):
            if not is_missing_key(reply):
                raise reply
            groups[stream] = None
        else:
            groups[stream] = find_group(reply, keys.group)

    with_group = [s for s in INPUT_STREAMS if consumers and groups[s] is not None]
    consumer_replies: list[Any] = []
    job_counters: list[Any] = []
    if with_group or job_names:
        pipe = client.pipeline(transaction=False)
        for stream in with_group:
            pipe.xinfo_consumers(names[stream], keys.group)
        for job in job_names:
            pipe.hgetall(keys.job(job))
        second = _raise_errors(await pipe.execute(raise_on_error=False))
        consumer_replies, job_counters = second[: len(with_group)], second[len(with_group) :]
    consumer_states = {
        stream: tuple(parse_consumers(reply))
        for stream, reply in zip(with_group, consumer_replies, strict=True)
    }
    return FleetState(
        taken_at=time.time(),
        monotonic=time.monotonic(),
        streams={
            name: StreamState(
                name=name,
                key=names[name],
                length=int(lengths[name]),
                group=groups.get(name),
                consumers=consumer_states.get(name, ()),
            )
            for name in FLEET_STREAMS
        },
        jobs=tuple(_job(job, counts) for job, counts in zip(job_names, job_counters, strict=True)),
        dead_latest=tuple(_dead_letter(entry_id, fields) for entry_id, fields in dead_entries),
    )


def _raise_errors(replies: list[Any]) -> list[Any]:
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return list(replies)


def _job(job: str, counters: Mapping[bytes, bytes]) -> JobState:
    values = {text(key): int(value) for key, value in counters.items()}
    return JobState(job, values.get("enqueued", 0), values.get("done", 0), values.get("dead", 0))


def _dead_letter(entry_id: bytes, fields: Mapping[bytes, bytes]) -> DeadLetter:
    def field(name: bytes) -> str | None:
        value = fields.get(name)
        return None if value is None else value.decode(errors="replace")

    return DeadLetter(
        entry_id=text(entry_id),
        reason=field(b"reason") or "(no reason field)",
        chunk_id=field(b"id") or None,
        stream=field(b"stream"),
    )
