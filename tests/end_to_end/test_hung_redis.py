"""A hung Redis never holds a caller past its own timeout.

Each test runs its own redis-server and SIGSTOPs it once the caller is connected: its sockets
stay open and nothing answers, as with a blackholed failover or a stalled fork. Every caller
must give up within about a second of its own timeout: ``embed_queries(timeout=2)``,
``asyncio.wait_for`` around a producer call (the query's clean-up in ``finally`` is bounded
too), the gateway's ``/v1/embeddings`` with a 2 s gateway timeout (a JSON 503 with Retry-After
in each dialect's envelope) and ``/readyz`` (not ready). A watchdog SIGCONTs the server after
``WATCHDOG_S``, so code that waits on a hung Redis (today's before the fix) ends late, and
fails on its measured time, instead of never; the server is always resumed on the way out.

The PostgreSQL sink (the session's server, as in tests/integration/sinks/test_sinks.py) is bounded
the same way:
an upsert stuck on another session's lock is cancelled by the server at
EMBEDFLEET_SINK_STATEMENT_TIMEOUT_S as a transient fault; a connection whose server process is
stopped (no statement timeout can fire) turns the worker's /healthz red once the call outlives
its bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from embedfleet.producer import Producer, QueryTimeoutError
from embedfleet.server import ServerProcess, free_port, isolated_settings
from embedfleet.shared.fault_kinds import FaultKind, classify
from embedfleet.shared.protocol import Result
from embedfleet.shared.redis_conn import connect_settings
from embedfleet.shared.settings import Settings
from embedfleet.sinks import DatabaseSink, Delivery, build_sink
from embedfleet.sinks.pgvector import PgvectorBackend
from embedfleet.workers.health import HealthServer
from embedfleet.workers.metrics import WorkerMetrics
from tests.conftest import _server_binary, running_pg, until
from tests.gateway_support import running_gateway

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = [pytest.mark.slow, pytest.mark.serial]  # serial: its assertions hold times (Makefile)

# A caller may take this much longer than its own timeout (its clean-up included)
GRACE_S = 1.2
# The hung server is resumed after this long whatever happens, so the old code's waits end
WATCHDOG_S = 15.0
AUTH = {"Authorization": "Bearer hung-key"}


@pytest.fixture
def own_redis() -> Iterator[ServerProcess]:
    with ServerProcess(_server_binary()) as server:
        yield server


@contextlib.contextmanager
def hung(server: ServerProcess) -> Iterator[None]:
    """The server stopped (SIGSTOP) inside the block; resumed on exit, or by the watchdog."""
    process = server.process
    assert process is not None
    process.send_signal(signal.SIGSTOP)
    watchdog = threading.Timer(WATCHDOG_S, process.send_signal, (signal.SIGCONT,))
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()
        process.send_signal(signal.SIGCONT)


@pytest.fixture
def settings(own_redis: ServerProcess) -> Settings:
    return isolated_settings(own_redis.url, gateway_timeout_s=2.0, api_keys="hung-key")


async def test_embed_queries_gives_up_at_its_timeout(
    own_redis: ServerProcess, settings: Settings
) -> None:
    async with Producer(settings) as producer:  # connected, groups created
        with hung(own_redis):
            started = time.monotonic()
            with pytest.raises(QueryTimeoutError, match="no answer within 2"):
                await producer.embed_queries(["a query"], timeout=2)
            elapsed = time.monotonic() - started
    assert 2 <= elapsed < 2 + GRACE_S, elapsed


async def test_wait_for_around_a_producer_call_is_honoured(
    own_redis: ServerProcess, settings: Settings
) -> None:
    """The caller's own bound cancels the query; its withdrawal in ``finally`` (Redis again)
    must not hold the cancellation."""
    async with Producer(settings) as producer:
        with hung(own_redis):
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(producer.embed_query("a query", timeout=60), 5)
            elapsed = time.monotonic() - started
    assert 5 <= elapsed < 5 + GRACE_S, elapsed


async def test_wait_for_job_gives_up_at_its_timeout(
    own_redis: ServerProcess, settings: Settings
) -> None:
    async with Producer(settings) as producer:
        await producer.enqueue([{"id": "c1", "text": "some text"}], job="j")
        with hung(own_redis):
            started = time.monotonic()
            with pytest.raises(TimeoutError, match="not finished after 2"):
                await producer.wait_for_job("j", timeout=2)
            elapsed = time.monotonic() - started
    assert 2 <= elapsed < 2 + GRACE_S, elapsed


def _timed(call) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    answer = call()
    return answer, time.monotonic() - started


def test_gateway_answers_503_within_its_timeout_while_redis_hangs(
    own_redis: ServerProcess, settings: Settings
) -> None:
    """/v1/embeddings (OpenAI's envelope) and /embed (TEI's) with a 2 s gateway timeout: a
    JSON 503 with Retry-After within about a second of it; /readyz: not ready within its own
    bound (EMBEDFLEET_GATEWAY_REDIS_TIMEOUT_S)."""
    with (
        running_gateway(settings) as url,
        httpx.Client(base_url=url, headers=AUTH, timeout=WATCHDOG_S + 30) as http,
    ):
        assert http.get("/readyz").status_code == 200  # connected before the hang
        with hung(own_redis):
            openai_answer, openai_s = _timed(
                lambda: http.post(
                    "/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": "hi"}
                )
            )
            tei_answer, tei_s = _timed(lambda: http.post("/embed", json={"inputs": "hi"}))
            ready, ready_s = _timed(lambda: http.get("/readyz"))
    for answer, elapsed in ((openai_answer, openai_s), (tei_answer, tei_s)):
        assert elapsed < settings.gateway_timeout_s + GRACE_S, (answer.text, elapsed)
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == str(settings.gateway_retry_after_s)
    error = openai_answer.json()["error"]
    assert error["code"] == "queue_unavailable" and error["type"] == "server_error"
    assert "Redis" in error["message"]
    assert tei_answer.json()["error_type"] == "Unhealthy"
    assert ready_s < settings.gateway_redis_timeout_s + GRACE_S, ready_s
    assert ready.status_code == 503 and ready.json()["status"] == "redis unreachable"
    assert ready.headers["retry-after"] == str(settings.gateway_retry_after_s)


def test_gateway_answers_json_503_with_retry_after_while_redis_is_down(
    own_redis: ServerProcess, settings: Settings
) -> None:
    """Redis gone (its port closed): every route that needs it answers a JSON 503 with
    Retry-After in its dialect's envelope, never a plain-text 500."""
    with (
        running_gateway(settings) as url,
        httpx.Client(base_url=url, headers=AUTH, timeout=WATCHDOG_S + 30) as http,
    ):
        own_redis.stop()
        answers = {
            "/v1/embeddings": http.post(
                "/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": "hi"}
            ),
            "/v1/models": http.get("/v1/models"),
            "/embed": http.post("/embed", json={"inputs": "hi"}),
            "/info": http.get("/info"),
            "/health": http.get("/health"),
            "/readyz": http.get("/readyz"),
        }
    for route, answer in answers.items():
        assert answer.status_code == 503, (route, answer.status_code, answer.text)
        assert answer.headers["content-type"] == "application/json", route
        assert answer.headers["retry-after"] == str(settings.gateway_retry_after_s), route
        body = answer.json()
        if route.startswith("/v1"):
            assert body["error"]["code"] == "queue_unavailable", (route, body)
        elif route != "/readyz":
            assert body["error_type"] == "Unhealthy", (route, body)


# --- a hung PostgreSQL sink ----------------------------------------------------------------------
def _pg_sink(pg_server, settings: Settings, statement_timeout_s: float) -> DatabaseSink:
    """The worker's own sink (embedfleet/sinks: build_sink) on the session's PostgreSQL, in a table
    of its own, with a 4-dimension table set up."""
    settings = settings.model_copy(
        update={
            "sink": running_pg(pg_server).get_uri(),
            "sink_table": f"hung_{uuid.uuid4().hex[:8]}",
            "sink_statement_timeout_s": statement_timeout_s,
        }
    )
    sink = build_sink(settings, connect_settings(settings))
    assert isinstance(sink, DatabaseSink)
    sink.backend.setup("m", 4, None)
    return sink


def _result(row: int) -> Result:
    return Result(id="a", model="m", vector=np.eye(4, dtype=np.float16)[row])


def test_a_postgresql_upsert_stuck_on_a_lock_fails_as_transient_at_the_statement_timeout(
    pg_server, settings: Settings
) -> None:
    """Another session holds the row's lock: the upsert is cancelled by the server at
    EMBEDFLEET_SINK_STATEMENT_TIMEOUT_S (SQLSTATE 57014), a transient fault, and the retry
    once the lock is gone writes the row (the connection reopened with the same bound)."""
    import psycopg

    sink = _pg_sink(pg_server, settings, statement_timeout_s=1.0)
    backend = sink.backend
    backend.upsert([_result(0)])
    locker = psycopg.connect(backend.target.location)  # a transaction until it closes
    locker_pid = locker.info.backend_pid

    def end_the_lock() -> None:  # the watchdog: code without the bound waits until then
        with psycopg.connect(backend.target.location, autocommit=True) as other:
            other.execute("SELECT pg_terminate_backend(%s)", (locker_pid,))

    watchdog = threading.Timer(WATCHDOG_S, end_the_lock)
    try:
        table = psycopg.sql.Identifier(backend.target.table)
        locker.execute(psycopg.sql.SQL("SELECT id FROM {} WHERE id = 'a' FOR UPDATE").format(table))
        watchdog.start()
        started = time.monotonic()
        with pytest.raises(psycopg.errors.QueryCanceled) as raised:
            backend.upsert([_result(1)])
        elapsed = time.monotonic() - started
    finally:
        watchdog.cancel()
        locker.close()  # its transaction ends, and the lock with it
    assert 1.0 <= elapsed < 1.0 + GRACE_S, elapsed
    assert classify(raised.value).kind is FaultKind.TRANSIENT
    backend.upsert([_result(1)])
    (row,) = backend.export_rows()
    assert np.array_equal(row.vector, np.eye(4, dtype=np.float32)[1])
    backend.close()


async def test_worker_healthz_turns_red_while_a_sink_call_outlives_its_bound(
    pg_server, settings: Settings
) -> None:
    """The database stops answering the sink's connection (its backend process SIGSTOPped: no
    statement timeout can fire there): /healthz answers 503, naming the sink, once the call has
    run past 3 x the statement timeout, and 200 again once the call has ended."""
    import psycopg

    sink = _pg_sink(pg_server, settings, statement_timeout_s=0.5)
    backend = sink.backend
    backend.upsert([_result(0)])  # the sink's connection, open
    assert isinstance(backend, PgvectorBackend)
    # the server process of the sink's own connection
    backend_pid = backend._connection().info.backend_pid
    health = HealthServer(free_port(), sink.client, WorkerMetrics(), host="127.0.0.1")
    await health.start()
    health.watch_sink(sink)
    url = f"http://127.0.0.1:{health.port}/healthz"
    stalled_at: float | None = None
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            assert (await http.get(url)).status_code == 200
            os.kill(backend_pid, signal.SIGSTOP)
            try:
                write = asyncio.ensure_future(
                    sink.write([_result(1)], [Delivery(settings.keys.ingest, "0-1", None)])
                )
                started = time.monotonic()

                async def red() -> bool:
                    return (await http.get(url)).status_code == 503

                await until(red, timeout=WATCHDOG_S)
                stalled_at = time.monotonic() - started
                answer = (await http.get(url)).json()
                assert answer["alive"] is False and "postgresql call" in answer["sink"]
                assert not write.done()
            finally:
                os.kill(backend_pid, signal.SIGCONT)
            await write
            assert (await http.get(url)).status_code == 200
    finally:
        await health.stop()
        await sink.close()
        await sink.client.aclose()
    assert stalled_at is not None and 1.5 <= stalled_at < 1.5 + GRACE_S, stalled_at
    with psycopg.connect(backend.target.location) as check:
        assert check.execute("SELECT count(*) FROM " + backend.target.table).fetchone() == (1,)
