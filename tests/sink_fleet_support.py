"""A fleet writing to a real sink, for tests: a client on the settings' Redis, the settings'
sink built on it as the worker's runtime builds it, and a producer with an in-process worker
(the shared encoder) that write through it; the client outlives the fleet, so that a test can
still read the streams once the worker has drained."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from embedfleet.producer import Producer
from embedfleet.shared.redis_conn import connect
from embedfleet.shared.settings import Settings
from embedfleet.sinks import build_sink
from tests.conftest import WorkerLauncher, shared_encoder


@dataclass
class SinkFleet:
    settings: Settings
    client: aioredis.Redis
    sink: Any
    launcher: WorkerLauncher

    @contextlib.asynccontextmanager
    async def run(self) -> AsyncIterator[tuple[Producer, Any]]:
        """A producer and an in-process worker writing to ``sink``; the worker is drained and
        awaited on exit."""
        async with (
            Producer(self.settings, self.client) as producer,
            self.launcher.run(self.settings, sink=self.sink, client=self.client) as worker,
        ):
            yield producer, worker


@contextlib.asynccontextmanager
async def sink_fleet(settings: Settings, log_dir: Path) -> AsyncIterator[SinkFleet]:
    """The client, sink and worker launcher of a run into ``settings``' sink; the client is
    closed on exit."""
    client = connect(settings.effective_redis_url)
    sink = build_sink(settings, client)
    try:
        yield SinkFleet(settings, client, sink, WorkerLauncher(settings, shared_encoder, log_dir))
    finally:
        await client.aclose()
