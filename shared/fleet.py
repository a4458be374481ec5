"""The fleet's state, read from Redis once: one reader, two renderings.

``embedfleet status`` (``embedfleet/ops/status.py``: tables and JSON) and the worker's stream gauges
(``workers/metrics.py``: Prometheus) both call ``read_fleet``, so they read the same streams
with the same commands an operator would type (XLEN, XINFO GROUPS, XINFO CONSUMERS, XREVRANGE
on the dead-letter stream, the job hashes) and can never disagree. The gauges ask for the
streams only (one pipelined round trip per scrape); the status view adds consumers, jobs and the
latest dead letters (a second round trip).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from embedfleet.shared.dead_letters import DeadLetter
from embedfleet.shared.jobs import JobProgress
from embedfleet.shared.keys import USAGE_SEPARATOR, Keys, key_slot
from embedfleet.shared.redis_conn import is_cluster
from embedfleet.shared.streams import (
    ConsumerState,
    GroupState,
    find_group,
    is_missing_key,
    parse_consumers,
    text,
)
from embedfleet.shared.vector_cache import CacheState, cache_key_sets

INPUT_STREAMS = ("ingest", "query", "interactive")  # read through the consumer group
FLEET_STREAMS = ("ingest", "query", "interactive", "results", "dead")


def stream_keys(keys: Keys) -> dict[str, str]:
    """Each stream of FLEET_STREAMS by name, with its key (with partitions, a pattern that
    names them all: ``{ns}:{p*of6.*}:ingest``)."""
    priority = keys.priority_streams  # the priority streams' key set
    if not keys.partitioned:
        return {
            "ingest": keys.ingest,
            "query": priority.query,
            "interactive": priority.interactive,
            "results": keys.results,
            "dead": keys.dead,
        }
    # the lane's own prefix (``{ns}`` or ``{ns}:m:<lane>``): the fleet-wide set has no tag
    pattern = f"{keys.for_model(keys.model_lane).prefix}:{{p*of{keys.partitions}.*}}"
    return {
        "ingest": f"{pattern}:ingest",
        "query": priority.query,
        "interactive": priority.interactive,
        "results": f"{pattern}:results",
        "dead": f"{pattern}:dead",
    }


def _partition_streams(
    keys: Keys, tenants: dict[Keys, list[str]] | None = None
) -> dict[str, list[str]]:
    """The keys whose figures make each total, partition by partition (the priority streams'
    dead letters count with the others); ``tenants``: the named tenants of each partition, whose
    ingest streams count with the default tenant's."""
    parts = keys.partitions_keys
    priority_dead = [keys.priority_streams.dead] if keys.partitioned else []
    return {
        "ingest": [s for p in parts for s in _ingest_streams(p, (tenants or {}).get(p, []))],
        "query": [keys.priority_streams.query],
        "interactive": [keys.priority_streams.interactive],
        "results": [p.results for p in parts],
        "dead": [p.dead for p in parts] + priority_dead,
    }


def _ingest_streams(partition: Keys, tenants: list[str]) -> list[str]:
    """A partition's ingest streams: the default tenant's, then each named tenant's."""
    return [partition.ingest, *(partition.ingest_for(t) for t in tenants)]


@dataclass(frozen=True)
class Usage:
    """What one (tenant, model, job) used, from the usage hashes (Keys.usage), summed over
    the partitions and the priority streams. ``tenant`` None: the default tenant; ``job`` None: no
    job."""

    tenant: str | None
    model: str
    job: str | None
    chunks: int = 0
    tokens: int = 0
    model_us: int = 0
    dead: int = 0
    expired: int = 0

    @property
    def model_seconds(self) -> float:
        return self.model_us / 1e6


USAGE_COUNTERS = ("chunks", "tokens", "model_us", "dead", "expired")


def parse_usage(hashes: list[dict[Any, Any]]) -> tuple[Usage, ...]:
    """The usage hashes' fields ``<counter>|<tenant>|<model>|<job>``, summed per (tenant,
    model, job); a field that does not parse is left out."""
    totals: dict[tuple[str, str, str], dict[str, int]] = {}
    for fields in hashes:
        for name, value in (fields or {}).items():
            parts = text(name).split(USAGE_SEPARATOR, 3)
            if len(parts) != 4 or parts[0] not in USAGE_COUNTERS:
                continue
            counter, tenant, model, job = parts
            row = totals.setdefault((tenant, model, job), {})
            row[counter] = row.get(counter, 0) + int(value)
    return tuple(
        Usage(tenant or None, model, job or None, **counts)
        for (tenant, model, job), counts in sorted(totals.items())
    )


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
class PartitionState:
    """One partition: its ingest stream's state, its other streams' lengths, where it lives."""

    index: int
    slot: int
    node: str | None  # host:port of the master holding the slot (a cluster), else None
    ingest: StreamState
    results_length: int
    dead_length: int


@dataclass(frozen=True)
class FleetState:
    taken_at: float  # time.time()
    monotonic: float  # time.monotonic(), for rates that survive a clock change
    streams: dict[str, StreamState]  # totals over the partitions
    jobs: tuple[JobProgress, ...] = ()
    # each tenant's ingest streams summed over the partitions (None: the default tenant's)
    tenants: dict[str | None, StreamState] = field(default_factory=dict)
    usage: tuple[Usage, ...] = ()
    dead_latest: tuple[DeadLetter, ...] = ()
    partitions: tuple[PartitionState, ...] = ()
    # the vector cache's counters and size, summed over its key sets (with ``jobs``)
    cache: CacheState | None = None


async def read_fleet(
    client: aioredis.Redis,
    keys: Keys,
    *,
    consumers: bool = False,
    jobs: bool = False,
    dead_latest: int = 0,
    usage: bool = False,
) -> FleetState:
    """Every stream's length and group state; with the flags, consumers, jobs, dead letters.

    One pipelined round trip for the streams (and the dead letters and job names); a second
    one, only when asked for, for the consumers and each job's counters. A Redis error raises.
    With partitions, ``streams`` holds the totals and ``partitions`` one row each; on a cluster
    the pipelines go to every node at once. Every tenant's ingest streams count in the ingest
    totals (the tenants registries are read first, in a round trip of their own); ``tenants``
    holds each tenant's, and with ``usage`` the accounting hashes are read too.
    """
    registered = await _read_tenants(client, keys)
    per_stream = _partition_streams(keys, registered)
    usage_keys = _usage_keys(keys) if usage else []
    first = await _read_streams(client, keys, per_stream, dead_latest, jobs, usage_keys)
    consumer_keys = [
        key
        for s in INPUT_STREAMS
        for key in per_stream[s]
        if consumers and first.groups[key] is not None
    ]
    consumer_states, job_counters = await _read_consumers_and_jobs(
        client, keys, consumer_keys, first.job_names
    )
    states = _stream_states(per_stream, first, consumer_states)
    names = stream_keys(keys)
    return FleetState(
        taken_at=time.time(),
        monotonic=time.monotonic(),
        streams={
            name: _total(name, names[name], [states[key] for key in per_stream[name]])
            for name in FLEET_STREAMS
        },
        jobs=_job_totals(first.job_names, job_counters, len(keys.partitions_keys)),
        dead_latest=tuple(
            DeadLetter.from_fields(dead_id, fields) for dead_id, fields in first.dead_entries
        ),
        tenants=_tenant_totals(registered, states),
        usage=first.usage,
        partitions=_partition_states(client, keys, registered, states, first.lengths),
        cache=first.cache,
    )


def _stream_states(
    per_stream: dict[str, list[str]],
    first: _StreamsRead,
    consumer_states: dict[str, tuple[ConsumerState, ...]],
) -> dict[str, StreamState]:
    """Each stream key's state (every partition's and tenant's), from the round trips' replies."""
    return {
        key: StreamState(
            name=name,
            key=key,
            length=first.lengths[key],
            group=first.groups.get(key),
            consumers=consumer_states.get(key, ()),
        )
        for name in FLEET_STREAMS
        for key in per_stream[name]
    }


def _job_totals(
    job_names: list[str], job_counters: list[Any], partitions: int
) -> tuple[JobProgress, ...]:
    """Each job's progress, summed over its ``partitions`` counters (read job by job)."""
    return tuple(
        JobProgress.summed(job, job_counters[i * partitions : (i + 1) * partitions])
        for i, job in enumerate(job_names)
    )


async def _read_tenants(client: aioredis.Redis, keys: Keys) -> dict[Keys, list[str]]:
    """The first round trip: each partition's registered tenants (its tenants set), by name."""
    pipe = client.pipeline(transaction=False)
    for partition in keys.partitions_keys:
        pipe.smembers(partition.tenants)
    return {
        partition: sorted(text(name) for name in members)
        for partition, members in zip(keys.partitions_keys, await pipe.execute(), strict=True)
    }


def _usage_keys(keys: Keys) -> list[str]:
    """The usage hashes to sum: each partition's, and the priority streams' with partitions."""
    return [p.usage for p in keys.partitions_keys] + (
        [keys.priority_streams.usage] if keys.partitioned else []
    )


@dataclass(frozen=True)
class _StreamsRead:
    """What the streams' round trip read: lengths and groups by key, and what the flags asked."""

    lengths: dict[str, int]
    groups: dict[str, GroupState | None]  # input streams only; None: no group yet
    dead_entries: list[Any]  # (id, fields), newest first, at most ``dead_latest``
    job_names: list[str]
    cache: CacheState | None
    usage: tuple[Usage, ...]


async def _read_streams(
    client: aioredis.Redis,
    keys: Keys,
    per_stream: dict[str, list[str]],
    dead_latest: int,
    jobs: bool,
    usage_keys: list[str],
) -> _StreamsRead:
    """The second round trip, pipelined: every stream's length and group, the latest dead
    letters, the job names and the vector cache's counters, the usage hashes. A reply that is
    an error raises, but a missing stream's XINFO GROUPS (no group yet)."""
    pipe = client.pipeline(transaction=False)
    for stream in FLEET_STREAMS:
        for key in per_stream[stream]:
            pipe.xlen(key)
    for stream in INPUT_STREAMS:
        for key in per_stream[stream]:
            pipe.xinfo_groups(key)
    if dead_latest:
        for key in per_stream["dead"]:
            pipe.xrevrange(key, count=dead_latest)
    if jobs:
        for partition in keys.partitions_keys:
            pipe.smembers(partition.jobs_index)
        for owner in cache_key_sets(keys):
            pipe.hgetall(owner.vector_cache_stats)
    for key in usage_keys:
        pipe.hgetall(key)
    replies = iter(await pipe.execute(raise_on_error=False))
    # the replies, read in the order the commands were queued
    lengths = {key: int(_raised(next(replies))) for s in FLEET_STREAMS for key in per_stream[s]}
    groups = {
        key: _group_or_none(next(replies), keys.group)
        for s in INPUT_STREAMS
        for key in per_stream[s]
    }
    dead_entries = []
    if dead_latest:
        for _ in per_stream["dead"]:
            dead_entries.extend(_raised(next(replies)))
        # newest first over every dead-letter stream (ids start with the server's milliseconds)
        dead_entries.sort(key=lambda entry: _id_order(entry[0]), reverse=True)
        dead_entries = dead_entries[:dead_latest]
    job_names: list[str] = []
    cache: CacheState | None = None
    if jobs:
        found: set[str] = set()
        for _ in keys.partitions_keys:
            found.update(text(name) for name in _raised(next(replies)))
        job_names = sorted(found)
        cache = CacheState.summed(_raised(next(replies)) for _ in cache_key_sets(keys))
    usage_rows = parse_usage([_raised(next(replies)) for _ in usage_keys])
    return _StreamsRead(lengths, groups, dead_entries, job_names, cache, usage_rows)


def _group_or_none(reply: Any, group: str) -> GroupState | None:
    """Our group's state from an XINFO GROUPS reply; None where the stream does not exist yet."""
    if isinstance(reply, Exception):
        if not is_missing_key(reply):
            raise reply
        return None
    return find_group(reply, group)


async def _read_consumers_and_jobs(
    client: aioredis.Redis, keys: Keys, consumer_keys: list[str], job_names: list[str]
) -> tuple[dict[str, tuple[ConsumerState, ...]], list[Any]]:
    """The third round trip, only when asked for: the consumers of ``consumer_keys``' groups,
    and each job's counters in every partition (job by job, partition by partition)."""
    consumer_replies: list[Any] = []
    job_counters: list[Any] = []
    if consumer_keys or job_names:
        pipe = client.pipeline(transaction=False)
        for key in consumer_keys:
            pipe.xinfo_consumers(key, keys.group)
        for job in job_names:
            for partition in keys.partitions_keys:
                pipe.hgetall(partition.job(job))
        second = _raise_errors(await pipe.execute(raise_on_error=False))
        consumer_replies = second[: len(consumer_keys)]
        job_counters = second[len(consumer_keys) :]
    consumer_states = {
        key: tuple(parse_consumers(reply))
        for key, reply in zip(consumer_keys, consumer_replies, strict=True)
    }
    return consumer_states, job_counters


def _tenant_totals(
    registered: dict[Keys, list[str]], states: dict[str, StreamState]
) -> dict[str | None, StreamState]:
    """Each tenant's ingest streams summed over the partitions (None: the default tenant)."""
    by_tenant: dict[str | None, list[StreamState]] = {}
    for partition, tenants in registered.items():
        for tenant, stream in zip(
            [None, *tenants], _ingest_streams(partition, tenants), strict=True
        ):
            by_tenant.setdefault(tenant, []).append(states[stream])
    return {tenant: _total("ingest", parts[0].key, parts) for tenant, parts in by_tenant.items()}


def _partition_states(
    client: aioredis.Redis,
    keys: Keys,
    registered: dict[Keys, list[str]],
    states: dict[str, StreamState],
    lengths: dict[str, int],
) -> tuple[PartitionState, ...]:
    """One row per partition: its tenants' ingest streams summed, its slot and node, the
    lengths of its results and dead-letter streams."""
    return tuple(
        PartitionState(
            index=partition.index,
            slot=key_slot(partition.ingest),
            node=_node_of(client, partition.ingest),
            ingest=_total(
                "ingest",
                partition.ingest,
                [states[s] for s in _ingest_streams(partition, registered[partition])],
            ),
            results_length=lengths[partition.results],
            dead_length=lengths[partition.dead],
        )
        for partition in keys.partitions_keys
    )


def _total(name: str, key: str, parts: list[StreamState]) -> StreamState:
    """One stream's figures summed over its partitions (itself, with one partition)."""
    if len(parts) == 1:
        return parts[0]
    groups = [p.group for p in parts if p.group is not None]
    group = None
    if groups:
        entries_read: int | None = 0
        lag: int | None = 0
        for part in parts:
            if part.group is None:  # created at id 0 later: all its entries are still to do
                lag = None if lag is None else lag + part.length
                continue
            read = part.group.entries_read
            if read is None and part.group.last_delivered_id == "0-0":
                read = 0
            entries_read = None if entries_read is None or read is None else entries_read + read
            lag = None if lag is None or part.group.lag is None else lag + part.group.lag
        group = GroupState(
            name=groups[0].name,
            consumers=max(g.consumers for g in groups),
            pending=sum(g.pending for g in groups),
            last_delivered_id="",  # one per partition: see the partition rows
            entries_read=entries_read,
            lag=lag,
        )
    return StreamState(
        name=name,
        key=key,
        length=sum(p.length for p in parts),
        group=group,
        consumers=_merged_consumers([c for p in parts for c in p.consumers]),
    )


def _merged_consumers(consumers: list[ConsumerState]) -> tuple[ConsumerState, ...]:
    """A worker is one consumer in every partition's group: one row per name, pending summed,
    idle the shortest."""
    merged: dict[str, ConsumerState] = {}
    for c in consumers:
        seen = merged.get(c.name)
        if seen is None:
            merged[c.name] = c
            continue
        inactive = [v for v in (seen.inactive_ms, c.inactive_ms) if v is not None]
        merged[c.name] = ConsumerState(
            name=c.name,
            pending=seen.pending + c.pending,
            idle_ms=min(seen.idle_ms, c.idle_ms),
            inactive_ms=min(inactive) if inactive else None,
        )
    return tuple(sorted(merged.values(), key=lambda c: c.name))


def _node_of(client: aioredis.Redis, key: str) -> str | None:
    """The master serving ``key`` as the cluster client's slot map has it (None off a cluster)."""
    if not is_cluster(client):
        return None
    node = client.get_node_from_key(key)  # type: ignore[attr-defined]
    return None if node is None else str(node.name)


def _id_order(entry_id: bytes | str) -> tuple[int, int]:
    milliseconds, _, sequence = text(entry_id).partition("-")
    return int(milliseconds), int(sequence or 0)


def _raised(reply: Any) -> Any:
    if isinstance(reply, Exception):
        raise reply
    return reply


def _raise_errors(replies: list[Any]) -> list[Any]:
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return list(replies)
