"""Reading from the streams through the consumer group, queries first.

With partitions, a worker reads the ingest stream of every partition it serves. One XREADGROUP
cannot name keys of different slots on a cluster, so each round sends one read per partition,
pipelined (redis-py's cluster pipeline sends each node its share in one round trip, the nodes in
parallel). Each partition is asked for a share of the window in proportion to its backlog
(XLEN, read in the round trip before), so under load the partitions drain together and none is
starved. When every partition is empty the worker blocks on all of them at once, one blocking
read per partition on its own connection, and goes on as soon as the first returns: new work in
any partition is picked up within one block interval. The reads still waiting are kept and
collected by the next call, so an entry they deliver is never left behind.

Tenants (issue 30): each partition holds one ingest stream per tenant, the default tenant's plain
``ingest`` and a named tenant's ``ingest:t:<tenant>``, listed in the partition's registry
(``Keys.tenants``), which the same round trip reads. A read's ``count`` is split between the tenants
with a backlog by weighted deficit round robin (workers/fair.py), each tenant's part over its
partitions by its backlog there: every active tenant progresses by its weight whatever the others
hold. A tenant with a token rate (EMBEDFLEET_TENANT_TOKEN_RATE) is asked for no more entries than
its token bucket, one for the whole fleet in Redis, grants this worker in the same round trip
(workers/token_rate.py); while the bucket is spent the tenant is left out: of the reads, and of
the idle wait, which then ends when the bucket has refilled enough for a read. Idle, one blocking
read per partition names all of its streams (they share the slot) but a held tenant's, and takes
one entry per stream: it only wakes the worker, whose read then takes the rest of the window by
weight, so the weights hold from the first window on.

Before any ingest stream comes the interactive stream (``Keys.interactive``: the inputs of large
requests someone waits on, the gateway's): its entries are read first, in the same round trip
as the backlogs' lengths, and the bulk streams only when it is empty, so a large request waits
for the windows a worker already holds, never for the backlog. Idle, the worker blocks on it
too. (The query stream has its own reader, the query stage, which goes ahead of both.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import ResponseError
from redis.typing import KeyT, StreamIdT

from embedfleet.shared import scripts
from embedfleet.shared.keys import TENANT_PATTERN, Keys
from embedfleet.shared.protocol import PAYLOAD_FIELD
from embedfleet.shared.redis_conn import as_str, ensure_group, ensure_groups
from embedfleet.shared.tenants import TenantPolicy
from embedfleet.workers.blocking_reads import BlockingReads
from embedfleet.workers.fair import FairShare, backlog_shares
from embedfleet.workers.token_rate import TenantRates

__all__ = ["STREAM_MOVED_AWAY", "StreamConsumer", "StreamEntry", "backlog_shares"]

# A blocked XREADGROUP is woken with this error when its key leaves the node (Redis >= 7).
STREAM_MOVED_AWAY = "UNBLOCKED"
# a bulk read bounded in bytes (EMBEDFLEET_READ_MAX_BYTES): shared/scripts/read_bounded.lua
READ_BOUNDED_SCRIPT = scripts.load("read_bounded")


@dataclass(frozen=True)
class StreamEntry:
    """One entry read from a stream; ``payload`` is None when the entry has no ``m`` field."""

    stream: str
    entry_id: str
    payload: bytes | None
    fields: dict[bytes, bytes]


class StreamConsumer:
    """One consumer in the group. Reads the query stream first, then the ingest streams in bulk,
    every tenant's by its weight (workers/fair.py).

    ``partitions``: the partitions whose ingest streams ``read_ingest`` reads (default all).
    ``policy``: the tenants' weights and token rates (default: every tenant weighs 1).
    ``max_read_bytes``: the most payload bytes a bulk read takes (EMBEDFLEET_READ_MAX_BYTES),
    split over its streams by their shares; None: entries are counted only.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        consumer: str,
        partitions: Sequence[int] | None = None,
        policy: TenantPolicy | None = None,
        max_read_bytes: int | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.consumer = consumer
        self.policy = policy or TenantPolicy()
        self.max_read_bytes = max_read_bytes
        chosen = range(keys.partitions) if partitions is None else partitions
        self.partitions = [keys.partition(index) for index in chosen]
        self.interactive_stream = keys.priority_streams.interactive
        # each partition's streams, the default tenant's first, then the named tenants' as the
        # registry (Keys.tenants) last said
        self._streams: dict[Keys, list[str]] = {p: [p.ingest] for p in self.partitions}
        self.fair = FairShare(self.policy.weight)
        # EMBEDFLEET_TENANT_TOKEN_RATE: the rated tenants' buckets, shared by the fleet
        self.rates = TenantRates(self.policy, keys)
        # the idle wait's blocking reads still waiting: the interactive stream's, or a
        # partition's (by its prefix) (workers/blocking_reads.py)
        self._waiting: BlockingReads[StreamEntry] = BlockingReads()

    @property
    def ingest_streams(self) -> list[str]:
        """Every ingest stream this consumer reads now: each partition's, every tenant's."""
        return [stream for streams in self._streams.values() for stream in streams]

    def streams(self) -> list[str]:
        """What the reclaimer scans: the ingest streams as known now, the interactive and the
        query stream (a tenant registered later is scanned from the round after)."""
        return [*self.ingest_streams, self.interactive_stream, self.keys.priority_streams.query]

    def tenant_of(self, stream: str) -> str:
        """The tenant a stream's entries belong to (the plain ingest stream: the default)."""
        return self.policy.named(self.keys.tenant_of(stream))

    async def setup(self) -> None:
        await ensure_groups(self.client, self.keys)
        pipe = self.client.pipeline(transaction=False)
        for partition in self.partitions:
            pipe.smembers(partition.tenants)
        learn_tenants(self._streams, await pipe.execute())
        # a registered tenant's group is made by its producer; made here too, should it be gone
        for stream in self.ingest_streams:
            await ensure_group(self.client, self.keys, stream)

    def charge(self, tenant: str, tokens: int) -> None:
        """Tokens of an entry read for ``tenant``: settled with its token bucket in the next
        round (workers/token_rate.py; a tenant without a rate: nothing)."""
        self.rates.charge(tenant, tokens)

    async def read(
        self, count: int, block_ms: int, *, include_ingest: bool = True
    ) -> list[StreamEntry]:
        """Whatever is waiting: queries without blocking, then bulk; block only when both are empty.

        The blocking read names both streams, so a query arriving while the worker is idle
        wakes it at once: no polling loop, no sleep.
        """
        queries = await self._read({self.keys.priority_streams.query: ">"}, count, block_ms=None)
        if queries:
            return queries
        if not include_ingest:
            return await self._read(
                {self.keys.priority_streams.query: ">"}, count, block_ms=block_ms
            )
        bulk = await self._read({self.keys.ingest: ">"}, count, block_ms=None)
        if bulk:
            return bulk
        return await self._read(
            {self.keys.priority_streams.query: ">", self.keys.ingest: ">"}, count, block_ms
        )

    async def read_stream(self, stream: str, count: int, block_ms: int | None) -> list[StreamEntry]:
        """New entries of one stream; blocks up to ``block_ms`` when there are none."""
        return await self._read({stream: ">"}, count, block_ms)

    async def read_interactive(self, count: int) -> list[StreamEntry]:
        """The interactive stream's new entries, without blocking: those the idle wait's
        blocking read was handed if it has returned, else one non-blocking read.

        After an idle wait that bulk entries ended, that read stays blocked on the interactive
        stream for up to a block interval, and Redis hands it the next entries there: read any
        other way they would wait for the reader's next read, a window later."""
        if self._waiting.blocked(self.interactive_stream):
            return []  # still blocked: nothing came (Redis would have handed it over)
        entries = self._waiting.collect(only=self.interactive_stream)
        return entries or await self.read_stream(self.interactive_stream, count, None)

    async def read_ingest(self, count: int, block_ms: int) -> list[StreamEntry]:
        """Up to about ``count`` new entries: the interactive stream's if it has any, else bulk
        entries from the partitions this consumer reads, each tenant's by its weight; blocks up
        to ``block_ms`` when all of them are empty."""
        entries = self._waiting.collect()
        if entries:
            return await self._with_shares(entries, count)
        entries = await self._read_backlogs(count)
        if entries:
            return entries
        # no longer than a held tenant's bucket takes to refill for a read (workers/token_rate.py)
        block_ms, timeout = self.rates.idle_wait(block_ms)
        self._waiting.start(
            self.interactive_stream,
            functools.partial(self.read_stream, self.interactive_stream, count, block_ms),
        )
        for partition, streams in self._streams.items():
            # One blocking read names all of a partition's streams (they share its slot) but a
            # held tenant's, whose entries would be read past its rate. It takes one entry per
            # stream (XREADGROUP's COUNT is per stream): it wakes the worker, and the read that
            # follows takes the rest by weight (_with_shares), so the first window holds the
            # weights too, rather than a whole read of every tenant that woke it.
            wake = [s for s in streams if self.tenant_of(s) not in self.rates.holding]
            if wake:
                read = functools.partial(self._read, dict.fromkeys(wake, ">"), 1, block_ms)
                self._waiting.start(partition.prefix, read)
        await self._waiting.first(timeout)
        entries = self._waiting.collect()
        return await self._with_shares(entries, count) if entries else entries

    async def _with_shares(self, woken: list[StreamEntry], count: int) -> list[StreamEntry]:
        """What the blocking reads brought (one entry per stream, or the interactive stream's),
        and with bulk ones the rest of the read, each tenant by its weight: one window."""
        if any(entry.stream == self.interactive_stream for entry in woken):
            return woken  # the interactive window goes first, alone
        return woken + await self._read_backlogs(max(count - len(woken), 0))

    async def _read_backlogs(self, count: int) -> list[StreamEntry]:
        """The interactive stream's new entries, read in the round trip that measures the
        backlogs (and reads the tenant registries and takes from the rated tenants' token
        buckets); when there are none, each tenant's share of ``count`` (workers/fair.py), split
        over its partitions."""
        streams = self.ingest_streams
        pipe = self.client.pipeline(transaction=False)
        pipe.xreadgroup(self.keys.group, self.consumer, {self.interactive_stream: ">"}, count=count)
        for stream in streams:
            pipe.xlen(stream)
        for partition in self.partitions:
            pipe.smembers(partition.tenants)
        self.rates.queue_takes(pipe, count)
        replies = await pipe.execute()
        interactive = replies[0]
        lengths = [int(n) for n in replies[1 : 1 + len(streams)]]
        registries = replies[1 + len(streams) : 1 + len(streams) + len(self.partitions)]
        # each rated tenant's entries this read may take: what its bucket granted
        caps = self.rates.grants(replies[1 + len(streams) + len(self.partitions) :])
        new = learn_tenants(self._streams, registries)
        if new:
            # a tenant that registered since the last round is read from this one, not after
            # one more whole read of the others: its streams' lengths, in one more round trip
            streams = [*streams, *new]
            lengths += await new_stream_lengths(self.client, self.keys, new)
        entries = self._entries(interactive)
        if entries:
            return entries
        by_tenant, backlogs = tenant_backlogs(streams, lengths, self.tenant_of, caps)
        asks = self.fair.plan(count, backlogs, self.rates.holding)
        shares = self.fair.split(asks, by_tenant)
        pipe = self.client.pipeline(transaction=False)
        queue_share_reads(pipe, self.keys.group, self.consumer, shares, self.max_read_bytes)
        self.rates.queue_returns(pipe, asks)  # granted, not asked for: the others' now
        if not len(pipe):
            return []
        received: dict[str, int] = {}
        replies = (await pipe.execute())[: len(shares)]
        for stream, response in zip(shares, replies, strict=True):
            if self.max_read_bytes is not None:  # the script's flat entries
                got = self._flat_entries(stream, response)
            else:
                got = self._entries(response)
            for entry in got:
                tenant = self.tenant_of(entry.stream)
                received[tenant] = received.get(tenant, 0) + 1
            entries.extend(got)
        self.fair.settle(asks, received)
        return entries

    async def finish_waiting(self) -> list[StreamEntry]:
        """On drain: what the blocking reads still waiting deliver, once they end."""
        return await self._waiting.finish()

    def abandon_waiting(self) -> None:
        """On abort: the blocking reads cancelled (what they had, the reclaimer hands over)."""
        self._waiting.abandon()

    async def _read(
        self, streams: dict[str, str], count: int, block_ms: int | None
    ) -> list[StreamEntry]:
        try:
            response = await self.client.xreadgroup(
                self.keys.group,
                self.consumer,
                cast("dict[KeyT, StreamIdT]", streams),  # (redis-py's dict is invariant)
                count=count,
                block=block_ms,
            )
        except ResponseError as error:
            if not str(error).startswith(STREAM_MOVED_AWAY):
                raise
            # The stream was migrated to another node (a cluster reshard) while this read
            # blocked on it: nothing was delivered, and the next read follows it there.
            return []
        return self._entries(response)

    def _entries(self, response: object) -> list[StreamEntry]:
        entries: list[StreamEntry] = []
        # Query stream first when a blocking read returns both.
        # XREADGROUP's reply: [(stream, [(id, fields), ...]), ...], or None when nothing came
        streams = cast("list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]", response)
        for stream_name, stream_entries in sorted(
            streams or [], key=lambda item: as_str(item[0]) != self.keys.priority_streams.query
        ):
            stream = as_str(stream_name)
            for entry_id, fields in stream_entries:
                fields = fields or {}
                entries.append(
                    StreamEntry(stream, as_str(entry_id), fields.get(PAYLOAD_FIELD), fields)
                )
        return entries

    def _flat_entries(self, stream: str, flat: Sequence[Any] | None) -> list[StreamEntry]:
        """read_bounded.lua's reply: ``id, payload`` pairs, where an entry with fields beside
        (or without) the payload stands as its ``field, value`` list."""
        entries: list[StreamEntry] = []
        flat = flat or []
        for index in range(0, len(flat), 2):
            value = flat[index + 1]
            fields = pairs(value) if isinstance(value, list) else {PAYLOAD_FIELD: value}
            entries.append(
                StreamEntry(stream, as_str(flat[index]), fields.get(PAYLOAD_FIELD), fields)
            )
        return entries


def pairs(flat: Sequence[bytes]) -> dict[bytes, bytes]:
    """A stream entry's fields as a script returns them (``field, value, ...``) → a dict, as
    redis-py gives XREADGROUP's."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def learn_tenants(streams: dict[Keys, list[str]], members: Sequence[object]) -> list[str]:
    """Take the tenant registries' members (one reply per partition of ``streams``, in its
    order) into each partition's streams; returns the new streams."""
    new: list[str] = []
    for partition, names in zip(streams, members, strict=True):
        known = streams[partition]
        for name in sorted(as_str(n) for n in cast("set[bytes]", names or set())):
            if not TENANT_PATTERN.fullmatch(name):
                continue  # nothing the producer registers; never a key to read
            stream = partition.ingest_for(name)  # a registered name: its own stream
            if stream not in known:
                known.append(stream)
                new.append(stream)
    return new


async def new_stream_lengths(client: aioredis.Redis, keys: Keys, new: Sequence[str]) -> list[int]:
    """Newly registered tenants' streams: their consumer group made should it be gone, and
    their lengths, in one round trip."""
    for stream in new:
        await ensure_group(client, keys, stream)
    pipe = client.pipeline(transaction=False)
    for stream in new:
        pipe.xlen(stream)
    return [int(n) for n in await pipe.execute()]


def tenant_backlogs(
    streams: Sequence[str],
    lengths: Sequence[int],
    tenant_of: Callable[[str], str],
    caps: dict[str, int],
) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """Each tenant's streams with their lengths, and its backlog: their sum, a rated tenant's
    no more than its cap (``caps``: what its token bucket granted)."""
    by_tenant: dict[str, dict[str, int]] = {}
    for stream, length in zip(streams, lengths, strict=True):
        by_tenant.setdefault(tenant_of(stream), {})[stream] = length
    # a rated tenant's backlog as far as its cap goes: asked no more, what its weight would
    # have given beyond goes to the others
    backlogs = {tenant: sum(parts.values()) for tenant, parts in by_tenant.items()}
    backlogs.update({t: min(backlogs[t], cap) for t, cap in caps.items() if t in backlogs})
    return by_tenant, backlogs


def queue_share_reads(
    pipe: Pipeline, group: str, consumer: str, shares: dict[str, int], max_bytes: int | None
) -> None:
    """Queue each stream's read of its share of a bulk read: XREADGROUP, or where the read is
    bounded in bytes (``max_bytes``) ``queue_bounded_read``."""
    total_share = sum(shares.values())
    for stream, share in shares.items():
        if max_bytes is None:
            pipe.xreadgroup(group, consumer, {stream: ">"}, count=share)
            continue
        # each stream's part of the bytes, as of the entries: the read stays within the
        # bound (and a stream's first entry, whatever its size, so every stream progresses)
        budget = max(1, max_bytes * share // total_share)
        queue_bounded_read(pipe, group, consumer, stream, share, budget)


def queue_bounded_read(
    pipe: Pipeline, group: str, consumer: str, stream: str, count: int, max_bytes: int
) -> None:
    """Queue a read of ``stream``'s new entries that delivers at most ``count`` of them and
    only those within ``max_bytes`` of payload (the first whatever its size):
    shared/scripts/read_bounded.lua, whose reply ``pairs`` makes XREADGROUP's."""
    pipe.eval(READ_BOUNDED_SCRIPT, 1, stream, group, consumer, count, max_bytes, PAYLOAD_FIELD)
