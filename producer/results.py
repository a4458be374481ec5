"""Reading the results streams back: every result in order (a read that leaves them there), or
drained page by page through a consuming ``ResultsReader`` (producer/results_reader.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from embedfleet.producer.lane import ProducerLane
from embedfleet.producer.results_reader import ResultsReader
from embedfleet.shared.protocol import PAYLOAD_FIELD, Result, decode_result
from embedfleet.shared.redis_conn import stream_entries


class Results:
    """The results streams of one producer lane."""

    def __init__(self, lane: ProducerLane) -> None:
        self.lane = lane

    def reader(self, *, consumer: str | None = None, page: int = 1000) -> ResultsReader:
        """A consuming reader of the results streams, page by page (``next_page`` /
        ``acknowledge``), for callers that acknowledge only once a page is stored."""
        lane = self.lane
        return ResultsReader(
            lane.client,
            lane.keys,
            lane.retry,
            consumer=consumer,
            page=page,
            claim_idle_ms=lane.settings.results_claim_idle_ms,
        )

    async def read(
        self, *, job: str | None, page: int, consume: bool, consumer: str | None
    ) -> AsyncIterator[Result]:
        """Every result in the results streams (optionally one job's), oldest first within each
        partition, one partition after the other.

        A chunk enqueued twice (a changed text, a re-sent chunk without a job) has its id
        written twice; callers that need one vector per id keep the last (a chunk id always
        routes to the same partition, so its copies are in one stream).

        ``consume``: drain the streams instead of only reading them (producer/results_reader.py):
        each page is acknowledged and deleted once the loop asks for the next one, several
        readers share the work, and results a crashed reader held are claimed after
        EMBEDFLEET_RESULTS_CLAIM_IDLE_MS. Ends when nothing is left on the streams or pending.
        A consuming read takes every job's results (``job`` must be None); ``consumer`` names
        this reader in the group (default: host, pid and a random suffix).
        """
        await self.lane.routed()
        if consume:
            if job is not None:
                raise ValueError(
                    "a consuming read takes every job's results: filter them yourself, or read "
                    "one job without consuming"
                )
            reader = self.reader(consumer=consumer, page=page)
            try:
                async for result in reader.consume():
                    yield result
            finally:
                await reader.close()
            return
        for partition in self.lane.keys.partitions_keys:
            async for result in self._partition(partition.results, job, page):
                yield result

    async def _partition(self, key: str, job: str | None, page: int) -> AsyncIterator[Result]:
        """One partition's results stream, read page by page without consuming it."""
        start = "-"
        while True:

            async def read_page(start: str = start) -> object:
                return await self.lane.client.xrange(key, min=start, count=page)

            # Paged by entry id, so a page read again after a fault is the same page.
            entries = stream_entries(await self.lane.retry.call("read results", read_page))
            if not entries:
                break
            for _, fields in entries:
                result = decode_result(fields[PAYLOAD_FIELD])
                if job is None or result.job == job:
                    yield result
            start = "(" + entries[-1][0].decode()
            if len(entries) < page:
                break
