"""Where vectors go. A sink writes a batch of results and acknowledges their entries.

The acknowledgement belongs to the sink because only the sink knows when a write is durable.
For the Redis results stream both happen in one MULTI/EXEC round trip: either the results are
written and the entries acknowledged, or neither (the entries are then redelivered).
"""

from __future__ import annotations

import abc
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared.keys import Keys
from shared.protocol import PAYLOAD_FIELD, Result, encode_result


@dataclass(frozen=True)
class Delivery:
    """A stream entry being answered: where it came from, so it can be acknowledged."""

    stream: str
    entry_id: str
    job: str | None


class Sink(abc.ABC):
    """The sink interface: write results and acknowledge their entries, durably, together.

    The worker calls ``setup(dim)`` once after the model loads, ``write`` per micro-batch, and
    ``close`` on shutdown. ``write`` raising means nothing was acknowledged: the worker retries
    with backoff and dead-letters the batch after ``EMBEDFLEET_SINK_RETRIES`` tries.
    """

    async def setup(self, model: str, dim: int) -> None:  # noqa: B027 - optional hook
        """Create the collection/table if missing, with the model's dimension."""

    @abc.abstractmethod
    async def write(self, results: Sequence[Result], deliveries: Sequence[Delivery]) -> None:
        """Store ``results`` and only then acknowledge ``deliveries`` (same order, same length)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the default sink has nothing of its own."""


class RedisStreamSink(Sink):
    """Results as msgpack entries on ``{ns}:results``; ack + delete + job progress atomically."""

    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    async def write(self, results: Sequence[Result], deliveries: Sequence[Delivery]) -> None:
        if len(results) != len(deliveries):
            raise ValueError("one delivery per result")
        pipe = self.client.pipeline(transaction=True)
        for result in results:
            pipe.xadd(self.keys.results, {PAYLOAD_FIELD: encode_result(result)})
        queue_acknowledgements(pipe, self.keys, deliveries, counter="done")
        await pipe.execute()


def queue_acknowledgements(
    pipe: aioredis.client.Pipeline, keys: Keys, deliveries: Sequence[Delivery], counter: str
) -> None:
    """XACK and XDEL the entries (acknowledged entries must not pile up) and count per job.

    Deleting only delivered, acknowledged entries keeps the group's lag exact, which KEDA reads.
    """
    by_stream: dict[str, list[str]] = {}
    for delivery in deliveries:
        by_stream.setdefault(delivery.stream, []).append(delivery.entry_id)
    for stream, entry_ids in by_stream.items():
        pipe.xack(stream, keys.group, *entry_ids)
        pipe.xdel(stream, *entry_ids)
    for job, count in Counter(d.job for d in deliveries if d.job is not None).items():
        pipe.hincrby(keys.job(job), counter, count)
