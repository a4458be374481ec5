"""workers/heartbeat.py against a real Redis: a beat scores the worker by the time it beat and
drops names not seen for FORGET_AFTER_MS; a stopped heartbeat leaves the set at once."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from embedfleet.shared.settings import Settings
from embedfleet.workers.heartbeat import FORGET_AFTER_MS, beat, run_heartbeat


async def test_a_beat_scores_the_worker_and_forgets_the_long_silent(
    settings: Settings, client: aioredis.Redis
) -> None:
    alive = settings.keys.workers_alive
    long_ago = int(time.time() * 1000) - FORGET_AFTER_MS - 1_000
    await client.zadd(alive, {"killed": long_ago, "recent": int(time.time() * 1000)})
    before = int(time.time() * 1000)
    await beat(client, settings.keys, "w1")
    after = int(time.time() * 1000)
    members = dict(await client.zrange(alive, 0, -1, withscores=True))
    assert set(members) == {b"w1", b"recent"}, "the killed worker's name aged out"
    assert before <= members[b"w1"] <= after


async def test_a_stopped_heartbeat_leaves_the_set(
    settings: Settings, client: aioredis.Redis
) -> None:
    alive = settings.keys.workers_alive
    stopping = asyncio.Event()
    task = asyncio.create_task(run_heartbeat(client, settings.keys, "w1", stopping))
    async with asyncio.timeout(10):
        while await client.zscore(alive, "w1") is None:
            await asyncio.sleep(0.01)  # polling Redis for the first beat, not waiting blind
    stopping.set()
    await asyncio.wait_for(task, 10)
    assert await client.zscore(alive, "w1") is None
