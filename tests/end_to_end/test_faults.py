"""The fault vocabulary: each library's errors land in the kind their meaning calls for.

Real exception classes from the real libraries (redis-py, psycopg, httpx, qdrant-client); the
classification is pure logic, so no server is needed here. Servers going away for real are in
test_reliability.py and test_sinks.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import signal
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psycopg
import pytest
import redis.asyncio as aioredis
from qdrant_client.http.exceptions import ResponseHandlingException, UnexpectedResponse
from redis import exceptions as redis_errors

from embedfleet.producer import Producer
from embedfleet.producer.chunker import builtin_corpus
from embedfleet.server import ServerProcess, free_port, system_server_binary
from embedfleet.shared.dead_letters import DeadLetter, DeadReason
from embedfleet.shared.fault_kinds import (
    BackoffPolicy,
    FaultKind,
    System,
    WorkerFault,
    classify,
    is_transient,
)
from embedfleet.shared.protocol import Chunk, decode_chunk
from embedfleet.shared.redis_conn import connect
from embedfleet.shared.settings import Settings
from embedfleet.sinks import parse_sink_url, sink_for_target
from embedfleet.workers.health import HealthServer
from embedfleet.workers.metrics import WorkerMetrics
from embedfleet.workers.worker import Worker
from tests.conftest import Recorder, WorkerLauncher

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
# waits: it mostly waits its faults out (Makefile, test-full)
pytestmark = [pytest.mark.slow, pytest.mark.waits]

PG_DOWN = (
    'connection failed: connection to server on socket "/tmp/.s.PGSQL.5432" failed: '
    "No such file or directory"
)
PG_NO_DB = (
    'connection failed: connection to server on socket "/tmp/.s.PGSQL.5432" failed: '
    'FATAL:  database "nodb" does not exist'
)
PG_BAD_PASSWORD = (
    'connection failed: connection to server at "127.0.0.1", port 5432 failed: '
    'FATAL:  password authentication failed for user "embedder"'
)


def qdrant_status(code: int, reason: str) -> UnexpectedResponse:
    """What qdrant-client raises for an HTTP answer of ``code``."""
    return UnexpectedResponse(code, reason, b"", httpx.Headers())


# Each library's errors (builtin ones: System.UNKNOWN), and the kind each must land in.
FAULTS: dict[System, list[tuple[BaseException, FaultKind]]] = {
    System.REDIS: [
        (redis_errors.ConnectionError("Connection refused"), FaultKind.TRANSIENT),
        (redis_errors.TimeoutError("Timeout reading"), FaultKind.TRANSIENT),
        (redis_errors.BusyLoadingError("LOADING"), FaultKind.TRANSIENT),
        (redis_errors.ReadOnlyError("READONLY replica"), FaultKind.TRANSIENT),
        (redis_errors.ClusterDownError("CLUSTERDOWN"), FaultKind.TRANSIENT),
        (redis_errors.AskError("3999 127.0.0.1:6381"), FaultKind.TRANSIENT),
        (redis_errors.RedisClusterException("no node"), FaultKind.TRANSIENT),
        (redis_errors.ResponseError("OOM command not allowed"), FaultKind.TRANSIENT),
        # what redis-py raises for OOM: its own type, the "OOM" prefix stripped
        (
            redis_errors.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
            FaultKind.TRANSIENT,
        ),
        (
            redis_errors.ResponseError(
                "Command # 1 (SET a b) of pipeline caused error: command not allowed when used "
                "memory > 'maxmemory'."
            ),
            FaultKind.TRANSIENT,
        ),
        # AuthenticationError is a ConnectionError subclass: it must not be waited out
        (redis_errors.AuthenticationError("invalid password"), FaultKind.WORKER),
        (redis_errors.NoPermissionError("NOPERM"), FaultKind.WORKER),
        (redis_errors.ResponseError("WRONGTYPE"), FaultKind.WORKER),
    ],
    System.POSTGRESQL: [
        (psycopg.OperationalError("connection refused"), FaultKind.TRANSIENT),
        (psycopg.errors.AdminShutdown(), FaultKind.TRANSIENT),
        # libpq's connection failures carry no SQLSTATE: the words decide
        (psycopg.OperationalError(PG_DOWN), FaultKind.TRANSIENT),
        (psycopg.OperationalError(PG_NO_DB), FaultKind.WORKER),
        (psycopg.OperationalError(PG_BAD_PASSWORD), FaultKind.WORKER),
        (psycopg.errors.SerializationFailure(), FaultKind.TRANSIENT),
        (psycopg.errors.DeadlockDetected(), FaultKind.TRANSIENT),
        (psycopg.errors.UntranslatableCharacter(), FaultKind.ROW),
        (psycopg.errors.CheckViolation(), FaultKind.ROW),
        (psycopg.errors.InvalidPassword(), FaultKind.WORKER),
        (psycopg.errors.UndefinedTable(), FaultKind.WORKER),
        (psycopg.errors.InsufficientPrivilege(), FaultKind.WORKER),
    ],
    System.QDRANT: [
        (httpx.ConnectError("refused"), FaultKind.TRANSIENT),
        (httpx.ReadTimeout("slow"), FaultKind.TRANSIENT),
        (ResponseHandlingException(OSError("reset")), FaultKind.TRANSIENT),
        (qdrant_status(503, "Unavailable"), FaultKind.TRANSIENT),
        (qdrant_status(429, "Too Many"), FaultKind.TRANSIENT),
        (qdrant_status(400, "Bad Request"), FaultKind.ROW),
        (qdrant_status(401, "Unauthorized"), FaultKind.WORKER),
    ],
    System.UNKNOWN: [
        (TimeoutError(), FaultKind.TRANSIENT),
        (ConnectionResetError(), FaultKind.TRANSIENT),
        (OSError(errno.EHOSTUNREACH, "no route"), FaultKind.TRANSIENT),
        (PermissionError(errno.EACCES, "denied"), FaultKind.WORKER),
        (ValueError("cannot encode"), FaultKind.ROW),
    ],
}


@pytest.mark.parametrize(
    ("error", "kind", "system"),
    [(error, kind, system) for system, faults in FAULTS.items() for error, kind in faults],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else str(value),
)
def test_each_error_has_the_kind_its_meaning_calls_for(
    error: BaseException, kind: FaultKind, system: System
) -> None:
    fault = classify(error)
    assert (fault.kind, fault.system) == (kind, system)
    assert is_transient(error) == (kind is FaultKind.TRANSIENT)


def test_the_caller_names_the_system_of_a_builtin_error() -> None:
    """A builtin TimeoutError raised in the pgvector sink is PostgreSQL's, not Redis's."""
    assert classify(TimeoutError(), System.POSTGRESQL).system is System.POSTGRESQL
    # ... but a library's own error keeps its system whatever the caller guessed
    assert classify(redis_errors.ConnectionError(), System.POSTGRESQL).system is System.REDIS


def test_a_worker_fault_names_the_setting_to_change() -> None:
    fault = classify(psycopg.errors.InvalidPassword("password authentication failed"))
    message = str(WorkerFault.from_fault(fault, "writing vectors"))
    assert "EMBEDFLEET_SINK" in message and "password authentication failed" in message


def test_backoff_delays_grow_to_the_cap_and_restart_after_reset() -> None:
    policy = BackoffPolicy(base_s=0.1, cap_s=1.0)
    delays = [policy.next_delay() for _ in range(12)]
    assert all(0 <= delay <= 1.0 for delay in delays)
    assert policy.attempt == 12
    policy.reset()
    assert policy.next_delay() <= 0.1


# --- the kinds, live: a real PostgreSQL stopped and refusing, a Redis that comes late -------
@contextlib.asynccontextmanager
async def readiness_endpoint(client: aioredis.Redis, worker) -> AsyncIterator[str]:
    """The worker's real /readyz (aiohttp, a free port), watching the worker's outages."""
    # a long check timeout: on a loaded machine the device probe may queue behind a batch
    health = HealthServer(
        free_port(), client, WorkerMetrics(), host="127.0.0.1", check_timeout_s=60
    )
    health.watch_outages(worker.outages)
    health.model_loaded(worker.encoder, worker.model_thread)
    await health.start()
    try:
        yield f"http://127.0.0.1:{health.port}/readyz"
    finally:
        await health.stop()


async def readiness(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.json()


def pg_count(dsn: str, table: str) -> int:
    import psycopg

    with psycopg.connect(dsn) as conn:
        return conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0]


def pg_ids(dsn: str, table: str) -> set[str]:
    import psycopg

    with psycopg.connect(dsn) as conn:
        return {row[0] for row in conn.execute(f'SELECT id FROM "{table}"')}


async def test_postgresql_stopped_20s_mid_run_is_waited_out_with_readyz_503(
    workers: WorkerLauncher,
    settings: Settings,
    client: aioredis.Redis,
    encoder,
    pg_data_folder: Path,
) -> None:
    """The must-show: no dead letter, /readyz 503 all through the outage, every row after."""
    import pgserver
    from pgserver._commands import pg_ctl

    server = pgserver.get_server(pg_data_folder / "pg", cleanup_mode="delete")  # this test's own
    try:
        dsn = server.get_uri()
        table = f"outage_{uuid.uuid4().hex[:6]}"
        sink = sink_for_target(parse_sink_url(dsn, table), settings, client)
        before, during = (
            list(builtin_corpus(60)),
            [
                Chunk(f"late-{n}", f"written while PostgreSQL was down, number {n}")
                for n in range(40)
            ],
        )
        async with (
            Producer(settings, client) as producer,
            workers.run(settings, sink=sink) as worker,
            readiness_endpoint(client, worker) as url,
        ):
            recorder: Recorder = worker.listener
            await producer.enqueue(before, job="outage")
            await recorder.wait_for(lambda r: r.texts_written == 60, "first 60 rows written")
            status, body = await readiness(url)
            assert status == 200 and "postgresql" not in body["checks"], body

            pg_ctl(["-w", "stop", "-m", "fast"], pgdata=server.pgdata, user=server.system_user)
            stopped_at = time.monotonic()
            await producer.enqueue(during, job="outage")
            await recorder.wait_for(
                lambda r: r.outages.get("postgresql") is True, "outage of postgresql noticed"
            )
            seen = []  # seconds since the stop of each probe, all answered 503
            while time.monotonic() - stopped_at < OUTAGE_S or len(seen) < 3:
                status, body = await readiness(url)
                seen.append(time.monotonic() - stopped_at)
                assert status == 503, body
                assert "postgresql" in body["checks"], body  # names the system that is down
                assert await client.xlen(settings.keys.dead) == 0
                await asyncio.sleep(0.5)  # probing at a steady pace, not waiting for an event
            assert recorder.texts_written == 60  # nothing written, nothing dead-lettered
            server.ensure_postgres_running()
            assert server.get_uri() == dsn
            progress = await producer.wait_for_job("outage", timeout=120)
            await recorder.wait_for(
                lambda r: r.outages.get("postgresql") is False, "outage of postgresql closed"
            )
            status, body = await readiness(url)
            assert status == 200 and "postgresql" not in body["checks"], body
        # probed (503 every time) until PostgreSQL came back, OUTAGE_S after it stopped
        assert len(seen) >= 3 and seen[-1] >= OUTAGE_S - 1, seen
        assert (progress.done, progress.dead) == (100, 0)
        assert await client.xlen(settings.keys.dead) == 0
        assert pg_ids(dsn, table) == {c.id for c in before} | {c.id for c in during}
        assert recorder.transient["postgresql"] >= 1
        assert all(kind == "transient" for _, kind in recorder.sink_errors)
        assert (await client.xpending(settings.keys.ingest, settings.group))["pending"] == 0
    finally:
        server.cleanup()


OUTAGE_S = 20.0


async def test_a_row_the_database_refuses_is_dead_lettered_alone(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, encoder, pg_server
) -> None:
    """jsonb cannot hold \\u0000: PostgreSQL refuses that row's meta (SQLSTATE 22P05). The
    batch is split until the row is alone; the other rows are written."""
    dsn, table = pg_server.get_uri(), f"refuse_{uuid.uuid4().hex[:6]}"
    chunks = [Chunk(f"ok-{n}", f"a perfectly fine text, number {n}") for n in range(31)]
    chunks.insert(17, Chunk("bad", "a fine text with odd metadata", meta={"note": "nul\x00here"}))
    one_window = settings.model_copy(update={"read_count": 64})
    sink = sink_for_target(parse_sink_url(dsn, table), settings, client)
    async with (
        Producer(one_window, client) as producer,
        workers.run(one_window, sink=sink) as worker,
    ):
        await producer.enqueue(chunks, job="refuse")
        progress = await producer.wait_for_job("refuse", timeout=120)
        recorder: Recorder = worker.listener
    assert (progress.done, progress.dead) == (31, 1)
    assert recorder.rows_isolated >= 1  # the refused row was in a batch with others
    ((dead_id, fields),) = await client.xrange(settings.keys.dead)
    letter = DeadLetter.from_fields(dead_id, fields)
    assert (letter.chunk_id, letter.reason) == ("bad", DeadReason.SINK_REFUSED)
    assert "postgresql refused the row" in letter.detail and "\\u0000" in letter.detail
    assert letter.payload is not None  # the original, whole: replayable once fixed
    sent = decode_chunk(letter.payload)
    assert (sent.id, sent.text, sent.meta, sent.job) == (
        "bad",
        chunks[17].text,
        {"note": "nul\x00here"},
        "refuse",
    )
    assert pg_ids(dsn, table) == {c.id for c in chunks} - {"bad"}
    assert {kind for _, kind in recorder.sink_errors} == {"row"}


async def test_a_worker_started_10s_before_its_redis_runs_when_redis_comes(
    workers: WorkerLauncher, settings: Settings
) -> None:
    port = free_port()
    late = settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{port}/0"})
    started = time.monotonic()
    # the eager model: the outage is the scenario, not the forward path, so the start builds
    # and times no frozen or int8 copy once Redis comes (CI's CPU seconds)
    worker = workers.process("early", late, EMBEDFLEET_FROZEN_QUERIES="false")
    # The worker says it is waiting for Redis (its model loaded, it is at the consumer group):
    # the line is the event; ten seconds without Redis are the scenario.
    await worker.wait_for_log('"redis unavailable, retrying"')
    await asyncio.sleep(max(0.0, 10 - (time.monotonic() - started)))
    assert worker.poll() is None, worker.log()[-3000:]
    with ServerProcess(system_server_binary() or None, port=port):
        client = connect(late.effective_redis_url)
        try:
            async with Producer(late, client) as producer:
                await producer.enqueue(builtin_corpus(20), job="late")
                progress = await producer.wait_for_job("late", timeout=300)
        finally:
            await client.aclose()
        worker.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(worker.wait, 120)
    log = worker.log()
    assert (progress.done, progress.dead, code) == (20, 0, 0), log[-3000:]
    waits = [json.loads(line) for line in log.splitlines() if "redis unavailable" in line]
    assert waits and all(w["system"] == "redis" for w in waits)
    assert waits[0]["doing"] == "creating the consumer group"
    assert '"redis is back"' in log


async def test_a_fault_permanent_for_the_worker_exits_non_zero_naming_the_setting(
    settings: Settings, client: aioredis.Redis, encoder, pg_server
) -> None:
    """The table is dropped under a running worker: no retry can fix that, a person must."""
    import psycopg

    dsn, table = pg_server.get_uri(), f"gone_{uuid.uuid4().hex[:6]}"
    quick = settings.model_copy(update={"sink_retries": 2})
    sink = sink_for_target(parse_sink_url(dsn, table), quick, client)
    await sink.setup(encoder.name, encoder.dim)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP TABLE "{table}"')
    worker = Worker(quick, encoder, client, sink, Recorder())
    async with Producer(quick, client) as producer:
        await producer.enqueue(builtin_corpus(5), job="gone")
        with pytest.raises(WorkerFault, match="EMBEDFLEET_SINK") as failed:
            await asyncio.wait_for(worker.run(), timeout=120)
    await sink.close()
    assert "does not exist" in str(failed.value)
    # nothing was lost or dead-lettered: the entries wait, pending, for a worker that can write
    assert await client.xlen(quick.keys.dead) == 0
    assert (await client.xpending(quick.keys.ingest, quick.group))["pending"] == 5


def test_a_worker_whose_database_does_not_exist_exits_non_zero_naming_the_setting(
    workers: WorkerLauncher, settings: Settings, pg_server
) -> None:
    """SQLSTATE 3D000 at start-up: permanent, so no waiting; exit 1 with what to change."""
    dsn = pg_server.get_uri().replace("/postgres?", "/no_such_database?")
    assert "no_such_database" in dsn
    worker = workers.process("nodb", settings, EMBEDFLEET_SINK=dsn)
    code = worker.wait(timeout=300)
    log = worker.log()
    assert code == 1, log[-3000:]
    assert "EMBEDFLEET_SINK" in log and "no_such_database" in log and "Traceback" not in log


def test_a_connection_closed_under_asyncio_is_transient() -> None:
    """A cluster master killed mid-command: asyncio's transport says its handler is closed."""
    from embedfleet.shared.fault_kinds import FaultKind, classify

    lost = RuntimeError(
        "unable to perform operation on <TCPTransport closed=True>; the handler is closed"
    )
    assert classify(lost).kind is FaultKind.TRANSIENT
    assert classify(RuntimeError("something else")).kind is not FaultKind.TRANSIENT


async def test_a_connection_disconnected_under_redis_py_is_transient() -> None:
    """A cluster master SIGKILLed while redis-py asks it for a command's keys: another task's
    disconnect cleared the connection's stream and redis-py's write raises an AttributeError
    (a worker's query stage died on it in CI). redis-py 8.2 checks for the missing stream and
    raises ConnectionError instead; pyproject allows redis>=5.0, so both must be transient: the
    installed redis-py's own write on a connection with no stream, whatever it raises, and the
    older releases' AttributeError, raised from a function of redis-py's connection module as
    theirs was. The same error raised outside redis-py stays a bug."""
    from redis.asyncio.connection import Connection
    from redis.exceptions import ConnectionError as RedisConnectionError

    from embedfleet.shared.fault_kinds import FaultKind, classify

    with pytest.raises((AttributeError, RedisConnectionError)) as written:
        await Connection()._send_packed_command([b"PING"])
    assert classify(written.value).kind is FaultKind.TRANSIENT

    # redis-py < 8.2's write, in its own module: ``self._writer.writelines(command)`` on None
    old_connection_module: dict[str, Any] = {"__name__": "redis.asyncio.connection"}
    exec("def write(writer, command):\n    writer.writelines(command)", old_connection_module)
    with pytest.raises(AttributeError, match="'NoneType' object") as lost:
        old_connection_module["write"](None, [b"PING"])
    assert classify(lost.value).kind is FaultKind.TRANSIENT

    def our_bug() -> None:
        none: Any = None
        none.writelines([b"PING"])

    with pytest.raises(AttributeError) as bug:
        our_bug()
    assert classify(bug.value).kind is FaultKind.WORKER
