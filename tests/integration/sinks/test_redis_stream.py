"""The results stream sink (embedfleet/sinks/redis_stream.py) on a real Redis server: results
written and their entries acknowledged in one round trip, one delivery per result."""

from __future__ import annotations

import numpy as np
import pytest
import redis.asyncio as aioredis

from embedfleet.shared.fleet import read_fleet
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


async def test_a_large_batch_is_acknowledged_deleted_and_accounted_once(
    settings: Settings, client: aioredis.Redis
) -> None:
    """5,000 entries in one acknowledge.lua call (more than one of its XDEL slices of 4,096),
    of two tenants and the default one: every entry deleted, answered and counted in its job,
    and the usage summed per (tenant, model, job), tokens and model time zero left out. The
    same batch acknowledged again (a slow worker finishing entries another reclaimed) adds
    nothing: XACK said 0 for each."""
    keys = settings.keys
    count = 5_000
    await client.xgroup_create(keys.ingest, keys.group, id="0", mkstream=True)
    pipe = client.pipeline(transaction=False)
    for n in range(count):
        pipe.xadd(keys.ingest, {"c": str(n)})
    ids = await pipe.execute()
    await client.xreadgroup(keys.group, "w1", {keys.ingest: ">"}, count=count)
    tenants = ["acme", "globex", None]
    deliveries = [
        Delivery(
            keys.ingest,
            entry.decode(),
            "job-big",
            tenant=tenants[n % 3],
            model="m",
            tokens=n % 7,  # zero for every seventh: nothing to add for it
            model_us=10,
        )
        for n, entry in enumerate(ids)
    ]
    results = [
        Result(id=f"c{n}", model="m", job="job-big", vector=np.full(4, n % 5, dtype=np.float16))
        for n in range(count)
    ]
    sink = RedisStreamSink(client, keys)
    for _ in range(2):  # the second time: already acknowledged, so nothing again
        await sink.write(results, deliveries)
        assert await client.xlen(keys.ingest) == 0
        assert (await client.xpending(keys.ingest, keys.group))["pending"] == 0
        assert await client.xlen(keys.results) == count
        assert await client.hget(keys.job("job-big"), "done") == str(count).encode()
        usage = (await read_fleet(client, keys, usage=True)).usage
        expected = {
            tenant: (
                len(range(at, count, 3)),
                sum(n % 7 for n in range(at, count, 3)),
                10 * len(range(at, count, 3)),
            )
            for at, tenant in enumerate(tenants)
        }
        assert {u.tenant: (u.chunks, u.tokens, u.model_us) for u in usage} == expected
        assert {(u.model, u.job) for u in usage} == {("m", "job-big")}
