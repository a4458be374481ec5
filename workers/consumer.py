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

Before any ingest stream comes the interactive stream (``Keys.interactive``: the inputs of large
requests someone waits on, the gateway's): its entries are read first, in the same round trip
as the backlogs' lengths, and the bulk streams only when it is empty, so a large request waits
for the windows a worker already holds, never for the backlog. Idle, the worker blocks on it
too. (The query stream has its own reader, the query lane, which goes ahead of both.)
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from redis.typing import KeyT, StreamIdT

from embedfleet.shared.keys import Keys
from embedfleet.shared.protocol import PAYLOAD_FIELD
from embedfleet.shared.redis_conn import as_str, ensure_groups

# A blocked XREADGROUP is woken with this error when its key leaves the node (Redis >= 7).
STREAM_MOVED_AWAY = "UNBLOCKED"


@dataclass(frozen=True)
class StreamEntry:
    """One entry read from a stream; ``payload`` is None when the entry has no ``m`` field."""

    stream: str
    entry_id: str
    payload: bytes | None
    fields: dict[bytes, bytes]


class StreamConsumer:
    """One consumer in the group. Reads the query stream first, then the ingest stream in bulk.

    ``partitions``: the partitions whose ingest streams ``read_ingest`` reads (default all).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        consumer: str,
        partitions: Sequence[int] | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.consumer = consumer
        chosen = range(keys.partitions) if partitions is None else partitions
        self.ingest_streams = [keys.partition(index).ingest for index in chosen]
        self.interactive_stream = keys.query_lane.interactive
        # Blocking reads still waiting on a partition (stream -> task), from an idle wait.
        self._waiting: dict[str, asyncio.Task[list[StreamEntry]]] = {}

    async def setup(self) -> None:
        await ensure_groups(self.client, self.keys)

    async def read(
        self, count: int, block_ms: int, *, include_ingest: bool = True
    ) -> list[StreamEntry]:
        """Whatever is waiting: queries without blocking, then bulk; block only when both are empty.

        The blocking read names both streams, so a query arriving while the worker is idle
        wakes it at once: no polling loop, no sleep.
        """
        queries = await self._read({self.keys.query_lane.query: ">"}, count, block_ms=None)
        if queries:
            return queries
        if not include_ingest:
            return await self._read({self.keys.query_lane.query: ">"}, count, block_ms=block_ms)
        bulk = await self._read({self.keys.ingest: ">"}, count, block_ms=None)
        if bulk:
            return bulk
        return await self._read(
            {self.keys.query_lane.query: ">", self.keys.ingest: ">"}, count, block_ms
        )

    async def read_stream(self, stream: str, count: int, block_ms: int | None) -> list[StreamEntry]:
        """New entries of one stream; blocks up to ``block_ms`` when there are none."""
        return await self._read({stream: ">"}, count, block_ms)

    async def read_ingest(self, count: int, block_ms: int) -> list[StreamEntry]:
        """Up to about ``count`` new entries: the interactive stream's if it has any, else bulk
        entries from the partitions this consumer reads; blocks up to ``block_ms`` when all of
        them are empty."""
        entries = self._collect_waiting()
        if entries:
            return entries
        entries = await self._read_backlogs(count)
        if entries:
            return entries
        for stream in (self.interactive_stream, *self.ingest_streams):
            if stream not in self._waiting:
                self._waiting[stream] = asyncio.create_task(
                    self.read_stream(stream, count, block_ms)
                )
        # The reads end by themselves after block_ms; the margin covers the round trip.
        await asyncio.wait(
            self._waiting.values(), timeout=block_ms / 1000 + 5, return_when="FIRST_COMPLETED"
        )
        return self._collect_waiting()

    async def _read_backlogs(self, count: int) -> list[StreamEntry]:
        """The interactive stream's new entries, read in the round trip that measures the
        backlogs; when there are none, each backlog's share of ``count``."""
        lengths_pipe = self.client.pipeline(transaction=False)
        lengths_pipe.xreadgroup(
            self.keys.group, self.consumer, {self.interactive_stream: ">"}, count=count
        )
        for stream in self.ingest_streams:
            lengths_pipe.xlen(stream)
        interactive, *lengths = await lengths_pipe.execute()
        entries = self._entries(interactive)
        if entries:
            return entries
        shares = backlog_shares(
            count, dict(zip(self.ingest_streams, (int(n) for n in lengths), strict=True))
        )
        if not shares:
            return []
        pipe = self.client.pipeline(transaction=False)
        for stream, share in shares.items():
            pipe.xreadgroup(self.keys.group, self.consumer, {stream: ">"}, count=share)
        for response in await pipe.execute():
            entries.extend(self._entries(response))
        return entries

    def _collect_waiting(self) -> list[StreamEntry]:
        """Entries of the blocking reads that have returned; a failed read raises only when no
        other read brought anything (then the caller backs off and reads again)."""
        entries: list[StreamEntry] = []
        failure: BaseException | None = None
        for stream, task in list(self._waiting.items()):
            if not task.done():
                continue
            del self._waiting[stream]
            if task.cancelled():
                continue
            if (error := task.exception()) is not None:
                failure = error
                continue
            entries.extend(task.result())
        if failure is not None and not entries:
            raise failure
        return entries

    async def finish_waiting(self) -> list[StreamEntry]:
        """On drain: let the blocking reads still waiting end (within one block interval) and
        return what they delivered, so it is worked on rather than left pending."""
        if self._waiting:
            await asyncio.wait(self._waiting.values())
        with contextlib.suppress(Exception):
            return self._collect_waiting()
        return []

    def abandon_waiting(self) -> None:
        """On abort: entries a cancelled read had delivered stay pending and are reclaimed."""
        for task in self._waiting.values():
            task.cancel()
        self._waiting.clear()

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
            streams or [], key=lambda item: as_str(item[0]) != self.keys.query_lane.query
        ):
            stream = as_str(stream_name)
            for entry_id, fields in stream_entries:
                fields = fields or {}
                entries.append(
                    StreamEntry(
                        stream=stream,
                        entry_id=as_str(entry_id),
                        payload=fields.get(PAYLOAD_FIELD),
                        fields=fields,
                    )
                )
        return entries


def backlog_shares(count: int, lengths: dict[str, int]) -> dict[str, int]:
    """How many entries to ask each stream for: ``count`` split in proportion to the backlogs
    (at least one each, so a small partition is never starved by a big one)."""
    total = sum(lengths.values())
    return {
        stream: max(1, math.ceil(count * length / total))
        for stream, length in lengths.items()
        if length > 0
    }
