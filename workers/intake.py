"""The worker's intake stage: stream entries → windows ready to compute.

``Intake.run`` reads the ingest streams (and the entries the reclaimer hands over) when the
compute stage wants a window (``want_window``, set by ``pace_reads`` and ``next_window``), and
opens each read as one window (workers/windows.py: decoded, looked up in the vector cache,
tokenized, planned and collated). What the opening rejects is dead-lettered and expired entries
acknowledged here, on the event loop; what the window's entries cost their tenants' token rates
is charged (workers/token_rate.py); the interactive stream's entries go to the ``urgent``
queue, which the compute stage takes before its next bulk batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from embedfleet.shared.fault_kinds import System
from embedfleet.sinks import Delivery
from embedfleet.sinks.sink import acknowledgement_pipeline
from embedfleet.workers.consumer import StreamEntry
from embedfleet.workers.dead_letter_writer import Rejected
from embedfleet.workers.deadlines import acknowledge_expired
from embedfleet.workers.outages import RideOut, transient_or_raise
from embedfleet.workers.parts import StageParts
from embedfleet.workers.windows import Prepared, Window, WindowOpener

# The reader is asked for the next window this long (beyond twice its latest opening time)
# before the compute stage's window ends: its read's round trips, and a loaded event loop.
READ_MARGIN_S = 0.05


class Intake:
    """The intake stage: reads entries when the compute stage wants a window, and opens them as
    windows (or as urgent windows, for the interactive stream's entries)."""

    def __init__(self, parts: StageParts, prepare: Callable[[Window], list[Prepared]]) -> None:
        self.parts = parts
        # decodes, looks up and tokenizes each read into a window (workers/windows.py)
        self.opener = WindowOpener(parts, prepare)
        # entries the reclaimer claimed for the bulk path, read before the streams
        self._reclaimed: asyncio.Queue[list[StreamEntry]] = asyncio.Queue()
        # windows of interactive entries the reader opened, for the compute stage to take first
        self.urgent: asyncio.Queue[Window] = asyncio.Queue(maxsize=2)
        # Set when the compute stage wants the next bulk window read (pace_reads): once its
        # own window's batches left take about as long as the reader needs to open one. Read
        # earlier, a window would hold entries read while the one before still ran: a tenant
        # that came meanwhile would wait for them all, not get its share from the next window.
        self.want_window = asyncio.Event()
        self.want_window.set()
        # the latest window's opening time (decode, cache, tokenize: the reader's lead), seconds
        self.open_s = 0.0
        # the compute stage found no window queued when it wanted its latest: the host, not the
        # model, bounds the worker, and the reader reads ahead (``run``)
        self.starved = False
        # set while the compute stage waits for a window: a read ahead waits for it (``run``)
        self.compute_waits = asyncio.Event()

    async def hold_reclaimed(self, stream: str, entries: list[StreamEntry]) -> None:
        """Entries the reclaimer claimed: ours from now on (their lease renewed while they
        wait for the reader), read before the streams."""
        self.parts.in_flight.add(stream, [entry.entry_id for entry in entries])
        await self._reclaimed.put(entries)

    async def run(self, windows: asyncio.Queue[Window | None], ready: asyncio.Event) -> None:
        """The reader: from when the compute stage is ``ready`` until the drain, windows to
        ``windows`` (None at the end), a read a turn (``_turn``)."""
        ride = RideOut("reading the ingest stream", self.parts.outages, self.parts.events)
        drained = False
        openings = Openings()
        try:
            await first_set(ready, self.parts.stopping)
            while not self.parts.stopping.is_set():
                try:
                    await first_set(self.want_window, self.parts.stopping)
                    if self.parts.stopping.is_set():
                        break
                    if await self._turn(windows, openings):
                        ride.succeeded()
                except Exception as error:
                    await ride.wait(transient_or_raise(error, System.REDIS))
            for last in openings.take_all():
                try:
                    await last
                except Exception as error:  # a transient fault: its entries' leases run out
                    transient_or_raise(error, System.REDIS)
            # partitions still blocked on when the drain began: what they bring is finished too
            leftover = await self.parts.consumer.finish_waiting()
            if leftover:
                await self._intake_by_stream(leftover, windows)
            drained = True
        finally:
            await openings.cancel()  # their outcome is the fault being raised, not raised again
            if not drained:
                self.parts.consumer.abandon_waiting()
            await windows.put(None)

    async def _turn(self, windows: asyncio.Queue[Window | None], openings: Openings) -> bool:
        """One turn of the reader: an opening settled, or a read opened; whether it read.

        While the compute stage finds no window queued when it wants one (the host, not the
        model, bounds the worker: issue 53) and waits for one, the next read runs beside the
        opening of the one before, and is opened beside it (two at most) where the windows have
        texts to tokenize and both reads fit in one read's bytes: one window's texts in the
        tokenizer's Rust while the other's Python runs, so that neither the tokenizer nor a core
        waits. Not where a tenant has a token rate: a read settles what the read before cost
        once tokenized (workers/token_rate.py). A window waits for the one read before it to be
        queued first, so windows reach the compute stage in the order they were read."""
        if openings.earlier is not None:
            # two openings at most: the next read waits for the older one, whose fault is
            # raised here (the one after it is queued all the same)
            await openings.take_earlier()
            return False
        latest = openings.latest
        if latest is not None and not await self._compute_waits_before(latest):
            openings.latest = None
            await latest  # opened first; the window it queued may be the one wanted
            return False
        entries = await self._next_entries()
        size = sum(len(entry.payload) for entry in entries if entry.payload is not None)
        beside = (
            self.opener.tokenizes  # not windows of producers' ids: all Python, no Rust
            # both reads' text held at once no more than one full read's (the memory bound,
            # docs/OPERATIONS.md): reads of long texts, full by bytes, are opened in turn
            and openings.latest_bytes + size <= self.parts.batching.read_max_bytes
        )
        previous = openings.take_latest()
        if previous is not None and (not entries or not beside):
            await self._opened_before(previous, entries)
            previous = None
        if not entries:
            return True
        openings.earlier = previous  # its fault is raised next turn
        self.parts.events.entries_read(stream=entries[0].stream, count=len(entries))
        current = asyncio.ensure_future(self._intake_by_stream(entries, windows, after=previous))
        if self.starved and not self.parts.consumer.rates.rated:
            openings.latest = current  # awaited before the next read's window
            openings.latest_bytes = size
        else:
            # the model is the bound, or a tenant's token rate charges each read for the one
            # before: the next window is read when wanted
            await current
        return True

    async def next_window(self, windows: asyncio.Queue[Window | None]) -> Window | None:
        """The next window; when none is queued, the reader is asked for one first."""
        self.starved = windows.empty()
        if self.starved:
            self.want_window.set()
            self.compute_waits.set()
        try:
            return await windows.get()
        finally:
            self.compute_waits.clear()

    async def _opened_before(
        self, previous: asyncio.Future[None], entries: list[StreamEntry]
    ) -> None:
        """Await the opening of the read before ``entries``; should it fail, ``entries`` were
        read, not lost: they are opened once the fault is ridden out."""
        try:
            await previous
        except Exception:
            if entries:
                self._reclaimed.put_nowait(entries)
            raise

    async def _compute_waits_before(self, opening: asyncio.Future[None]) -> bool:
        """Whether the compute stage waits for a window before ``opening`` is done. A read
        ahead waits for that: the compute stage found none queued once (``starved``), but a
        read made while it still runs a window would be held behind the one being opened, and a
        tenant that came meanwhile would wait for both (issue 40's share, ``pace_reads``)."""
        if not self.compute_waits.is_set():
            waits: asyncio.Future[Any] = asyncio.ensure_future(self.compute_waits.wait())
            try:
                await asyncio.wait([waits, opening], return_when=asyncio.FIRST_COMPLETED)
            finally:
                waits.cancel()
        return self.compute_waits.is_set()

    def pace_reads(
        self, windows: asyncio.Queue[Window | None], batches_left: int, batch_s: float
    ) -> None:
        """Before a bulk batch (of ``batch_s``, the latest): ask the reader for the next window
        once the batches after this one take less than the reader needs to open one (twice its
        latest time, and a round trip's margin; before the last batch at the latest), so that
        it is queued when this one ends and the model never waits for it, yet holds entries
        read as late as that allows: the windows held when a tenant comes are this one's rest
        and at most one."""
        lead = 2 * self.open_s + READ_MARGIN_S
        if windows.empty() and (batches_left - 1) * batch_s <= lead:
            self.want_window.set()

    async def _next_entries(self) -> list[StreamEntry]:
        if not self._reclaimed.empty():
            return self._reclaimed.get_nowait()
        return await self.parts.consumer.read_ingest(
            self.parts.batching.read_count, self.parts.settings.block_ms
        )

    async def _intake_by_stream(
        self,
        entries: list[StreamEntry],
        windows: asyncio.Queue[Window | None],
        after: asyncio.Future[None] | None = None,
    ) -> None:
        """Interactive entries to the compute stage's urgent queue, the rest as a bulk window
        (a read can bring both: blocking reads on several streams, reclaimed entries), each
        queued once ``after`` (the opening of the read before) is done."""
        interactive = self.parts.consumer.interactive_stream
        urgent = [entry for entry in entries if entry.stream == interactive]
        bulk = [entry for entry in entries if entry.stream != interactive]
        if urgent:
            await once_settled(after)
            after = None
            await self._intake(urgent, windows, urgent=True)
        if bulk:
            await self._intake(bulk, windows, after=after)

    async def _intake(
        self,
        entries: list[StreamEntry],
        windows: asyncio.Queue[Window | None],
        *,
        urgent: bool = False,
        after: asyncio.Future[None] | None = None,
    ) -> None:
        """Entries → one window, made in one call on the tokenizer threads
        (``WindowOpener.open_window``); once ``after`` (the opening of the read before) is
        done, what it rejects is dead-lettered here, on the event loop, and the window goes on.

        Decoding and validation run there too, not on the event loop: at a GPU's rate they would
        take a large share of each second of the loop, in stalls per read that delay writes, acks
        and query reads alike (docs/BENCHMARKS.md, GPU check)."""
        opened = time.monotonic()
        try:
            window, rejected = await self.opener.open_window(entries)
            if not urgent:
                self.open_s = time.monotonic() - opened
        finally:
            await once_settled(after)  # the window read before this one goes first
        await self.dead_letter(rejected)
        await self.drop_expired(window.expired)
        if window.empty:
            return
        # what the window's entries cost their tenants' token rates (workers/token_rate.py)
        self.parts.consumer.rates.charge_window(
            window.deliveries,
            (tokens.length for tokens in window.tokens),
            (delivery for _, delivery, _ in window.cached),
        )
        # ours until written: the reclaimer renews their leases from now on (only once the
        # dead letters are sent, so that entries of a window dropped by a failed send are
        # left for their lease to run out and be read again)
        self.parts.in_flight.hold(window.held)
        if not urgent:
            await windows.put(window)
            # the window wanted (wanted again while it was opened, nothing being queued then,
            # it is the one wanted all the same); a read that queues none leaves the want set
            self.want_window.clear()
            return
        # ahead of the bulk windows already queued (the compute stage takes it before the next
        # batch); an idle compute stage is woken by an empty window
        await self.urgent.put(window)
        with contextlib.suppress(asyncio.QueueFull):
            windows.put_nowait(Window([], [], []))

    async def drop_expired(self, expired: list[Delivery]) -> None:
        """Acknowledge entries nobody waits for any more (workers/deadlines.py)."""
        if expired:
            pipe = acknowledgement_pipeline(self.parts.client, self.parts.keys)
            await acknowledge_expired(pipe, self.parts.keys, expired)

    async def dead_letter(self, rejected: list[Rejected]) -> None:
        await self.parts.dead_letters.send(rejected)
        self.parts.in_flight.release(rejected)


class Openings:
    """The reader's openings still running: the latest read's and, while it runs, the one
    read before it (two at most)."""

    def __init__(self) -> None:
        self.latest: asyncio.Future[None] | None = None
        self.latest_bytes = 0  # the latest read's payload
        self.earlier: asyncio.Future[None] | None = None

    def take_latest(self) -> asyncio.Future[None] | None:
        latest, self.latest = self.latest, None
        return latest

    def take_earlier(self) -> asyncio.Future[None]:
        earlier, self.earlier = self.earlier, None
        assert earlier is not None
        return earlier

    def take_all(self) -> list[asyncio.Future[None]]:
        """Both, the older first, for the drain to await."""
        both = [task for task in (self.earlier, self.latest) if task is not None]
        self.earlier = self.latest = None
        return both

    async def cancel(self) -> None:
        unsettled = [task for task in self.take_all() if not task.done()]
        for task in unsettled:
            task.cancel()
        await asyncio.gather(*unsettled, return_exceptions=True)


async def once_settled(opening: asyncio.Future[None] | None) -> None:
    """Once the opening of the read before is done, failed or not: its fault is the reader's to
    raise (it holds that opening), and this read's window is queued all the same."""
    if opening is not None:
        await asyncio.gather(opening, return_exceptions=True)


async def first_set(*events: asyncio.Event) -> None:
    """Return once any of ``events`` is set."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
