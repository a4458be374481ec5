"""The worker's write stage: encoded batches → results → the sink (or the caller's reply list),
acknowledged in the same round trip.

``Writer.run`` takes what the compute stage hands on (``Encoded``: a batch's vectors, or the
results the vector cache answered) until the compute stage ends; per batch it makes the results
(the fleet's calibration read once for int8/uint8), stores the new vectors in the vector cache,
writes each row where it goes and releases the entries from the worker's in-flight set (the sink
holds those it has written and not yet acknowledged: a Parquet shard's).

Faults (shared/fault_kinds.py): a transient one is waited out however long; a row the database
refuses is isolated by halving its batch and dead-lettered alone; any other fault is tried
``EMBEDFLEET_SINK_RETRIES`` times, then ends the stage with a ``WorkerFault`` naming the setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import operator
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar, cast

import numpy as np

from embedfleet.shared.dead_letters import DeadReason
from embedfleet.shared.fault_kinds import Fault, FaultKind, System, WorkerFault
from embedfleet.shared.keys import Keys
from embedfleet.shared.logging import get_logger
from embedfleet.shared.protocol import Chunk, DenseResults, Result
from embedfleet.shared.vector_cache import pack_entries
from embedfleet.sinks import Delivery
from embedfleet.sinks.reply import ReplyListWriter
from embedfleet.workers.dead_letter_writer import Rejected
from embedfleet.workers.model.encoder import Tokenized
from embedfleet.workers.outages import (
    RideOut,
    classify_sink_error,
    ride_out,
    transient_or_raise,
)
from embedfleet.workers.parts import StageParts

log = get_logger("embedfleet.worker")
T = TypeVar("T")
_TRUNCATED = operator.attrgetter("truncated")  # a Tokenized's flag, read in C over a batch


def picked(items: Sequence[T], rows: list[int]) -> Sequence[T]:
    """``[items[row] for row in rows]``, for ``rows`` ascending and distinct (all the writer
    ever picks): ``items`` itself where those are all its rows (a batch's usual case), a
    DenseResults' own columns where it is one, so no Result is made per row to be packed
    (issue 53: the CPU a GPU host spends per text)."""
    if len(rows) == len(items):
        return items
    if isinstance(items, DenseResults):
        return cast(Sequence[T], items.take(rows))
    return [items[row] for row in rows]


@dataclass
class Encoded:
    """One batch the compute stage hands to the writer."""

    chunks: list[Chunk]
    deliveries: list[Delivery]
    tokens: list[Tokenized]
    vectors: np.ndarray
    # each chunk's content key, for the vector cache to store its vector under (None: not)
    content_keys: list[str | None] = field(default_factory=list)
    # the results of chunks the vector cache answered: written as they are, no model ran
    cached: list[Result] | None = None


class Writer:
    """The write stage: results to the sink or the reply lists, acknowledged, released."""

    def __init__(self, parts: StageParts) -> None:
        self.parts = parts
        # the gateway's chunks: their results go back to the caller's reply list
        self.replies = ReplyListWriter(parts.client, parts.keys, parts.settings.job_reply_ttl_s)

    async def run(self, encoded: asyncio.Queue[Encoded | None]) -> None:
        """Write what ``encoded`` brings until its end (None: the compute stage has finished)."""
        while (item := await encoded.get()) is not None:
            results = await self._results_of(item)
            started = time.perf_counter()
            written = 0
            # chunks with a reply (the gateway's) go back to their caller, the rest to the sink
            replied = [row for row, chunk in enumerate(item.chunks) if chunk.reply is not None]
            sunk = (  # (most batches have no reply: all rows, without a second pass)
                [row for row, chunk in enumerate(item.chunks) if chunk.reply is None]
                if replied
                else list(range(len(item.chunks)))
            )
            if sunk:
                written += await self._write(
                    picked(results, sunk),
                    picked(item.deliveries, sunk),
                    picked(item.chunks, sunk),
                    lambda results, deliveries, rows: self.parts.sink.write(results, deliveries),
                    self.parts.sink.system,
                )
            if replied:
                replies = [item.chunks[r].reply or "" for r in replied]

                def write_replies(
                    results: Sequence[Result],
                    deliveries: Sequence[Delivery],
                    rows: list[int],
                    replies: list[str] = replies,
                ) -> Awaitable[None]:
                    return self.replies.write(
                        results, deliveries, replies=[replies[i] for i in rows]
                    )

                written += await self._write(
                    picked(results, replied),
                    picked(item.deliveries, replied),
                    picked(item.chunks, replied),
                    write_replies,
                    System.REDIS,
                )
            if written:
                self.parts.events.results_written(
                    texts=written, seconds=time.perf_counter() - started
                )
            # acknowledged, or held by the sink until it is (in_flight keeps their leases then)
            self.parts.in_flight.release(item.deliveries)

    async def _results_of(self, item: Encoded) -> Sequence[Result]:
        """The batch's results: the vector cache's where it answered, else shaped from the
        model's vectors and remembered in the cache."""
        if item.cached is not None:  # answered by the vector cache: the results are ready
            return item.cached
        # int8/uint8 need the fleet's calibration; read (or made) once, then cached
        await ride_out(
            RideOut("reading the calibration", self.parts.outages, self.parts.events),
            System.REDIS,
            functools.partial(self.parts.outputs.prepare, item.chunks, self.parts.on_model_thread),
        )
        results = self.parts.outputs.results(
            item.chunks, item.vectors, list(map(_TRUNCATED, item.tokens))
        )
        # stored before the write: once the job has finished, its vectors are there
        await self._remember(item, results)
        return results

    async def _remember(self, item: Encoded, results: Sequence[Result]) -> None:
        """Store the vectors just embedded in the vector cache, under their content keys, each
        in its entry's key set. Before the write and its acknowledgement, so that a finished
        job's vectors are all there; a vector whose row the sink then refuses is still the
        model's vector for that content (a later hit is refused the same way). Redis failing
        here costs only the cache."""
        keyed = [(row, key) for row, key in enumerate(item.content_keys) if key is not None]
        if not keyed:
            return
        rows = [row for row, _ in keyed]
        # packed together: a batch's columns without a Result per row (issue 53)
        packed = pack_entries(picked(results, rows), [item.tokens[row].length for row in rows])
        by_owner: dict[Keys, list[tuple[str, bytes]]] = {}
        for (row, key), entry in zip(keyed, packed, strict=True):
            with contextlib.suppress(KeyError):  # (an entry of no key set this worker reads)
                owner = self.parts.keys.owner_of(item.deliveries[row].stream)
                by_owner.setdefault(owner, []).append((key, entry))
        for owner, entries in by_owner.items():
            try:
                await self.parts.vector_cache.store(owner, entries)
            except Exception as error:
                transient_or_raise(error, System.REDIS)
                log.warning("vector cache not written", error=str(error), vectors=len(entries))

    async def _write(
        self,
        results: Sequence[Result],
        deliveries: Sequence[Delivery],
        chunks: Sequence[Chunk],
        write: Callable[[Sequence[Result], Sequence[Delivery], list[int]], Awaitable[None]],
        system: System,
    ) -> int:
        """Write a batch with ``write`` (given the rows' results, deliveries and indices);
        returns how many results were written.

        By kind of fault (shared/fault_kinds.py): transient ones are waited out, however long;
        a refused row is found by halving the batch (each half written on its own) and
        dead-lettered alone with the database's message; any other fault is tried
        ``sink_retries`` times (a fault not known to pass might still) and then stops the
        worker with a WorkerFault naming the setting.
        """
        ride = RideOut(
            "writing results", self.parts.outages, self.parts.events, base_s=0.5, cap_s=10.0
        )
        written = 0
        failures = 0
        todo = [list(range(len(results)))]  # index lists still to write, last first
        while todo:
            rows = todo.pop()
            try:
                await write(picked(results, rows), picked(deliveries, rows), rows)
            except Exception as error:
                fault = classify_sink_error(error, system)
                if fault.system is not System.REDIS:
                    self.parts.events.sink_error(error=error, kind=fault.kind.value)
                todo.append(rows)  # until decided otherwise, it is still to write
                if fault.kind is FaultKind.TRANSIENT:
                    await ride.wait(fault)
                elif fault.kind is FaultKind.ROW and len(rows) > 1:
                    todo.pop()
                    self.parts.events.row_isolated(rows=len(rows))
                    half = len(rows) // 2
                    todo += [rows[half:], rows[:half]]
                elif fault.kind is FaultKind.ROW:
                    if await self._refuse_row(deliveries[rows[0]], chunks[rows[0]], fault, ride):
                        todo.pop()
                else:
                    failures += 1
                    await self._retry_later(fault, error, failures, ride)
                continue
            ride.succeeded()
            written += len(rows)
        return written

    async def _refuse_row(
        self, delivery: Delivery, chunk: Chunk, fault: Fault, ride: RideOut
    ) -> bool:
        """Dead-letter the one row the database refused, with its message: False when Redis
        failed meanwhile (waited out; the row is tried again)."""
        detail = f"{fault.system} refused the row: {fault.detail}"
        refused = Rejected.chunk(delivery, chunk, DeadReason.SINK_REFUSED, detail)
        try:
            await self.parts.dead_letters.send([refused])
            self.parts.in_flight.release([refused])
        except Exception as redis_error:  # the row is tried again after the wait
            await ride.wait(transient_or_raise(redis_error, System.REDIS))
            return False
        return True

    async def _retry_later(
        self, fault: Fault, error: Exception, failures: int, ride: RideOut
    ) -> None:
        """A fault not known to pass: paused and tried again, until the ``failures``-th of
        EMBEDFLEET_SINK_RETRIES stops the worker with a WorkerFault naming the setting."""
        if failures >= self.parts.settings.sink_retries:
            raise WorkerFault.from_fault(fault, f"writing results ({failures} tries)") from error
        log.warning(
            "sink write failed, retrying",
            system=fault.system.value,
            error=fault.detail,
            tries=failures,
            of=self.parts.settings.sink_retries,
        )
        await ride.pause(fault)
