"""Nothing is lost when a worker dies: its pending entries are claimed by the living.

Every ``reclaim_idle_ms / 3`` a worker
1. renews the lease on the entries it is still working on, and on those its sink holds written
   but not yet acknowledged (a Parquet shard's, also while its store is down), with XCLAIM to
   itself, JUSTID: resets their idle time without counting a delivery, so a long batch or a
   shard waiting out an outage is never stolen;
2. claims entries idle longer than ``reclaim_idle_ms`` on any consumer (XAUTOCLAIM), at most
   one read's worth per stream and period (after a mass restart, one worker taking every idle
   entry as one window would hold them all while the others idle; the cursor goes on from
   there next period), and dead-letters those already delivered ``max_deliveries`` times (a
   poison message that kills workers must not kill them forever) the way the worker does: its
   job counts it dead and its caller's reply list gets the error;
3. removes consumers that have nothing pending and have not been seen for a long while.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable, Iterable
from operator import attrgetter
from typing import Protocol

import redis.asyncio as aioredis

from embedfleet.shared.dead_letters import DeadReason
from embedfleet.shared.fault_kinds import System
from embedfleet.shared.logging import get_logger
from embedfleet.shared.protocol import PAYLOAD_FIELD, ProtocolError, decode_chunk
from embedfleet.shared.redis_conn import as_str
from embedfleet.shared.settings import Settings
from embedfleet.workers.consumer import StreamEntry
from embedfleet.workers.dead_letter_writer import DeadLetters, Rejected
from embedfleet.workers.events import WorkerEvents
from embedfleet.workers.outages import Outages, RideOut, transient_or_raise

log = get_logger("embedfleet.reclaim")
Deliver = Callable[[str, list[StreamEntry]], Awaitable[None]]
# A consumer unseen for this many reclaim periods, with nothing pending, is gone for good.
FORGET_AFTER_PERIODS = 10


class EntryRef(Protocol):
    """Where an entry came from (a ``Delivery``, a ``Rejected``)."""

    @property
    def stream(self) -> str: ...

    @property
    def entry_id(self) -> str: ...


_by_stream = attrgetter("stream")


class HeldBySink(Protocol):
    """The entries a sink holds written and not yet acknowledged (``Sink.holding``)."""

    def holding(self) -> Iterable[EntryRef]: ...

    def holds(self, stream: str, entry_id: str) -> bool: ...


class InFlight:
    """Entry ids this worker has read and not yet acknowledged, per stream: those it computes
    (added on intake, released once written) and those its sink still holds (``sink``: a
    Parquet shard's, until the shard is stored and acknowledged, however long the store is
    down). The reclaimer renews the leases of all of them."""

    def __init__(self, sink: HeldBySink | None = None) -> None:
        self._ids: dict[str, set[str]] = {}
        self._sink = sink

    def add(self, stream: str, entry_ids: list[str]) -> None:
        self._ids.setdefault(stream, set()).update(entry_ids)

    def hold(self, entries: Iterable[EntryRef]) -> None:
        """Add each entry under its stream: one set update per run of one stream (a window is
        read from one stream at a time), not one call per entry on the event loop."""
        for stream, run in itertools.groupby(entries, key=_by_stream):
            self._ids.setdefault(stream, set()).update(entry.entry_id for entry in run)

    def release(self, entries: Iterable[EntryRef]) -> None:
        """Remove each entry from its stream's ids (written, or dead-lettered)."""
        for stream, run in itertools.groupby(entries, key=_by_stream):
            self._ids.get(stream, set()).difference_update(entry.entry_id for entry in run)

    def holds(self, stream: str, entry_id: str) -> bool:
        return entry_id in self._ids.get(stream, ()) or (
            self._sink is not None and self._sink.holds(stream, entry_id)
        )

    def snapshot(self) -> dict[str, list[str]]:
        ids = {stream: set(held) for stream, held in self._ids.items() if held}
        if self._sink is not None:
            for stream, run in itertools.groupby(self._sink.holding(), key=_by_stream):
                ids.setdefault(stream, set()).update(entry.entry_id for entry in run)
        return {stream: list(held) for stream, held in ids.items()}

    def __len__(self) -> int:
        """Entries the worker computes (not counting those its sink holds)."""
        return sum(len(ids) for ids in self._ids.values())


class Reclaimer:
    def __init__(
        self,
        settings: Settings,
        client: aioredis.Redis,
        in_flight: InFlight,
        dead_letters: DeadLetters,
        events: WorkerEvents,
        outages: Outages | None = None,
        *,
        read_count: int,
    ) -> None:
        """``read_count``: the worker's resolved EMBEDFLEET_READ_COUNT (``Settings.batching``
        for its device): one claim takes at most that many entries."""
        self.settings = settings
        self.read_count = read_count
        # where each stream's XAUTOCLAIM scan goes on next period ("0-0": from the start)
        self._cursors: dict[str, str] = {}
        self.keys = settings.keys
        self.client = client
        self.in_flight = in_flight
        self.dead_letters = dead_letters
        self.events = events
        self.outages = outages or Outages(events)

    @property
    def period_s(self) -> float:
        return max(0.1, self.settings.reclaim_idle_ms / 3000)

    async def run(
        self, stopping: asyncio.Event, deliver: Deliver, streams: Callable[[], list[str]]
    ) -> None:
        """``streams``: the streams to scan, asked each period (every tenant's ingest streams
        as the worker's reader knows them, the interactive and query streams)."""
        ride = RideOut("reclaiming idle entries", self.outages, self.events)
        while not stopping.is_set():
            try:
                await self.renew_leases()
                scanned = streams()
                for stream in scanned:
                    claimed = await self.claim(stream)
                    if claimed:
                        await deliver(stream, claimed)
                await self.forget_dead_consumers(scanned)
                ride.succeeded()
            except Exception as error:
                await ride.wait(transient_or_raise(error, System.REDIS))
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), self.period_s)

    async def renew_leases(self) -> None:
        renewed = 0
        for stream, entry_ids in self.in_flight.snapshot().items():
            renewed += len(entry_ids)
            for start in range(0, len(entry_ids), 500):
                await self.client.xclaim(
                    stream,
                    self.keys.group,
                    self.settings.consumer,
                    min_idle_time=0,
                    # redis-py wants List[StreamIdT]: list is invariant, so a list[str] of ids
                    # does not match, although it is what XCLAIM takes
                    message_ids=entry_ids[start : start + 500],  # type: ignore[arg-type]
                    justid=True,
                )
        if renewed:
            self.events.leases_renewed(count=renewed)

    async def claim(self, stream: str) -> list[StreamEntry]:
        """Up to one read's worth of entries idle past the limit, now ours; over-delivered ones
        are dead-lettered. The scan goes on from where it stopped at the next call."""
        response = await self.client.xautoclaim(
            stream,
            self.keys.group,
            self.settings.consumer,
            min_idle_time=self.settings.reclaim_idle_ms,
            start_id=self._cursors.get(stream, "0-0"),
            count=self.read_count,
        )
        next_start, entries = response[0], response[1]
        # "0-0" once the scan has passed the end: the next one starts over
        self._cursors[stream] = as_str(next_start)
        claimed = await self._sort_out(stream, entries) if entries else []
        if claimed:
            log.info("reclaimed entries of another consumer", stream=stream, count=len(claimed))
            self.events.reclaimed(count=len(claimed))
        return claimed

    async def _sort_out(
        self, stream: str, entries: list[tuple[bytes, dict[bytes, bytes]]]
    ) -> list[StreamEntry]:
        pipe = self.client.pipeline(transaction=False)
        for entry_id, _ in entries:
            pipe.xpending_range(stream, self.keys.group, min=entry_id, max=entry_id, count=1)
        pending_info = await pipe.execute()
        keep: list[StreamEntry] = []
        poison: list[Rejected] = []
        for (entry_id, fields), info in zip(entries, pending_info, strict=True):
            fields = fields or {}
            deliveries = int(info[0]["times_delivered"]) if info else 1
            entry = StreamEntry(stream, as_str(entry_id), fields.get(PAYLOAD_FIELD), fields)
            if self.in_flight.holds(stream, entry.entry_id):
                # Our own, still being worked on: a renewal came late (a starved event loop or
                # a slow Redis) and XAUTOCLAIM cannot leave out one consumer. Taking it again
                # would embed it twice and, repeated, dead-letter a healthy entry as poison.
                continue
            if deliveries > self.settings.max_deliveries:
                chunk_id, job, reply = self._owner(entry)
                poison.append(
                    Rejected(
                        stream,
                        entry.entry_id,
                        DeadReason.DELIVERIES,
                        f"delivered {deliveries - 1} times and never acknowledged (a worker "
                        f"died or stalled on it each time; EMBEDFLEET_MAX_DELIVERIES="
                        f"{self.settings.max_deliveries})",
                        payload=entry.payload,
                        chunk_id=chunk_id,
                        job=job,
                        reply=reply,
                        deliveries=deliveries - 1,
                    )
                )
            else:
                keep.append(entry)
        await self.dead_letters.send(poison)
        return keep

    def _owner(self, entry: StreamEntry) -> tuple[str | None, str | None, str | None]:
        """The chunk id, job and reply list of an entry, as far as its payload says: its dead
        letter counts against its job (else the job never finishes) and answers its caller."""
        if entry.payload is None:
            return None, None, None
        try:
            chunk = decode_chunk(entry.payload, self.settings.chunk_limits)
        except ProtocolError as error:  # what valid fields a refused payload has
            return error.chunk_id, error.job, error.reply
        return chunk.id, chunk.job, chunk.reply

    async def forget_dead_consumers(self, streams: list[str]) -> None:
        # Removing a live consumer by mistake is harmless (its next read recreates it), so
        # the limit only has to be well past a live reader's gap between reads.
        idle_limit_ms = FORGET_AFTER_PERIODS * max(
            self.settings.reclaim_idle_ms, self.settings.block_ms, 500
        )
        for stream in streams:
            for consumer in await self.client.xinfo_consumers(stream, self.keys.group):
                name = as_str(consumer["name"])
                if (
                    name != self.settings.consumer
                    and int(consumer["pending"]) == 0
                    and int(consumer["idle"]) > idle_limit_ms
                ):
                    await self.client.xgroup_delconsumer(stream, self.keys.group, name)
                    log.info("removed a dead consumer", stream=stream, consumer=name)
