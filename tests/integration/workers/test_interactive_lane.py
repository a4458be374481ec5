"""The interactive lane's reads against a real Redis: a large request someone waits on is read
before the next bulk batch, also in the seconds after bulk entries woke an idle worker.

The end-to-end promise (a gateway request answered before a bulk backlog drains) is
tests/end_to_end/test_gateway.py's; this pins the read that keeps it."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from embedfleet.shared.protocol import PAYLOAD_FIELD
from embedfleet.shared.settings import Settings
from embedfleet.workers.consumer import StreamConsumer
from tests.conftest import until_blocked

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
    request_id = await client.xadd(keys.query_lane.interactive, {PAYLOAD_FIELD: b"request"})
    handed = await client.xpending(keys.query_lane.interactive, keys.group)
    assert handed["pending"] == 1, "Redis handed it to the idle wait's blocked read"
    read: list = []
    try:
        async with asyncio.timeout(5):
            while not (read := await consumer.read_interactive(100)):
                await asyncio.sleep(0.01)  # the compute stage's next check, before a batch
    except TimeoutError:
        pytest.fail("the request the idle wait's read was handed is left for a window later")
    assert [(entry.stream, entry.entry_id) for entry in read] == [
        (keys.query_lane.interactive, request_id.decode())
    ]
    assert await consumer.read_interactive(100) == [], "read once, not twice"
    await client.xadd(keys.query_lane.interactive, {PAYLOAD_FIELD: b"next"})
    assert len(await consumer.read_interactive(100)) == 1, "later ones: a non-blocking read"
    consumer.abandon_waiting()
