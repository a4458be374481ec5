"""The default sink: results as msgpack entries on the results stream, bounded.

The results stream is a hand-off to its readers, not a store: ``EMBEDFLEET_RESULTS_MAX_ENTRIES``
bounds what each partition's stream may hold. The length is read in the write's own round trip
(no extra one per batch); once a stream is at the bound, the next write to it waits, saying so
in the log, until a consuming reader has drained it below (producer/results_reader.py), as
producers wait at the backlog's high-water mark. The entries the worker holds meanwhile keep
their leases (the reclaimer renews them), its pipeline fills and it stops reading: nothing more
is taken from the backlog until the results move on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import redis.asyncio as aioredis

from embedfleet.shared.fault_kinds import System
from embedfleet.shared.keys import Keys
from embedfleet.shared.logging import get_logger
from embedfleet.shared.protocol import Result, encode_results
from embedfleet.sinks.sink import (
    Delivery,
    Sink,
    acknowledgement_pipeline,
    queue_acknowledgements,
)
from embedfleet.sinks.store import SinkParts, Store
from embedfleet.sinks.target import SinkTarget, SinkURL, SinkURLError

log = get_logger("embedfleet.sink")
# how often a worker at the bound reads the stream's length again
ROOM_POLL_S = 0.25


class RedisStreamSink(Sink):
    """Results as msgpack entries on ``{ns}:results`` (each partition's own); ack + delete + job
    progress atomically.

    Both happen in one MULTI/EXEC round trip: either the results are written and the entries
    acknowledged, or neither (the entries are then redelivered). ``max_entries`` (0: none) is
    the bound on each results stream (``EMBEDFLEET_RESULTS_MAX_ENTRIES``).
    """

    system = System.REDIS

    def __init__(self, client: aioredis.Redis, keys: Keys, max_entries: int = 0) -> None:
        self.client = client
        self.keys = keys
        self.max_entries = max_entries
        self._lengths: dict[str, int] = {}  # each results stream's length at the last write
        self.waiting = False  # at the bound now (tests and the log read it)
        self.waits = 0  # times a write waited for room

    async def write(self, results: Sequence[Result], deliveries: Sequence[Delivery]) -> None:
        if len(results) != len(deliveries):
            raise ValueError("one delivery per result")
        streams = sorted(
            {self.keys.owner_of(stream).results for stream in {d.stream for d in deliveries}}
        )
        if self.max_entries:
            await self._wait_for_room(streams)
        pipe = acknowledgement_pipeline(self.client, self.keys)
        payloads = encode_results(results)  # the batch packed at once (issue 29)
        queue_acknowledgements(pipe, self.keys, deliveries, counter="done", payloads=payloads)
        if self.max_entries:
            for stream in streams:
                pipe.xlen(stream)
        replies = await pipe.execute()
        if self.max_entries:
            for stream, length in zip(streams, replies[-len(streams) :], strict=True):
                self._lengths[stream] = int(length)

    async def _wait_for_room(self, streams: list[str]) -> None:
        full = [s for s in streams if self._lengths.get(s, 0) >= self.max_entries]
        if not full:
            return
        started = time.monotonic()
        self.waiting = True
        self.waits += 1
        log.warning(
            "results stream at its bound: waiting for a reader to drain it "
            "(embedfleet results --consume)",
            streams=full,
            length=max(self._lengths[s] for s in full),
            max_entries=self.max_entries,
            setting="EMBEDFLEET_RESULTS_MAX_ENTRIES",
        )
        try:
            while full:
                await asyncio.sleep(ROOM_POLL_S)
                pipe = self.client.pipeline(transaction=False)
                for stream in full:
                    pipe.xlen(stream)
                for stream, length in zip(full, await pipe.execute(), strict=True):
                    self._lengths[stream] = int(length)
                full = [s for s in full if self._lengths[s] >= self.max_entries]
        finally:
            self.waiting = False
        log.info(
            "results stream below its bound again", waited_s=round(time.monotonic() - started, 1)
        )


def _results_target(url: SinkURL) -> SinkTarget:
    if url.rest:
        raise SinkURLError(
            f"EMBEDFLEET_SINK={url.url!r}: the redis sink writes to the queue's own server "
            "(EMBEDFLEET_REDIS_URL); set EMBEDFLEET_SINK=redis"
        )
    return STORE.target("", url.table)


def _results_sink(parts: SinkParts) -> Sink:
    return RedisStreamSink(parts.client, parts.settings.keys, parts.settings.results_max_entries)


STORE = Store(
    kind="redis",
    word="redis",
    schemes=("redis", "rediss"),
    forms="redis (the results stream)",
    describe="the Redis results stream",
    parse=_results_target,
    sink=_results_sink,
)
