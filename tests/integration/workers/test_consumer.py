"""EMBEDFLEET_READ_MAX_BYTES against a real Redis (issue 54, fault 4): a bulk read stops at the
bytes bound (shared/scripts/read_bounded.lua), the rest is read by the reads after, each entry
once, and an entry over the whole bound is read alone. A worker's memory on long texts:
tests/end_to_end/test_worker_memory.py."""

from __future__ import annotations

import redis.asyncio as aioredis

from embedfleet.producer import Producer
from embedfleet.shared.protocol import PAYLOAD_FIELD, Chunk
from embedfleet.shared.settings import Settings
from embedfleet.workers.consumer import StreamConsumer


def sized(prefix: str, count: int, chars: int) -> list[Chunk]:
    return [Chunk(id=f"{prefix}{i}", text=f"{i:04d}" + "x" * (chars - 4)) for i in range(count)]


async def read_all(consumer: StreamConsumer, count: int = 100) -> list[list[str]]:
    """Every read until one comes back empty: each read's chunk ids' payload sizes."""
    reads = []
    while entries := await consumer.read_ingest(count, block_ms=10):
        reads.append([entry.entry_id for entry in entries])
    await consumer.finish_waiting()
    return reads


async def test_a_read_stops_at_its_bytes_and_the_rest_follows(
    settings: Settings, client: aioredis.Redis
) -> None:
    """Ten entries of ~1,050 payload bytes, a bound of 3,500: reads of 3, 3, 3, 1, every entry
    once; before, one read took all ten (the count alone bounded it)."""
    async with Producer(settings, client) as producer:
        await producer.enqueue(sized("a", 10, 1_000), job="bytes")
    sizes = [len(fields[PAYLOAD_FIELD]) for _, fields in await client.xrange(settings.keys.ingest)]
    assert all(1_000 < size < 1_150 for size in sizes), sizes
    consumer = StreamConsumer(client, settings.keys, "reader", max_read_bytes=3_500)
    await consumer.setup()
    reads = await read_all(consumer)
    assert [len(read) for read in reads] == [3, 3, 3, 1]
    ids = [entry_id for read in reads for entry_id in read]
    assert len(set(ids)) == 10
    pending = await client.xpending(settings.keys.ingest, settings.group)
    assert pending["pending"] == 10, "delivered to the reader as XREADGROUP delivers them"


async def test_an_entry_over_the_whole_bound_is_read_alone(
    settings: Settings, client: aioredis.Redis
) -> None:
    async with Producer(settings, client) as producer:
        await producer.enqueue(sized("long", 2, 5_000) + sized("short", 2, 100), job="bytes")
    consumer = StreamConsumer(client, settings.keys, "reader", max_read_bytes=3_000)
    await consumer.setup()
    assert [len(read) for read in await read_all(consumer)] == [1, 1, 2]


async def test_tenants_share_the_bytes_by_their_entries(
    settings: Settings, client: aioredis.Redis
) -> None:
    """Two tenants of equal weight, a bound of 4,400 bytes: each stream's part is half, two
    entries of ~1,050 bytes each; every entry is read once."""
    async with Producer(settings, client) as producer:
        await producer.enqueue(sized("a", 6, 1_000), job="ja", tenant="a")
        await producer.enqueue(sized("b", 6, 1_000), job="jb", tenant="b")
    consumer = StreamConsumer(
        client, settings.keys, "reader", policy=settings.tenant_policy, max_read_bytes=4_400
    )
    await consumer.setup()
    reads = await read_all(consumer)
    assert len(reads[0]) == 4
    assert sum(len(read) for read in reads) == 12
