"""Consumer-group creation: at id 0, before any read, idempotent, whichever side comes first."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from embedfleet.producer import Producer
from embedfleet.shared.protocol import PAYLOAD_FIELD, Chunk, encode_chunk
from embedfleet.shared.redis_conn import connect, ensure_group
from embedfleet.shared.settings import Settings
from embedfleet.workers.consumer import StreamConsumer
from tests.conftest import until_blocked


async def test_concurrent_creation_creates_exactly_once(settings: Settings) -> None:
    clients = [connect(settings.effective_redis_url) for _ in range(16)]
    try:
        created = await asyncio.gather(
            *(ensure_group(c, settings.keys, settings.keys.ingest) for c in clients)
        )
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    assert created.count(True) == 1
    async with Producer(settings) as producer:
        groups = await producer.client.xinfo_groups(settings.keys.ingest)
    assert [g["name"].decode() for g in groups] == [settings.group]


async def test_producers_and_workers_racing_all_succeed(settings: Settings) -> None:
    producers = [Producer(settings) for _ in range(4)]
    consumers = [
        StreamConsumer(connect(settings.effective_redis_url), settings.keys, f"c{i}")
        for i in range(4)
    ]
    try:
        await asyncio.gather(*(p.setup() for p in producers), *(c.setup() for c in consumers))
        # one group, at id 0, on every stream the two sides set up; a producer can enqueue and a
        # worker read it afterwards
        for stream in (settings.keys.ingest, settings.keys.query):
            groups = await producers[0].client.xinfo_groups(stream)
            assert [(g["name"].decode(), g["last-delivered-id"]) for g in groups] == [
                (settings.group, b"0-0")
            ]
        await producers[0].enqueue([Chunk("raced", "hello")])
        entries = await consumers[0].read(count=10, block_ms=1000)
        assert [e.stream for e in entries] == [settings.keys.ingest]
    finally:
        await asyncio.gather(*(p.close() for p in producers))
        await asyncio.gather(*(c.client.aclose() for c in consumers))


async def test_entries_added_before_the_group_exists_are_read(
    settings: Settings, client: aioredis.Redis
) -> None:
    # A producer that never called setup(): plain XADD by hand, as another language would.
    await client.xadd(settings.keys.ingest, {PAYLOAD_FIELD: encode_chunk(Chunk("early", "hi"))})
    consumer = StreamConsumer(client, settings.keys, "late-worker")
    await consumer.setup()
    entries = await consumer.read(count=10, block_ms=100)
    assert [e.payload for e in entries] == [encode_chunk(Chunk("early", "hi"))]
    info = await client.xinfo_groups(settings.keys.ingest)
    assert info[0]["pending"] == 1


async def test_blocking_read_wakes_on_a_query(settings: Settings, client: aioredis.Redis) -> None:
    consumer = StreamConsumer(client, settings.keys, "w")
    await consumer.setup()
    other = connect(settings.effective_redis_url)
    try:
        reader = asyncio.create_task(consumer.read(count=10, block_ms=5000))
        # the server says when the read is blocked: it must be, for the wake-up to mean anything
        await until_blocked(other, "xreadgroup")
        await other.xadd(settings.keys.query, {PAYLOAD_FIELD: encode_chunk(Chunk("q", "find"))})
        entries = await asyncio.wait_for(reader, timeout=2)
    finally:
        await other.aclose()
    assert [e.stream for e in entries] == [settings.keys.query]
