"""The worker's heartbeat: its consumer name in ``{ns}:workers``, scored by the time it last
beat, so the gateway (and anyone with redis-cli) can count live workers with one ZCOUNT."""

from __future__ import annotations

import asyncio
import contextlib
import time

import redis.asyncio as aioredis

from embedfleet.shared.fault_kinds import is_transient
from embedfleet.shared.keys import Keys
from embedfleet.shared.logging import get_logger

log = get_logger("embedfleet.worker")
HEARTBEAT_PERIOD_S = 1.0
# Members not seen for this long are dropped by whoever beats next (a killed worker's name)
FORGET_AFTER_MS = 10 * 60 * 1000


async def beat(client: aioredis.Redis, keys: Keys, consumer: str) -> None:
    now_ms = int(time.time() * 1000)
    pipe = client.pipeline(transaction=False)
    pipe.zadd(keys.workers_alive, {consumer: now_ms})
    pipe.zremrangebyscore(keys.workers_alive, "-inf", now_ms - FORGET_AFTER_MS)
    await pipe.execute()


async def run_heartbeat(
    client: aioredis.Redis, keys: Keys, consumer: str, stopping: asyncio.Event
) -> None:
    """Beat every second until ``stopping``; then leave the set, so a drained worker stops
    counting as live at once rather than after the gateway's idle limit."""
    while not stopping.is_set():
        try:
            await beat(client, keys, consumer)
        except Exception as error:  # the read loops report Redis trouble; keep beating
            if not is_transient(error):
                raise
            log.debug("heartbeat not written", error=str(error))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), HEARTBEAT_PERIOD_S)
    try:
        await client.zrem(keys.workers_alive, consumer)
    except Exception as error:  # leaving the set is a courtesy: its entry ages out anyway
        if not is_transient(error):
            raise
