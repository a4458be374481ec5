"""Operations: /metrics, /healthz, /readyz of a real worker, and `embedfleet status`.

Real processes, a real Redis server, the real model. The worker under test gets a Redis server
of its own, so the test can stop it and watch readiness fail while the worker stays alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import os
import signal
import subprocess
import time
import typing
from collections.abc import AsyncIterator

import aiohttp
import pytest
import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge, Histogram, Info
from prometheus_client.parser import text_string_to_metric_families

from embedfleet.ops.status import History, eta_seconds, take_snapshot, throughput
from embedfleet.producer import Producer
from embedfleet.producer.chunker import builtin_corpus
from embedfleet.server import ServerProcess, free_port
from embedfleet.shared.dead_letters import DeadReason
from embedfleet.shared.protocol import PAYLOAD_FIELD
from embedfleet.shared.redis_conn import connect
from embedfleet.shared.settings import Settings
from embedfleet.workers.events import QUERY_STAGES
from embedfleet.workers.health import HealthServer
from embedfleet.workers.metrics import METRICS, MetricSpec, StreamGauges, WorkerMetrics
from tests import forks
from tests.conftest import WorkerLauncher, cli_env, start_cli

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = [pytest.mark.slow, pytest.mark.serial]  # serial: its assertions hold times (Makefile)

CHUNKS = 300
FAMILIES = {
    # family name (as the parser reports it) -> type
    "embedfleet_worker_info": "gauge",  # an Info is a gauge of 1 in the text format
    "embedfleet_texts_embedded": "counter",
    "embedfleet_tokens_embedded": "counter",
    "embedfleet_padded_tokens": "counter",
    "embedfleet_batches": "counter",
    "embedfleet_batch_texts": "histogram",
    "embedfleet_batch_padded_tokens": "histogram",
    "embedfleet_batch_seconds": "histogram",
    "embedfleet_write_seconds": "histogram",
    "embedfleet_query_latency_seconds": "histogram",
    "embedfleet_query_stage_seconds": "histogram",
    "embedfleet_model_seconds": "counter",
    "embedfleet_queries_served": "counter",
    "embedfleet_padding_ratio": "gauge",
    "embedfleet_model_busy_fraction": "gauge",
    "embedfleet_dead_letters": "counter",
    "embedfleet_vector_cache_hits": "counter",
    "embedfleet_vector_cache_misses": "counter",
    "embedfleet_tokens_saved": "counter",
    "embedfleet_reclaimed": "counter",
    "embedfleet_sink_errors": "counter",
    "embedfleet_stream_length": "gauge",
    "embedfleet_stream_lag": "gauge",
    "embedfleet_stream_pending": "gauge",
    "embedfleet_group_consumers": "gauge",
    "embedfleet_redis_up": "gauge",
    "process_resident_memory_bytes": "gauge",
}


class Scrape:
    """One /metrics page: the family types, and every sample by name and labels."""

    def __init__(self, page: str) -> None:
        self.types: dict[str, str] = {}
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in text_string_to_metric_families(page):
            self.types[family.name] = family.type
            for sample in family.samples:
                self.samples[(sample.name, frozenset(sample.labels.items()))] = sample.value

    def __call__(self, name: str, **labels: str) -> float:
        """The one sample of ``name`` with these labels (and any others: the per-model metrics
        carry a ``model`` label, the one model of the worker under test)."""
        key = (name, frozenset(labels.items()))
        if key in self.samples:
            return self.samples[key]
        wanted = set(labels.items())
        found = [v for (n, have), v in self.samples.items() if n == name and wanted <= have]
        if len(found) != 1:
            raise AssertionError(f"{len(found)} samples {name}{labels} in /metrics, not one")
        return found[0]


async def get(session: aiohttp.ClientSession, port: int, path: str) -> tuple[int, str]:
    async with session.get(f"http://127.0.0.1:{port}{path}") as response:
        return response.status, await response.text()


async def scrape(session: aiohttp.ClientSession, port: int) -> Scrape:
    status, page = await get(session, port, "/metrics")
    assert status == 200, page
    return Scrape(page)


async def test_worker_metrics_health_and_readiness(
    workers: WorkerLauncher, redis_server: ServerProcess, settings: Settings
) -> None:
    port = free_port()
    # A server of the worker's own, stopped at the end to see /readyz fail.
    with ServerProcess(redis_server.binary) as own_server:
        own = settings.model_copy(update={"redis_url": own_server.url})
        client = connect(own.effective_redis_url)
        chunks = list(builtin_corpus(CHUNKS, max_chars=400))
        async with Producer(own, client) as producer:
            await producer.enqueue(chunks, job="ops")
        await client.xadd(own.keys.ingest, {PAYLOAD_FIELD: b"\xc1 not msgpack"})

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            # small reads, so the lag goes down in steps a scraper can see
            worker = workers.process(
                "ops-worker",
                own,
                EMBEDFLEET_HEALTH_PORT=str(port),
                EMBEDFLEET_READ_COUNT="32",
                EMBEDFLEET_DTYPE="float32",  # the info metric's dtype label is checked below
                # a default worker's query path (worker_env runs queries eager): the query's
                # stages and the forward path chosen at start are checked below
                EMBEDFLEET_FROZEN_QUERIES="true",
            )
            logs = lambda: worker.log()[-3000:]  # noqa: E731 - for failure messages

            # /healthz answers before the model is loaded; /readyz says "loading" meanwhile.
            readiness: list[tuple[int, dict]] = []
            deadline = time.monotonic() + 90
            while True:
                assert worker.poll() is None, logs()
                assert time.monotonic() < deadline, logs()
                try:
                    status, body = await get(session, port, "/readyz")
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.02)
                    continue
                readiness.append((status, json.loads(body)))
                if status == 200:
                    break
                await asyncio.sleep(0.02)
            assert readiness[0][0] == 503 and readiness[0][1]["checks"]["model"] == "loading"
            assert readiness[-1][1] == {
                "ready": True,
                "checks": {"model": "ok", "redis": "ok", "device": "ok"},
            }
            status, body = await get(session, port, "/healthz")
            assert status == 200 and json.loads(body)["alive"] is True

            # Scrape while the backlog drains; one priority query on the way.
            lags: list[float] = []
            texts_seen: list[float] = []
            query_task = asyncio.create_task(
                Producer(own, client).embed_query("what does yield do?", timeout=60)
            )
            deadline = time.monotonic() + 120
            while True:
                assert worker.poll() is None, logs()
                assert time.monotonic() < deadline, f"lags {lags}\n{logs()}"
                try:
                    page = await scrape(session, port)
                except aiohttp.ClientConnectionError as error:
                    raise AssertionError(f"the worker stopped answering\n{logs()}") from error
                lags.append(page("embedfleet_stream_lag", stream="ingest"))
                texts_seen.append(page("embedfleet_texts_embedded_total"))
                progress = await Producer(own, client).progress("ops")
                if progress.done + progress.dead >= CHUNKS and query_task.done():
                    break
                await asyncio.sleep(0.25)
            query_vector = await query_task
            await asyncio.sleep(1.1)  # the stream gauges refresh at most once a second
            final = await scrape(session, port)

            for name, kind in FAMILIES.items():
                assert final.types.get(name) == kind, f"{name}: {final.types.get(name)}"
            assert query_vector.shape == (384,)
            results = await client.xlen(own.keys.results)
            assert results == CHUNKS
            assert final("embedfleet_texts_embedded_total") == CHUNKS
            assert 0 < max(texts_seen) <= CHUNKS
            tokens = final("embedfleet_tokens_embedded_total")
            padded = final("embedfleet_padded_tokens_total")
            assert CHUNKS * 3 < tokens <= padded
            assert math.isclose(
                final("embedfleet_padding_ratio"), 1 - tokens / padded, abs_tol=1e-9
            )
            batches = final("embedfleet_batches_total")
            assert batches >= CHUNKS / 128
            assert final("embedfleet_batch_texts_count") == batches
            # every chunk went through the model or came from the vector cache (the built-in
            # corpus repeats a few chunks, and windows of 32 meet them again)
            cached = final("embedfleet_vector_cache_hits_total")
            assert final("embedfleet_batch_texts_sum") + cached == CHUNKS
            assert final("embedfleet_vector_cache_misses_total") == CHUNKS - cached
            assert final("embedfleet_batch_padded_tokens_sum") == padded
            assert final("embedfleet_batch_seconds_count") == batches
            assert final("embedfleet_write_seconds_count") >= 1
            assert final("embedfleet_model_seconds_total") > 0
            assert 0 < final("embedfleet_model_busy_fraction") <= 1
            assert final("embedfleet_query_latency_seconds_count") == 1
            served = {
                dict(labels)["path"]: value
                for (name, labels), value in final.samples.items()
                if name == "embedfleet_queries_served_total"
            }
            assert sum(served.values()) == 1 and set(served) <= {"frozen", "eager"}, served
            assert 0 < final("embedfleet_query_latency_seconds_sum") < 60
            # the one query's stages, each observed once, add up to its latency (the same clock
            # readings: enqueue, read, inbox, model thread, vectors, reply)
            stages = {
                stage: final("embedfleet_query_stage_seconds_sum", stage=stage)
                for stage in QUERY_STAGES
            }
            for stage in stages:
                assert final("embedfleet_query_stage_seconds_count", stage=stage) == 1, stage
            assert stages["forward"] > 0, stages
            assert math.isclose(
                sum(stages.values()),
                final("embedfleet_query_latency_seconds_sum"),
                abs_tol=1e-3,
            ), stages
            assert final("embedfleet_dead_letters_total", reason="not_msgpack") == 1
            assert final("embedfleet_dead_letters_total", reason="too_long") == 0
            assert final("embedfleet_reclaimed_total") == 0
            assert final("embedfleet_redis_up") == 1
            (info,) = [
                dict(labels)
                for (name, labels), value in final.samples.items()
                if name == "embedfleet_worker_info" and value == 1
            ]
            # The forward path is the one chosen at start, not the placeholder set before it.
            forward_path = info.pop("forward_path")
            assert forward_path.startswith(("float32", "int8")), forward_path
            assert info == {
                "consumer": "ops-worker",
                "model": "all-MiniLM-L6-v2",
                "device": "cpu",
                "dtype": "float32",
            }
            print(f"ingest lag as scraped: {lags}")
            # The lag starts at the whole backlog, only goes down, and ends at 0. Redis cannot
            # tell the lag (XINFO GROUPS gives nil, the gauge NaN, as its help says) while the
            # group's last delivered entry is already deleted and an earlier one is not: a
            # window's entries are acknowledged (and deleted) in length order, not read order.
            # Those samples say nothing either way; every figure Redis gives must go down.
            known = [lag for lag in lags if not math.isnan(lag)]
            assert lags[0] > 0 and len(known) >= 2, lags
            assert all(a >= b for a, b in itertools.pairwise(known)), lags
            assert final("embedfleet_stream_lag", stream="ingest") == 0
            # Seen in steps, not only as "all" then "none". The final 0 counts: on a fast
            # machine the 250 chunks drain within two refreshes of the gauge (1 s apart).
            assert len({*lags, 0.0}) >= 3, f"saw the lag at too few values: {lags}"
            assert final("embedfleet_stream_lag", stream="query") == 0
            assert final("embedfleet_stream_pending", stream="ingest") == 0
            assert final("embedfleet_stream_length", stream="ingest") == 0
            assert final("embedfleet_stream_length", stream="results") == CHUNKS
            assert final("embedfleet_stream_length", stream="dead") == 1
            assert final("embedfleet_group_consumers", stream="ingest") == 1

            # Redis goes away: not ready (the reason names Redis), still alive.
            own_server.stop()
            status, body = await get(session, port, "/readyz")
            assert status == 503, body
            checks = json.loads(body)["checks"]
            assert checks["redis"].startswith("PING failed") and checks["model"] == "ok"
            status, _ = await get(session, port, "/healthz")
            assert status == 200
            await asyncio.sleep(1.1)
            down = await scrape(session, port)
            assert down("embedfleet_redis_up") == 0
            assert down("embedfleet_texts_embedded_total") == CHUNKS  # counters survive

            worker.send_signal(signal.SIGTERM)
            assert worker.wait(timeout=60) == 0, logs()
        await client.aclose()


# --- health server in-process: readiness states, the device check's cache ---------------
@contextlib.asynccontextmanager
async def health_server(client: aioredis.Redis, **options: float) -> AsyncIterator[HealthServer]:
    server = HealthServer(free_port(), client, WorkerMetrics(), host="127.0.0.1", **options)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def test_readyz_follows_model_redis_and_drain(redis_server: ServerProcess, encoder) -> None:
    with ServerProcess(redis_server.binary) as own_server:
        client = connect(own_server.url)
        async with (
            health_server(client, device_check_ttl_s=60) as health,
            aiohttp.ClientSession() as session,
        ):
            status, body = await get(session, health.port, "/readyz")
            assert status == 503
            assert json.loads(body)["checks"] == {
                "model": "loading",
                "redis": "ok",
                "device": "model not loaded yet",
            }
            status, body = await get(session, health.port, "/healthz")
            assert status == 200 and json.loads(body)["model_loaded"] is False

            health.model_loaded(encoder)
            for _ in range(3):
                status, body = await get(session, health.port, "/readyz")
                assert status == 200, body
            assert health.device_checks == 1, "the forward pass is cached between probes"

            own_server.stop()
            status, body = await get(session, health.port, "/readyz")
            assert status == 503 and "PING failed" in json.loads(body)["checks"]["redis"]
        await client.aclose()

    client = connect(redis_server.url)
    async with health_server(client) as health, aiohttp.ClientSession() as session:
        health.model_loaded(encoder)
        assert (await get(session, health.port, "/readyz"))[0] == 200
        health.draining()
        status, body = await get(session, health.port, "/readyz")
        assert status == 503 and "draining" in json.loads(body)["checks"]
        assert (await get(session, health.port, "/healthz"))[0] == 200
    await client.aclose()


async def test_health_port_in_use_is_a_clear_error(client: aioredis.Redis) -> None:
    async with health_server(client) as first:
        second = HealthServer(first.port, client, WorkerMetrics(), host="127.0.0.1")
        with pytest.raises(RuntimeError, match=f"EMBEDFLEET_HEALTH_PORT={first.port}"):
            await second.start()


# --- metrics in-process: hooks to samples, one registry per worker ------------------------
def test_each_worker_has_its_own_registry() -> None:
    from prometheus_client import generate_latest

    one, two = WorkerMetrics(model="all-MiniLM-L6-v2"), WorkerMetrics(model="code")
    one.batch_encoded(texts=8, real_tokens=60, padded_tokens=80, seconds=0.5)
    one.results_written(texts=8, seconds=0.01)
    one.dead_lettered(count=2, reason=DeadReason.TOO_LARGE.value)
    one.sink_error(error=ConnectionResetError("gone"), kind="transient")
    first = Scrape(generate_latest(one.registry).decode())
    second = Scrape(generate_latest(two.registry).decode())
    assert first("embedfleet_texts_embedded_total", model="all-MiniLM-L6-v2") == 8
    assert second("embedfleet_texts_embedded_total", model="code") == 0  # by model: its lane
    assert math.isnan(second("embedfleet_stream_lag", model="code", stream="ingest"))  # unread
    assert first("embedfleet_tokens_embedded_total", model="all-MiniLM-L6-v2") == 60
    assert first("embedfleet_padding_ratio") == pytest.approx(0.25)
    assert first("embedfleet_dead_letters_total", reason="too_large") == 2
    assert (
        first("embedfleet_sink_errors_total", error="ConnectionResetError", kind="transient") == 1
    )
    one.model_busy(fraction=0.42)
    assert Scrape(generate_latest(one.registry).decode())("embedfleet_model_busy_fraction") == 0.42


def test_every_metric_is_an_attribute_annotated_with_its_kind() -> None:
    """``WorkerMetrics``' annotations (what the type checker sees) match ``METRICS`` (what is
    registered): a metric added to one and not the other, or of another kind, fails here."""
    hints = typing.get_type_hints(WorkerMetrics)
    kinds = (Counter, Gauge, Histogram, Info)
    annotated = {name for name, hint in hints.items() if hint in kinds}
    assert annotated == set(METRICS)
    metrics = WorkerMetrics()
    for attribute, spec in METRICS.items():
        assert hints[attribute] is spec.kind, attribute
        assert type(getattr(metrics, attribute)) is spec.kind, attribute


def test_buckets_are_for_histograms_only() -> None:
    from prometheus_client import CollectorRegistry

    spec = MetricSpec(Counter, "not_a_histogram", "A counter given buckets.", buckets=(1, 2))
    with pytest.raises(TypeError, match="histograms only"):
        spec.register(CollectorRegistry())


def test_every_dead_letter_reason_code_is_a_label_from_the_start() -> None:
    """Dashboards show 0, not "no data", for each code; the label is the code itself."""
    from prometheus_client import generate_latest

    scrape = Scrape(generate_latest(WorkerMetrics().registry).decode())
    for reason in DeadReason:
        assert scrape("embedfleet_dead_letters_total", reason=reason.value) == 0


async def test_stream_gauges_without_a_group_count_every_entry_as_lag(
    settings: Settings, client: aioredis.Redis
) -> None:
    from prometheus_client import generate_latest

    for _ in range(3):
        await client.xadd(settings.keys.ingest, {PAYLOAD_FIELD: b"x"})
    metrics = WorkerMetrics()
    assert await StreamGauges(metrics, client, settings.keys).refresh()
    page = Scrape(generate_latest(metrics.registry).decode())
    assert page("embedfleet_stream_lag", stream="ingest") == 3  # the group starts at id 0
    assert page("embedfleet_stream_lag", stream="query") == 0
    assert page("embedfleet_redis_up") == 1


# --- embedfleet status ----------------------------------------------------------------------
def embedfleet(settings: Settings, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return forks.run(args, text=True, timeout=timeout, env=cli_env(settings))


async def _known_state(settings: Settings, client: aioredis.Redis) -> list[bytes]:
    """40 chunks in job "st"; alpha holds 12 unacknowledged, beta 5; one dead letter."""
    async with Producer(settings, client) as producer:
        await producer.enqueue(builtin_corpus(40, max_chars=200), job="st")
    read: list[bytes] = []
    for consumer, count in (("alpha", 12), ("beta", 5)):
        reply = await client.xreadgroup(
            settings.group, consumer, {settings.keys.ingest: ">"}, count=count
        )
        read += [entry_id for entry_id, _ in reply[0][1]]
    await client.xadd(
        settings.keys.dead,
        {
            "reason": "not_msgpack",
            "detail": "test",
            "stream": settings.keys.ingest,
            "entry_id": "1-1",
        },
    )
    return read


async def test_status_json_agrees_with_xinfo_and_xpending(
    settings: Settings, client: aioredis.Redis
) -> None:
    await _known_state(settings, client)
    result = await asyncio.to_thread(embedfleet, settings, "status", "--json", "--sample", "0")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)

    ingest = data["streams"]["ingest"]
    (group,) = await client.xinfo_groups(settings.keys.ingest)
    pending = await client.xpending(settings.keys.ingest, settings.group)
    consumers = await client.xinfo_consumers(settings.keys.ingest, settings.group)
    assert (ingest["lag"], ingest["pending"]) == (group["lag"], group["pending"]) == (23, 17)
    assert ingest["pending"] == pending["pending"]
    assert ingest["entries_read"] == group["entries-read"] == 17
    assert ingest["length"] == await client.xlen(settings.keys.ingest) == 40
    by_name = {c["name"]: c for c in ingest["consumers"]}
    assert (
        {name: c["pending"] for name, c in by_name.items()}
        == {c["name"].decode(): c["pending"] for c in pending["consumers"]}
        == {"alpha": 12, "beta": 5}
    )
    for consumer in consumers:
        idle = by_name[consumer["name"].decode()]["idle_ms"]
        assert abs(idle - consumer["idle"]) < 5000  # both read a moment apart
    assert data["streams"]["query"]["lag"] == 0 and data["streams"]["query"]["consumers"] == []
    assert data["streams"]["results"]["length"] == 0
    assert data["dead_letters"]["count"] == 1
    latest = data["dead_letters"]["latest"][0]
    # entry_id in the report is the letter's id in the dead-letter stream
    dead_ids = [entry_id.decode() for entry_id, _ in await client.xrange(settings.keys.dead)]
    assert (latest["reason"], latest["detail"], latest["entry_id"]) == (
        "not_msgpack",
        "test",
        dead_ids[-1],
    )
    assert data["jobs"] == [
        {
            "job": "st",
            "enqueued": 40,
            "done": 0,
            "dead": 0,
            "remaining": 40,
            "cache_hits": 0,
            "cache_misses": 0,
            "tokens_saved": 0,
        }
    ]
    assert data["backlog"] == 40 and data["throughput"]["per_s"] is None

    text = await asyncio.to_thread(embedfleet, settings, "status", "--sample", "0")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    ingest_row = next(line for line in lines if line.startswith("ingest "))
    assert ingest_row.split()[1:5] == [settings.keys.ingest, "40", "23", "17"]
    assert any(line.split()[:3] == ["alpha", "12", "0"] for line in lines), text.stdout
    assert any(line.split()[:2] == ["st", "40"] for line in lines), text.stdout
    assert "not_msgpack" in text.stdout


async def test_status_throughput_counts_acknowledged_entries(
    settings: Settings, client: aioredis.Redis
) -> None:
    read = await _known_state(settings, client)
    before = await take_snapshot(client, settings.keys)
    # Finish 10 of alpha's entries the way a worker does: XACK + XDEL.
    await client.xack(settings.keys.ingest, settings.group, *read[:10])
    await client.xdel(settings.keys.ingest, *read[:10])
    after = await take_snapshot(client, settings.keys)

    rate = throughput(before, after)
    assert rate is not None
    assert rate.by_stream["ingest"] * rate.window_s == pytest.approx(10)
    assert rate.by_stream["query"] == 0
    # Backlog: 23 undelivered + 7 still pending.
    assert eta_seconds(after, rate) == pytest.approx(30 / rate.per_s)
    stalled = throughput(after, dataclasses.replace(after, monotonic=after.monotonic + 5))
    assert stalled is not None and stalled.per_s == 0
    assert math.isinf(eta_seconds(after, stalled))

    # --watch keeps about a minute of snapshots and measures over that minute.
    history = History(window_s=60)
    # Whole-second clock values: `after.monotonic + 90 - (after.monotonic + 30)` can round to
    # 59.999..., which made this check depend on the machine's uptime.
    for offset in (0, 30, 61, 62, 90):
        history.add(dataclasses.replace(after, monotonic=1000.0 + offset))
    measured = history.throughput()
    assert measured is not None and 60 <= measured.window_s <= 62


@pytest.mark.parametrize("inherited", ["default", "ignored"])
async def test_status_watch_json_until_ctrl_c(
    settings: Settings, client: aioredis.Redis, inherited: str
) -> None:
    """Ctrl-C ends the watch, also when the process inherited SIGINT ignored: what a
    background job of a non-interactive shell gets (`make test &`). That was the flake: the
    watch then never ended, as asyncio's own Ctrl-C handling is off under SIG_IGN."""
    await _known_state(settings, client)

    def ignore_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def default_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    args = ("status", "--watch", "--json", "--interval", "0.2")
    preexec = ignore_sigint if inherited == "ignored" else default_sigint
    process = await start_cli(cli_env(settings), *args, preexec_fn=preexec)
    assert process.stdout is not None
    frames = [json.loads(await asyncio.wait_for(process.stdout.readline(), 30)) for _ in range(3)]
    process.send_signal(signal.SIGINT)
    _, stderr = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, stderr.decode()
    assert b"Traceback" not in stderr
    assert frames[0]["throughput"]["measuring"] is True
    assert frames[2]["throughput"]["per_s"] == 0  # nothing is being worked on
    assert frames[2]["stalled"] is True and frames[2]["eta_s"] is None
    assert all(frame["streams"]["ingest"]["lag"] == 23 for frame in frames)


def test_status_without_redis_is_a_clear_error(settings: Settings) -> None:
    nowhere = settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{free_port()}/0"})
    result = embedfleet(nowhere, "status", "--sample", "0")
    assert result.returncode == 1
    assert "cannot read the fleet's state from Redis" in result.stderr
    assert "Traceback" not in result.stderr


def test_status_explains_itself() -> None:
    result = forks.run(["status", "--help"], env=os.environ, text=True, timeout=60)
    assert result.returncode == 0 and "--watch" in result.stdout and "--json" in result.stdout
