"""The default sink: results as msgpack entries on the results stream."""

from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio as aioredis

from embedfleet.shared.fault_kinds import System
from embedfleet.shared.keys import Keys
from embedfleet.shared.protocol import Result, encode_results
from embedfleet.workers.sinks.base import (
    Delivery,
    Sink,
    acknowledgement_pipeline,
    queue_acknowledgements,
)


class RedisStreamSink(Sink):
    """Results as msgpack entries on ``{ns}:results`` (each partition's own); ack + delete + job
    progress atomically.

    Both happen in one MULTI/EXEC round trip: either the results are written and the entries
    acknowledged, or neither (the entries are then redelivered).
    """

    system = System.REDIS

    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    async def write(self, results: Sequence[Result], deliveries: Sequence[Delivery]) -> None:
        if len(results) != len(deliveries):
            raise ValueError("one delivery per result")
        pipe = acknowledgement_pipeline(self.client, self.keys)
        payloads = encode_results(results)  # the batch packed at once (issue 29)
        queue_acknowledgements(pipe, self.keys, deliveries, counter="done", payloads=payloads)
        await pipe.execute()
