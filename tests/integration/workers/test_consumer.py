"""workers/consumer.py's reads (StreamConsumer) against a real Redis.

EMBEDFLEET_READ_MAX_BYTES (issue 54, fault 4): a bulk read stops at the bytes bound
(shared/scripts/read_bounded.lua), the rest is read by the reads after, each entry once, and an
entry over the whole bound is read alone. A worker's memory on long texts:
tests/end_to_end/test_worker_memory.py.

The interactive stream's reads: a large request someone waits on is read before the next bulk
batch, also in the seconds after bulk entries woke an idle worker. The end-to-end promise (a
gateway request answered before a bulk backlog drains) is tests/end_to_end/test_gateway.py's;
this pins the read that keeps it."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from embedfleet.producer import Producer
from embedfleet.shared.protocol import PAYLOAD_FIELD, Chunk
from embedfleet.shared.settings import Settings
from embedfleet.workers.consumer import StreamConsumer
from tests.conftest import until_blocked


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


async def test_a_bounded_read_gives_each_entry_as_xreadgroup_does(
    settings: Settings, client: aioredis.Redis
) -> None:
    """read_bounded.lua's flat reply (an entry with its payload alone is its payload; any other,
    its fields) gives the entries, payloads and fields an unbounded read gives."""
    from embedfleet.shared.migrations import COPIED_FROM

    stream = settings.keys.ingest
    await client.xadd(stream, {PAYLOAD_FIELD: b"plain"})
    await client.xadd(stream, {PAYLOAD_FIELD: b"copied", COPIED_FROM: b"old-table"})
    await client.xadd(stream, {"text": b"no payload field"})
    await client.xadd(stream, {PAYLOAD_FIELD: b""})
    expected = [(entry_id.decode(), fields) for entry_id, fields in await client.xrange(stream)]
    bounded = StreamConsumer(client, settings.keys, "reader", max_read_bytes=1_000)
    await bounded.setup()
    entries = await bounded.read_ingest(100, block_ms=10)
    await bounded.finish_waiting()
    assert [(e.entry_id, e.fields) for e in entries] == expected
    assert [e.payload for e in entries] == [b"plain", b"copied", None, b""]
    assert {e.stream for e in entries} == {stream}


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


# long enough that the idle wait's interactive read is surely still blocked when the request
# comes (the fault: Redis hands the request to that read, which nobody collects for a window)
BLOCK_MS = 20_000


async def test_a_request_after_bulk_woke_an_idle_worker_is_read_before_the_next_batch(
    settings: Settings, client: aioredis.Redis
) -> None:
    keys = settings.keys
    consumer = StreamConsumer(client, keys, "reader")
    await consumer.setup()  # the group on every stream it reads, the interactive one too
    # idle: one blocking read on the interactive stream, one on the partition's streams
    idle = asyncio.create_task(consumer.read_ingest(100, BLOCK_MS))
    await until_blocked(client, "xreadgroup", count=2)
    await client.xadd(keys.ingest, {PAYLOAD_FIELD: b"bulk"})
    bulk = await asyncio.wait_for(idle, 10)
    assert [entry.stream for entry in bulk] == [keys.ingest]
    assert await consumer.read_interactive(100) == [], "nothing came yet, and it did not wait"

    # the request comes while the worker encodes that bulk window
    request_id = await client.xadd(keys.priority_streams.interactive, {PAYLOAD_FIELD: b"request"})
    handed = await client.xpending(keys.priority_streams.interactive, keys.group)
    assert handed["pending"] == 1, "Redis handed it to the idle wait's blocked read"
    read: list = []
    try:
        async with asyncio.timeout(5):
            while not (read := await consumer.read_interactive(100)):
                await asyncio.sleep(0.01)  # the compute stage's next check, before a batch
    except TimeoutError:
        pytest.fail("the request the idle wait's read was handed is left for a window later")
    assert [(entry.stream, entry.entry_id) for entry in read] == [
        (keys.priority_streams.interactive, request_id.decode())
    ]
    assert await consumer.read_interactive(100) == [], "read once, not twice"
    await client.xadd(keys.priority_streams.interactive, {PAYLOAD_FIELD: b"next"})
    assert len(await consumer.read_interactive(100)) == 1, "later ones: a non-blocking read"
    consumer.abandon_waiting()
