"""The results stream sink (embedfleet/sinks/redis_stream.py) on a real Redis server: results
written and their entries acknowledged in one round trip, one delivery per result."""

from __future__ import annotations

import numpy as np
import pytest
import redis.asyncio as aioredis

from embedfleet.shared.protocol import Result, decode_result
from embedfleet.shared.settings import Settings
from embedfleet.sinks.redis_stream import RedisStreamSink
from embedfleet.sinks.sink import Delivery


async def test_results_are_written_and_their_entries_acknowledged(
    settings: Settings, client: aioredis.Redis
) -> None:
    keys = settings.keys
    await client.xgroup_create(keys.ingest, keys.group, id="0", mkstream=True)
    ids = [await client.xadd(keys.ingest, {"c": str(n)}) for n in range(3)]
    await client.xreadgroup(keys.group, "w1", {keys.ingest: ">"})
    deliveries = [Delivery(keys.ingest, entry.decode(), "job-9") for entry in ids]
    results = [
        Result(id=f"c{n}", model="m", job="job-9", vector=np.full(4, n, dtype=np.float16))
        for n in range(3)
    ]
    sink = RedisStreamSink(client, keys)
    with pytest.raises(ValueError, match="one delivery per result"):
        await sink.write(results, deliveries[:2])
    await sink.write(results, deliveries)
    written = await client.xrange(keys.results)
    stored = [decode_result(fields[b"m"]) for _, fields in written]  # field m: the message
    assert [(r.id, r.vector.tolist()) for r in stored] == [
        (f"c{n}", [float(n)] * 4) for n in range(3)
    ]
    assert (await client.xpending(keys.ingest, keys.group))["pending"] == 0
    assert await client.hget(keys.job("job-9"), "done") == b"3"
