"""The Parquet sink: results buffered into shards, each stored atomically, then acknowledged.

``EMBEDFLEET_SINK=parquet:///dir`` or ``s3://bucket/prefix``; the layout, the atomic write and
the reader are in ``embedfleet/sinks/parquet/dataset.py``. A shard is cut when it holds
EMBEDFLEET_PARQUET_SHARD_ROWS rows or EMBEDFLEET_PARQUET_SHARD_BYTES bytes, or when its first row
is EMBEDFLEET_PARQUET_SHARD_MAX_S old (a timer here, so an idle stream still gets its last shard).

The Sink contract is "write, then acknowledge". This sink keeps it per shard instead of per
micro-batch: ``write`` only converts and buffers, and the deliveries stay unacknowledged (pending
in the group) until their shard is durable; then they are acknowledged, and counted done for
their job, in one round trip. A worker killed meanwhile leaves them pending, to be claimed by
another worker once idle for EMBEDFLEET_RECLAIM_IDLE_MS: no chunk is lost, and no partial shard
is visible. Until then the sink is ``holding`` them (buffered, being stored, or stored and not yet
acknowledged), and the worker keeps renewing their leases as for the entries it computes: an
outage of the folder or S3, however long, is waited out, and nothing is claimed back, embedded
again or dead-lettered for it (issue 40). An entry redelivered after its shard was written but
before the acknowledgement (a worker killed in between) lands twice in the dataset; readers keep
the last row per id.

A failed write raises from ``write`` (the worker waits out a passing fault and tries again; its
rows are buffered already, so nothing is added twice) or, for a shard cut by the timer, is logged
and tried again with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import redis.asyncio as aioredis

from embedfleet.shared.fault_kinds import System
from embedfleet.shared.keys import Keys
from embedfleet.shared.logging import get_logger
from embedfleet.shared.protocol import Result
from embedfleet.sinks.backend import VectorDType
from embedfleet.sinks.parquet.dataset import ParquetBackend
from embedfleet.sinks.sink import (
    DatabaseSink,
    Delivery,
    acknowledgement_pipeline,
    latest_per_id,
    queue_acknowledgements,
)

if TYPE_CHECKING:
    import pyarrow as pa

    from embedfleet.sinks.store import SinkParts

log = get_logger("embedfleet.sink")
# a shard the timer failed to store is tried again after this, doubling up to the cap
RETRY_BASE_S = 0.5
RETRY_CAP_S = 10.0


class ParquetSink(DatabaseSink):
    """Buffers results into shards of a ``ParquetBackend``; acknowledges per stored shard."""

    system = System.PARQUET

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        backend: ParquetBackend,
        *,
        writer: str,
        shard_rows: int,
        shard_bytes: int,
        shard_max_s: float,
        dtype: VectorDType | None = None,
    ) -> None:
        super().__init__(client, keys, backend, dtype=dtype)
        self.system = System.PARQUET
        self.parquet = backend
        self.writer = writer
        self.shard_rows = shard_rows
        self.shard_bytes = shard_bytes
        self.shard_max_s = shard_max_s
        self._tables: list[pa.Table] = []
        # the shard's deliveries by (stream, entry id): a write tried again after a failed
        # flush brings the same entries, which are buffered already
        self._held: dict[tuple[str, str], Delivery] = {}
        self._rows = 0
        self._bytes = 0
        self._started: float | None = None  # time.monotonic() of the shard's first row
        # the deliveries of the shard being stored, then of a stored shard until their
        # acknowledgement has gone through
        self._writing: dict[tuple[str, str], Delivery] = {}
        self._unacked: dict[tuple[str, str], Delivery] = {}
        self._flushing = asyncio.Lock()
        self._shard_started = asyncio.Event()
        self._timer: asyncio.Task[None] | None = None
        self.shards_written = 0

    @property
    def buffered(self) -> int:
        """Rows in the shard being filled."""
        return self._rows

    def holding(self) -> list[Delivery]:
        return [*self._held.values(), *self._writing.values(), *self._unacked.values()]

    def holds(self, stream: str, entry_id: str) -> bool:
        key = (stream, entry_id)
        return key in self._held or key in self._writing or key in self._unacked

    async def write(self, results: Sequence[Result], deliveries: Sequence[Delivery]) -> None:
        if len(results) != len(deliveries):
            raise ValueError("one delivery per result")
        new = [
            (result, delivery)
            for result, delivery in zip(results, deliveries, strict=True)
            if (key := (delivery.stream, delivery.entry_id)) not in self._held
            and key not in self._writing
            and key not in self._unacked
        ]
        if new:
            # converted now, so that a row the shard cannot take is refused with its own batch
            # (the worker isolates and dead-letters it), not when the shard is cut
            table = self.parquet.rows(latest_per_id([result for result, _ in new]))
            self._tables.append(table)
            self._held.update({(d.stream, d.entry_id): d for _, d in new})
            self._rows += table.num_rows
            self._bytes += table.nbytes
            if self._started is None:
                self._started = time.monotonic()
                self._shard_started.set()
                log.info("parquet shard started", rows=table.num_rows, writer=self.writer)
            self._ensure_timer()
        if self._rows >= self.shard_rows or self._bytes >= self.shard_bytes or self._unacked:
            await self.flush()

    async def flush(self) -> None:
        """Store the shard being filled (if any) and acknowledge its entries."""
        async with self._flushing:
            await self._acknowledge()  # a stored shard whose acknowledgement failed, first
            if not self._held:
                return
            # The shard is taken out of the buffer before it is stored: writes that come while
            # it uploads start the next one. Until it is stored, its entries are ``_writing``.
            tables, rows, started = self._tables, self._rows, self._started
            self._writing = self._held
            self._tables, self._held, self._rows, self._bytes = [], {}, 0, 0
            self._started = None
            self._shard_started.clear()
            try:
                manifest = await self._blocking(self.parquet.write_shard, tables, self.writer)
            except BaseException:
                # not stored: back in front of what came meanwhile, to be tried again
                self._tables = tables + self._tables
                self._held = {**self._writing, **self._held}
                self._rows = sum(table.num_rows for table in self._tables)
                self._bytes = sum(table.nbytes for table in self._tables)
                self._started = started
                self._shard_started.set()
                self._writing = {}
                raise
            # durable: from here the entries only need their acknowledgement
            held, self._writing = self._writing, {}
            self._unacked.update(held)
            self.shards_written += 1
            age = 0.0 if started is None else time.monotonic() - started
            log.info(
                "parquet shard written",
                file=manifest.file,
                rows=rows,
                bytes=manifest.size_bytes,
                age_s=round(age, 3),
                entries=len(held),
            )
            await self._acknowledge()

    async def _acknowledge(self) -> None:
        if not self._unacked:
            return
        deliveries = list(self._unacked.values())
        pipe = acknowledgement_pipeline(self.client, self.keys)
        queue_acknowledgements(pipe, self.keys, deliveries, counter="done")
        await pipe.execute()
        self._unacked.clear()

    def _ensure_timer(self) -> None:
        if self._timer is None or self._timer.done():
            self._timer = asyncio.create_task(self._flush_when_due(), name="parquet-shard-timer")

    async def _flush_when_due(self) -> None:
        """Cut the shard once its first row is EMBEDFLEET_PARQUET_SHARD_MAX_S old."""
        failures = 0
        while True:
            await self._shard_started.wait()
            started = self._started
            if started is None:  # cut by size meanwhile
                self._shard_started.clear()
                continue
            left = started + self.shard_max_s - time.monotonic()
            if left > 0:
                await asyncio.sleep(left)  # a deadline, not a wait for some other task
                continue
            try:
                await self.flush()
                failures = 0
            except Exception as error:
                failures += 1
                pause = min(RETRY_CAP_S, RETRY_BASE_S * 2 ** (failures - 1))
                log.warning(
                    "parquet shard not written, retrying",
                    error=f"{type(error).__name__}: {error}",
                    tries=failures,
                    retry_in_s=pause,
                )
                await asyncio.sleep(pause)

    async def close(self) -> None:
        """Store what is buffered (a drain's last shard); if that fails its entries stay
        pending, for another worker to claim."""
        if self._timer is not None:
            async with self._flushing:  # never cancelled halfway through storing a shard
                self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
            self._timer = None
        try:
            await self.flush()
        except Exception as error:
            log.error(
                "parquet shard not written at shutdown: its entries stay pending and will be "
                "reclaimed by another worker",
                error=f"{type(error).__name__}: {error}",
                rows=self._rows,
            )
        await super().close()


def parquet_sink(parts: SinkParts) -> ParquetSink:
    """The worker's Parquet sink, its shards sized by the EMBEDFLEET_PARQUET_SHARD_* settings."""
    backend, settings = parts.backend, parts.settings
    assert isinstance(backend, ParquetBackend)  # the store's backend class
    if settings.parquet_shard_rows * 2 > settings.backlog_high_water:
        # A shard's entries stay in the ingest stream until it is written, and the producer
        # counts them against the mark: with shards this large it waits for every shard,
        # and the fleet runs at about high_water / shard_max_s (measured: loadtest.drain).
        log.warning(
            "parquet shards hold more than half the backlog mark: producers will wait for "
            "each shard. Lower EMBEDFLEET_PARQUET_SHARD_ROWS or raise "
            "EMBEDFLEET_BACKLOG_HIGH_WATER",
            shard_rows=settings.parquet_shard_rows,
            high_water=settings.backlog_high_water,
            at_most_per_s=round(settings.backlog_high_water / settings.parquet_shard_max_s),
        )
    return ParquetSink(
        parts.client,
        settings.keys,
        backend,
        writer=settings.consumer,
        shard_rows=settings.parquet_shard_rows,
        shard_bytes=settings.parquet_shard_bytes,
        shard_max_s=settings.parquet_shard_max_s,
        dtype=parts.dtype,
    )
