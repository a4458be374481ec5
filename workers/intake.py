"""The worker's intake stage: stream entries → windows ready to compute.

``Intake.run`` reads the ingest streams (and the entries the reclaimer hands over) when the
compute stage wants a window (``want_window``, set by ``pace_reads`` and ``next_window``), and
opens each read as one window (``open_window``): on the tokenizer thread decoded, validated and
given prompts and content keys; looked up in the vector cache on the event loop (a hit's result is
made from the stored vector and skips the model); on the tokenizer thread again tokenized, sorted
by length, planned into batches by token budget and collated into host buffers. Bad input is
dead-lettered and expired entries acknowledged on the event loop; the interactive stream's
entries go to the ``urgent`` queue, which the compute stage takes before its next bulk batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from embedfleet.shared.dead_letters import DeadReason
from embedfleet.shared.fault_kinds import System
from embedfleet.shared.keys import Keys
from embedfleet.shared.logging import get_logger
from embedfleet.shared.protocol import Chunk, Result
from embedfleet.shared.vector_cache import CacheCounts, CachedVector
from embedfleet.sinks import Delivery, queue_acknowledgements
from embedfleet.sinks.sink import acknowledgement_pipeline
from embedfleet.workers.batcher import PlannedBatch
from embedfleet.workers.bulk import BulkBatch
from embedfleet.workers.consumer import StreamEntry
from embedfleet.workers.dead_letter_writer import Rejected
from embedfleet.workers.decode import Accepted, decode_entries
from embedfleet.workers.long_inputs import Rejoin, before_normalize_wanted, expand
from embedfleet.workers.model.encoder import Tokenized
from embedfleet.workers.outages import RideOut, transient_or_raise
from embedfleet.workers.parts import StageParts
from embedfleet.workers.token_ids import tokenize_chunks

log = get_logger("embedfleet.worker")
# The reader is asked for the next window this long (beyond twice its latest opening time)
# before the compute stage's window ends: its read's round trips, and a loaded event loop.
READ_MARGIN_S = 0.05


@dataclass
class Prepared:
    """One planned batch of a window, collated into host buffers."""

    planned: PlannedBatch
    batch: BulkBatch


@dataclass
class Window:
    """Valid chunks read together, tokenized, with the entries they came from, and their
    batches ready to launch."""

    chunks: list[Chunk]
    deliveries: list[Delivery]
    tokens: list[Tokenized]
    batches: list[Prepared] = field(default_factory=list)
    # entries read with the window whose caller's deadline had passed: acknowledged unembedded
    expired: list[Delivery] = field(default_factory=list)
    # chunks the vector cache answered (not in ``chunks``: they skip the model), with their
    # entries and the results made from the stored vectors
    cached: list[tuple[Chunk, Delivery, Result]] = field(default_factory=list)
    # the content key of each chunk to embed that the cache may store (by its entry)
    content_keys: dict[Delivery, str] = field(default_factory=dict)
    # long inputs embedded whole (``window_overlap``): ``chunks``, ``deliveries`` and
    # ``tokens`` hold one row per token window, which this rejoins after the model
    # (workers/long_inputs.py); None: one row per chunk
    rejoin: Rejoin | None = None

    @property
    def held(self) -> list[Delivery]:
        """Every entry the window answers: those to embed and those the cache answered."""
        return [*self.deliveries, *(delivery for _, delivery, _ in self.cached)]


class Intake:
    """The intake stage: reads entries when the compute stage wants a window, and opens them as
    windows (or as urgent windows, for the interactive stream's entries)."""

    def __init__(self, parts: StageParts, prepare: Callable[[Window], list[Prepared]]) -> None:
        self.parts = parts
        # the compute stage's planning and collation of a window's batches (tokenizer thread)
        self._prepare = prepare
        # entries the reclaimer claimed for the bulk lane, read before the streams
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

    async def hold_reclaimed(self, stream: str, entries: list[StreamEntry]) -> None:
        """Entries the reclaimer claimed: ours from now on (their lease renewed while they
        wait for the reader), read before the streams."""
        self.parts.in_flight.add(stream, [entry.entry_id for entry in entries])
        await self._reclaimed.put(entries)

    async def run(self, windows: asyncio.Queue[Window | None], ready: asyncio.Event) -> None:
        """The reader: from when the compute stage is ``ready`` until the drain, windows to
        ``windows`` (None at the end)."""
        ride = RideOut("reading the ingest stream", self.parts.outages, self.parts.events)
        drained = False
        try:
            await first_set(ready, self.parts.stopping)
            while not self.parts.stopping.is_set():
                try:
                    await first_set(self.want_window, self.parts.stopping)
                    if self.parts.stopping.is_set():
                        break
                    entries = await self._next_entries()
                    if entries:
                        self.parts.events.entries_read(stream=entries[0].stream, count=len(entries))
                        await self._intake_by_lane(entries, windows)
                    ride.succeeded()
                except Exception as error:
                    await ride.wait(transient_or_raise(error, System.REDIS))
            # partitions still blocked on when the drain began: what they bring is finished too
            leftover = await self.parts.consumer.finish_waiting()
            if leftover:
                await self._intake_by_lane(leftover, windows)
            drained = True
        finally:
            if not drained:
                self.parts.consumer.abandon_waiting()
            await windows.put(None)

    async def next_window(self, windows: asyncio.Queue[Window | None]) -> Window | None:
        """The next window; when none is queued, the reader is asked for one first."""
        if windows.empty():
            self.want_window.set()
        return await windows.get()

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

    async def _intake_by_lane(
        self, entries: list[StreamEntry], windows: asyncio.Queue[Window | None]
    ) -> None:
        """Interactive entries to the compute stage's urgent queue, the rest as a bulk window
        (a read can bring both: blocking reads on several streams, reclaimed entries)."""
        interactive = self.parts.consumer.interactive_stream
        urgent = [entry for entry in entries if entry.stream == interactive]
        bulk = [entry for entry in entries if entry.stream != interactive]
        if urgent:
            await self._intake(urgent, windows, urgent=True)
        if bulk:
            await self._intake(bulk, windows)

    async def _intake(
        self,
        entries: list[StreamEntry],
        windows: asyncio.Queue[Window | None],
        *,
        urgent: bool = False,
    ) -> None:
        """Entries → one window, made in one call on the tokenizer thread (``open_window``);
        what it rejects is dead-lettered here, on the event loop, before the window goes on.

        Decoding and validation run there too, not on the event loop: at a GPU's rate they would
        take a large share of each second of the loop, in stalls per read that delay writes, acks
        and query reads alike (docs/BENCHMARKS.md, GPU check)."""
        opened = time.monotonic()
        window, rejected = await self.open_window(entries)
        if not urgent:
            self.open_s = time.monotonic() - opened
        await self.dead_letter(rejected)
        await self.drop_expired(window.expired)
        if not window.chunks and not window.cached:
            return
        consumer = self.parts.consumer
        if consumer.policy.token_rate:
            for delivery, tokens in zip(window.deliveries, window.tokens, strict=True):
                consumer.charge(consumer.tenant_of_delivery(delivery), tokens.length)
            for _, delivery, _ in window.cached:  # read, and free: no model tokens
                consumer.charge(consumer.tenant_of_delivery(delivery), 0)
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

    async def open_window(self, entries: list[StreamEntry]) -> tuple[Window, list[Rejected]]:
        """Entries → a window, and what to dead-letter: decoded, validated and given their
        prompts and content keys on the tokenizer thread (``_decode_window``), looked up in the
        vector cache here (``_look_up``: the hits skip the model), the rest tokenized, planned
        and collated on the tokenizer thread again (``_tokenize_window``)."""
        loop = asyncio.get_running_loop()
        accepted, prompts, keys, expired, rejected = await loop.run_in_executor(
            self.parts.threads.tokenizer, self._decode_window, entries
        )
        hits = await self._look_up(accepted, keys)
        window = await loop.run_in_executor(
            self.parts.threads.tokenizer,
            functools.partial(
                self._tokenize_window, accepted, prompts, keys, hits, expired, rejected
            ),
        )
        return window, rejected

    def _decode_window(
        self, entries: list[StreamEntry]
    ) -> tuple[list[Accepted], list[str], list[str | None], list[Delivery], list[Rejected]]:
        """On the tokenizer thread: entries decoded and validated, those past their deadline
        set aside, prompts chosen (chunks whose options the model cannot honour rejected) and
        each chunk's content key made (None: not cached, or the cache is off)."""
        accepted, rejected = decode_entries(entries, self.parts.settings)
        # a caller past its deadline (a timed-out interactive request) has gone: not embedded
        now_ms = time.time() * 1000
        expired = [
            a.delivery
            for a in accepted
            if a.chunk.deadline_ms is not None and a.chunk.deadline_ms < now_ms
        ]
        if expired:
            accepted = [
                a for a in accepted if a.chunk.deadline_ms is None or a.chunk.deadline_ms >= now_ms
            ]
        accepted, prompts = self._with_prompts(accepted, rejected)
        keys: list[str | None] = [None] * len(accepted)
        if self.parts.vector_cache.enabled:
            keys = [
                self.parts.outputs.content_key(a.chunk, p)
                for a, p in zip(accepted, prompts, strict=True)
            ]
        return accepted, prompts, keys, expired, rejected

    async def _look_up(
        self, accepted: list[Accepted], keys: list[str | None]
    ) -> dict[int, CachedVector]:
        """The chunks the vector cache holds a vector for (by position in ``accepted``), one
        round trip per key set; a chunk sent with ``reembed`` is not looked up. The hits and
        misses are counted (the key set's and each job's counters, the worker's events). Redis
        failing here costs only the cache: every chunk is embedded."""
        if not self.parts.vector_cache.enabled or not accepted:
            return {}
        by_owner: dict[Keys, list[int]] = {}
        for position, item in enumerate(accepted):
            with contextlib.suppress(KeyError):  # (a stream of no key set: not looked up)
                by_owner.setdefault(self.parts.keys.owner_of(item.delivery.stream), []).append(
                    position
                )
        hits: dict[int, CachedVector] = {}
        for owner, positions in by_owner.items():
            wanted = [p for p in positions if keys[p] is not None and not accepted[p].chunk.reembed]
            try:
                found = await self.parts.vector_cache.lookup(owner, [keys[p] or "" for p in wanted])
            except Exception as error:
                transient_or_raise(error, System.REDIS)
                log.warning("vector cache not read: embedding the window", error=str(error))
                found = [None] * len(wanted)
            for position, entry in zip(wanted, found, strict=True):
                # a vector of a text cut to fit is not reused where cutting is refused
                if entry is not None and (
                    self.parts.settings.truncate or not entry.result.truncated
                ):
                    hits[position] = entry
            per_job: dict[str | None, CacheCounts] = {}
            for position in positions:
                entry = hits.get(position)
                counts = CacheCounts(1, 0, entry.tokens) if entry else CacheCounts(0, 1, 0)
                job = accepted[position].chunk.job
                per_job[job] = per_job.get(job, CacheCounts()) + counts
            total = sum(per_job.values(), CacheCounts())
            self.parts.events.vector_cache_checked(
                hits=total.hits, misses=total.misses, tokens_saved=total.tokens_saved
            )
            try:
                await self.parts.vector_cache.count(owner, per_job)
            except Exception as error:
                transient_or_raise(error, System.REDIS)
                log.warning("vector cache counters not updated", error=str(error))
        return hits

    def _tokenize_window(
        self,
        accepted: list[Accepted],
        prompts: list[str],
        keys: list[str | None],
        hits: dict[int, CachedVector],
        expired: list[Delivery],
        rejected: list[Rejected],
    ) -> Window:
        """On the tokenizer thread: the cache's hits made into results, the other chunks
        tokenized, those over the model's maximum set aside (EMBEDFLEET_TRUNCATE=false), the
        rest planned into batches and collated."""
        cached = [
            (accepted[p].chunk, accepted[p].delivery, entry.for_chunk(accepted[p].chunk))
            for p, entry in sorted(hits.items())
        ]
        rest = [p for p in range(len(accepted)) if p not in hits]
        if not rest:
            return Window([], [], [], expired=expired, cached=cached)
        tokenized = tokenize_chunks(
            [accepted[p].chunk for p in rest], [prompts[p] for p in rest], self.parts.encoder
        )
        rejected += [
            Rejected.chunk(
                accepted[rest[i]].delivery, accepted[rest[i]].chunk, DeadReason.TOKENIZER, reason
            )
            for i, reason in tokenized.refused
        ]
        rest = [rest[i] for i in tokenized.kept]
        texts_prompts = [prompts[p] for p in rest]
        window = Window(
            [accepted[p].chunk for p in rest],
            [accepted[p].delivery for p in rest],
            tokenized.tokens,
            expired=expired,
            cached=cached,
            content_keys={accepted[p].delivery: key for p in rest if (key := keys[p]) is not None},
        )
        window = self._in_windows(window, texts_prompts, rejected)
        window = self._set_aside_overlong(window, rejected)
        if window.chunks:
            window.batches = self._prepare(window)
        return window

    def _with_prompts(
        self, accepted: list[Accepted], rejected: list[Rejected]
    ) -> tuple[list[Accepted], list[str]]:
        """Each chunk's prompt (the document lane's unless it names one); chunks whose options
        the model cannot honour go to ``rejected`` with the reason."""
        kept: list[Accepted] = []
        prompts: list[str] = []
        for item in accepted:
            try:
                prompts.append(self.parts.outputs.prompt_for(item.chunk, "document"))
            except ValueError as error:
                delivery, chunk = item.delivery, item.chunk
                rejected.append(Rejected.chunk(delivery, chunk, DeadReason.OPTIONS, str(error)))
                continue
            kept.append(item)
        return kept, prompts

    def _in_windows(self, window: Window, prompts: list[str], rejected: list[Rejected]) -> Window:
        """Long inputs embedded whole (issue 42): each chunk with ``window_overlap`` whose text
        was cut becomes one row per token window (workers/long_inputs.py); one whose overlap
        leaves a window no room goes to ``rejected``."""
        long = [
            i
            for i, (chunk, tokens) in enumerate(zip(window.chunks, window.tokens, strict=True))
            if chunk.window_overlap is not None and tokens.truncated
        ]
        model_normalizes = self.parts.encoder.pooling.normalize
        if not long:
            if before_normalize_wanted(window.chunks, model_normalizes):
                # a chunk wants its vector before Normalize: the window's batches come back
                # before it and the rejoin normalises the other rows (workers/long_inputs.py)
                return dataclasses.replace(window, rejoin=Rejoin(normalize=model_normalizes))
            return window
        text = self.parts.encoder.text
        windows: dict[int, list[Tokenized]] = {}
        refused: set[int] = set()
        for i in long:
            chunk = window.chunks[i]
            assert chunk.window_overlap is not None
            try:
                windows[i] = text.windows(
                    [chunk.text], [prompts[i]] if prompts[i] else None, chunk.window_overlap
                )[0]
            except ValueError as error:
                refused.add(i)
                rejected.append(
                    Rejected.chunk(window.deliveries[i], chunk, DeadReason.OPTIONS, str(error))
                )
        keep = [i for i in range(len(window.chunks)) if i not in refused]
        kept_at = {i: at for at, i in enumerate(keep)}
        rejoin = Rejoin(normalize=self.parts.encoder.pooling.normalize)
        chunks, deliveries, tokens = expand(
            [window.chunks[i] for i in keep],
            [window.deliveries[i] for i in keep],
            [window.tokens[i] for i in keep],
            {kept_at[i]: rows for i, rows in windows.items()},
            rejoin,
        )
        return dataclasses.replace(
            window, chunks=chunks, deliveries=deliveries, tokens=tokens, rejoin=rejoin
        )

    def _set_aside_overlong(self, window: Window, rejected: list[Rejected]) -> Window:
        """Without truncation, texts over the model's maximum go to ``rejected``."""
        if self.parts.settings.truncate or not any(t.truncated for t in window.tokens):
            return window
        reason = (
            f"text is longer than the model's {self.parts.encoder.max_length} tokens "
            "(EMBEDFLEET_TRUNCATE=false)"
        )
        rejected += [
            Rejected.chunk(d, c, DeadReason.TOO_LONG, reason)
            for c, d, t in zip(window.chunks, window.deliveries, window.tokens, strict=True)
            if t.truncated
        ]
        keep = [i for i, t in enumerate(window.tokens) if not t.truncated]
        return dataclasses.replace(
            window,
            chunks=[window.chunks[i] for i in keep],
            deliveries=[window.deliveries[i] for i in keep],
            tokens=[window.tokens[i] for i in keep],
        )

    async def drop_expired(self, expired: list[Delivery]) -> None:
        """Acknowledge (and delete) entries nobody waits for any more, counted as expired, as
        the query lane does: answering them would only leave a reply list to expire."""
        if not expired:
            return
        pipe = acknowledgement_pipeline(self.parts.client, self.parts.keys)
        queue_acknowledgements(pipe, self.parts.keys, expired, counter="expired")
        await pipe.execute()

    async def dead_letter(self, rejected: list[Rejected]) -> None:
        await self.parts.dead_letters.send(rejected)
        self.parts.in_flight.release(rejected)


async def first_set(*events: asyncio.Event) -> None:
    """Return once any of ``events`` is set."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
