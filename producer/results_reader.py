"""A reader that drains the results streams: consume, acknowledge, delete.

The results stream is a hand-off, not a store (DESIGN.md). A consuming reader reads each
partition's results stream through one consumer group (``Keys.results_group``, created at id
``0`` so nothing written before the first reader is skipped), one page at a time:

1. results pending on this reader's own name are read first (``XREADGROUP ... 0``: a reader
   started again under the name of one that was killed, as ``embedfleet results --consume``
   is, takes its page back at once), then results another reader has held unacknowledged for
   ``EMBEDFLEET_RESULTS_CLAIM_IDLE_MS`` (it crashed mid-page) are claimed (``XAUTOCLAIM``),
   then new ones are read (``XREADGROUP ... >``);
2. the caller handles the page (writes it to a file, a database, ...);
3. the page is acknowledged and deleted in one transaction (``XACK`` + ``XDEL``), so the
   stream shrinks as it is read and the workers' bound (``EMBEDFLEET_RESULTS_MAX_ENTRIES``)
   frees up.

Several readers share the work (each result goes to one of them); a reader killed between
reading and acknowledging a page leaves that page pending, and another reader claims it once it
has been idle long enough. Delivery is at least once: a reader killed after handling a page but
before acknowledging it has that page handled again by another reader (sinks that upsert by id
are unaffected; `embedfleet results --consume` records each page's entries before writing it,
so the run after a kill writes that page once: embedfleet/ops/export.py).

A draining reader (``follow`` false) ends when there is nothing new and nothing pending in the
group on any partition: results other readers hold are waited for until those readers
acknowledge them or they can be claimed. ``follow`` keeps reading until ``stop`` is set.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from embedfleet.shared.keys import Keys
from embedfleet.shared.logging import get_logger
from embedfleet.shared.protocol import PAYLOAD_FIELD, Result, decode_result
from embedfleet.shared.retry import RedisRetry

log = get_logger("embedfleet.results")
T = TypeVar("T")
# how long a reader in follow mode blocks on one partition's stream when all are empty
FOLLOW_BLOCK_MS = 200


def default_reader_name() -> str:
    """A consumer name no other reader has: host, process and a random suffix."""
    return f"reader-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def export_reader_name(out: Path) -> str:
    """The consumer name of a consuming export to ``out`` on this host, the same for every run:
    a run after a crash reads first what the killed run held (``XREADGROUP ... 0``), at once,
    rather than waiting EMBEDFLEET_RESULTS_CLAIM_IDLE_MS to claim it. Two exports to one file
    never run at once (embedfleet/ops/export.py locks it), so the name is never shared live."""
    digest = hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:12]
    return f"export-{socket.gethostname()}-{digest}"


@dataclass
class ResultsPage:
    """Results read together from one partition's results stream, to acknowledge together."""

    partition: Keys
    entry_ids: list[bytes]
    results: list[Result] = field(default_factory=list)


class ResultsReader:
    """One consumer of the results streams' group. ``async for result in reader.consume()``."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        retry: RedisRetry,
        *,
        consumer: str | None = None,
        page: int = 1000,
        claim_idle_ms: int = 60_000,
    ) -> None:
        if page < 1:
            raise ValueError("page must be at least 1")
        self.client = client
        self.keys = keys
        self.retry = retry
        self.consumer = consumer or default_reader_name()
        self.page = page
        self.claim_idle_ms = claim_idle_ms
        self._partitions = list(keys.partitions_keys)
        self._next = 0  # the partition to look at first, in turn
        self._ready = False
        # the streams where entries may be pending on this consumer unseen, to read first: all
        # at the start (a reader named as before, as an export is, takes back what its killed
        # run held), and all again after a read whose reply was lost
        self._own_pending_unseen = {p.results for p in self._partitions}

    async def _call(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        tries = 0

        async def attempt() -> T:
            nonlocal tries
            tries += 1
            return await call()

        result = await self.retry.call(what, attempt)
        if tries > 1:
            self._own_pending_unseen = {p.results for p in self._partitions}
        return result

    async def setup(self) -> None:
        """The group on every partition's results stream, at id 0 (MKSTREAM: before any result)."""
        if self._ready:
            return
        for partition in self._partitions:

            async def create(partition: Keys = partition) -> None:
                try:
                    await self.client.xgroup_create(
                        partition.results, self.keys.results_group, id="0", mkstream=True
                    )
                except ResponseError as error:
                    if "BUSYGROUP" not in str(error):
                        raise

            await self._call("create the results readers' group", create)
        self._ready = True

    async def next_page(
        self, *, follow: bool = False, stop: asyncio.Event | None = None
    ) -> ResultsPage | None:
        """The next page of results, or None once drained (or, with ``follow``, once ``stop``
        is set). Acknowledge each page (:meth:`acknowledge`) before asking for the next."""
        await self.setup()
        while stop is None or not stop.is_set():
            for _ in range(len(self._partitions)):
                partition = self._partitions[self._next]
                self._next = (self._next + 1) % len(self._partitions)
                page = await self._read(partition)
                if page is not None:
                    return page
            if follow:
                page = await self._read(self._partitions[self._next], block_ms=FOLLOW_BLOCK_MS)
                if page is not None:
                    return page
                continue
            pending = await self._pending()
            if not pending:
                return None
            # other readers' pages: acknowledged soon, or claimable once idle long enough
            await asyncio.sleep(min(0.5, self.claim_idle_ms / 4000))
        return None

    async def _read(self, partition: Keys, block_ms: int | None = None) -> ResultsPage | None:
        stream, group = partition.results, self.keys.results_group
        if stream in self._own_pending_unseen:
            entries = await self._read_group(stream, "0")
            if len(entries) < self.page:  # a full page: there may be more, read again next
                self._own_pending_unseen.discard(stream)
            page = self._page(partition, entries)
            if page is not None:
                log.info("took back results this reader held", results=len(page.entry_ids))
                return page
        claimed = await self._call(
            "claim results of a stopped reader",
            lambda: self.client.xautoclaim(
                stream, group, self.consumer, self.claim_idle_ms, "0-0", count=self.page
            ),
        )
        page = self._page(partition, claimed[1])
        if page is not None:
            log.info("claimed results a stopped reader held", results=len(page.entry_ids))
            return page
        return self._page(partition, await self._read_group(stream, ">", block_ms))

    async def _read_group(self, stream: str, start: str, block_ms: int | None = None) -> list[Any]:
        """A page of ``stream``'s entries for this reader: those it holds already from ``"0"``,
        new ones from ``">"`` (waiting up to ``block_ms`` for one)."""
        reply = await self._call(
            "read results",
            lambda: self.client.xreadgroup(
                self.keys.results_group,
                self.consumer,
                {stream: start},
                count=self.page,
                block=block_ms,
            ),
        )
        return _entries(reply)

    def _page(self, partition: Keys, entries: list[Any]) -> ResultsPage | None:
        if not entries:
            return None
        page = ResultsPage(partition, [])
        for entry_id, fields in entries:
            page.entry_ids.append(entry_id)
            if fields:  # an entry deleted while pending comes back without fields (Redis 6.2)
                page.results.append(decode_result(fields[PAYLOAD_FIELD]))
        return page

    async def _pending(self) -> int:
        """Results delivered to some reader of the group and not yet acknowledged."""

        async def count() -> int:
            total = 0
            for partition in self._partitions:
                summary = await self.client.xpending(partition.results, self.keys.results_group)
                total += int(summary["pending"])
            return total

        return await self._call("read the results readers' pending count", count)

    async def acknowledge(self, page: ResultsPage) -> None:
        """XACK and XDEL the page's entries in one transaction: the stream shrinks as it is read.

        An entry another reader claimed meanwhile and acknowledged first is deleted once; the
        second XACK counts nothing. Safe to send again after a fault."""
        stream = page.partition.results

        async def send() -> None:
            pipe = self.client.pipeline(transaction=True)  # one stream: one slot
            pipe.xack(stream, self.keys.results_group, *page.entry_ids)
            pipe.xdel(stream, *page.entry_ids)
            await pipe.execute()

        await self._call("acknowledge results", send)

    async def consume(
        self, *, follow: bool = False, stop: asyncio.Event | None = None
    ) -> AsyncIterator[Result]:
        """Every result, each page acknowledged once the caller has taken all of it and asks
        for more. Leaving the loop early leaves the current page pending, for any reader to
        claim after EMBEDFLEET_RESULTS_CLAIM_IDLE_MS."""
        while (page := await self.next_page(follow=follow, stop=stop)) is not None:
            for result in page.results:
                yield result
            await self.acknowledge(page)

    async def close(self) -> None:
        """Leave the group's consumer list if this reader holds nothing (a consumer deleted
        with pending entries would lose them, so one that holds some stays listed)."""
        if not self._ready:
            return
        for partition in self._partitions:
            try:
                held = await self.client.xpending_range(
                    partition.results, self.keys.results_group, "-", "+", 1, self.consumer
                )
                if not held:
                    await self.client.xgroup_delconsumer(
                        partition.results, self.keys.results_group, self.consumer
                    )
            except Exception as error:  # leaving the list is tidiness, not correctness
                log.info("results reader not removed from the group", error=str(error))
                return


def _entries(reply: Any) -> list[Any]:
    """XREADGROUP's entries of its one stream (RESP2 list or RESP3 map)."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return next(iter(reply.values()))[0] if reply else []
    return reply[0][1]
