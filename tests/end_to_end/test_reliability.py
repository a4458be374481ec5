"""Nothing lost: bad input, reclaim, poison messages, drain, Redis restarts, backpressure,
TLS and ACL users. Everything against real redis-server processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import msgpack
import pytest
import redis.asyncio as aioredis
import structlog

from embedfleet.producer import Producer
from embedfleet.producer.chunker import builtin_corpus
from embedfleet.server import ServerProcess, free_port, system_server_binary
from embedfleet.shared.dead_letters import DeadLetter, DeadReason
from embedfleet.shared.protocol import (
    PAYLOAD_FIELD,
    Chunk,
    QueryFailedError,
    decode_result,
    encode_chunk,
)
from embedfleet.shared.redis_conn import connect
from embedfleet.shared.settings import Settings
from tests import forks
from tests.conftest import Recorder, ThreadsOf, WorkerLauncher, WorkerProcess, cli_env, until

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = pytest.mark.slow

if TYPE_CHECKING:
    from embedfleet.workers.reclaim import Reclaimer


def eager_process(
    workers: WorkerLauncher, name: str, settings: Settings, read_count: int, **env: str
) -> WorkerProcess:
    """An `embedfleet worker` process on ``settings`` reading ``read_count`` entries at a time,
    ``env`` added.

    The worker processes here are about signals and draining, not a forward path: the eager
    model, so that their start builds and times no frozen or int8 copy (CI's CPU seconds on its
    slowest class; the paths have tests of their own)."""
    return workers.process(
        name,
        settings,
        EMBEDFLEET_READ_COUNT=str(read_count),
        EMBEDFLEET_FROZEN_QUERIES="false",
        **env,
    )


def raw(message: object) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


BAD_INPUTS: dict[str, tuple[dict[bytes | str, bytes], str]] = {
    "not msgpack": ({PAYLOAD_FIELD: b"\xc1\xc1 definitely not msgpack"}, "not msgpack"),
    "wrong shape": ({PAYLOAD_FIELD: raw(["v", 1])}, "expected a msgpack map"),
    "unknown version": (
        {PAYLOAD_FIELD: raw({"v": 9, "id": "a", "text": "x"})},
        "unknown protocol version",
    ),
    "missing id": ({PAYLOAD_FIELD: raw({"v": 1, "text": "x"})}, "'id' must be"),
    "id not a string": ({PAYLOAD_FIELD: raw({"v": 1, "id": 12, "text": "x"})}, "'id' must be"),
    "missing text": ({PAYLOAD_FIELD: raw({"v": 1, "id": "a"})}, "'text' must be a string"),
    "text not a string": (
        {PAYLOAD_FIELD: raw({"v": 1, "id": "a", "text": [1]})},
        "'text' must be a string",
    ),
    # whitespace is text (embedded, as TEI and sentence-transformers embed it): only "" is refused
    "empty text": ({PAYLOAD_FIELD: raw({"v": 1, "id": "a", "text": ""})}, "'text' is empty"),
    "invalid utf-8": (
        {PAYLOAD_FIELD: b"\x83\xa1v\x01\xa2id\xa1a\xa4text\xa3\xff\xfe\xfd"},
        "invalid UTF-8",
    ),
    "10 MB text": (
        {PAYLOAD_FIELD: raw({"v": 1, "id": "a", "text": "word " * 2_000_000})},
        "over the 4194304-byte limit",
    ),
    "memory bomb": (
        {PAYLOAD_FIELD: b"\x83\xa1v\x01\xa2id\xa1a\xa4text\xdb\x7f\xff\xff\xffab"},
        "not msgpack",
    ),
    "oversized meta": (
        {PAYLOAD_FIELD: raw({"v": 1, "id": "a", "text": "x", "meta": {"blob": "m" * 100_000}})},
        "'meta' is",
    ),
    "no payload field": ({"text": b"hello"}, "no 'm' field"),
}


REASON_OF = {
    "not msgpack": DeadReason.NOT_MSGPACK,
    "wrong shape": DeadReason.NOT_MSGPACK,
    "unknown version": DeadReason.INVALID,
    "missing id": DeadReason.INVALID,
    "id not a string": DeadReason.INVALID,
    "missing text": DeadReason.INVALID,
    "text not a string": DeadReason.INVALID,
    "empty text": DeadReason.INVALID,
    "invalid utf-8": DeadReason.NOT_MSGPACK,
    "10 MB text": DeadReason.TOO_LARGE,
    "memory bomb": DeadReason.NOT_MSGPACK,
    "oversized meta": DeadReason.TOO_LARGE,
    "no payload field": DeadReason.NO_PAYLOAD,
}


@contextlib.asynccontextmanager
async def enqueued(
    settings: Settings, client: aioredis.Redis, count: int, job: str
) -> AsyncIterator[Producer]:
    """A producer that has enqueued the first ``count`` chunks of the built-in corpus as ``job``."""
    async with Producer(settings, client) as producer:
        await producer.enqueue(builtin_corpus(count), job=job)
        yield producer


async def test_every_bad_input_is_dead_lettered_and_the_worker_goes_on(
    workers: WorkerLauncher,
    settings: Settings,
    client: aioredis.Redis,
    encoder,
    threads_of: ThreadsOf,
) -> None:
    from embedfleet.workers import windows as windows_module  # where a window is decoded

    decoding_threads = threads_of(windows_module, "decode_entries")
    async with workers.run(settings) as worker:
        recorder: Recorder = worker.listener
        entry_reasons = {}
        for name, (fields, _) in BAD_INPUTS.items():
            entry_reasons[(await client.xadd(settings.keys.ingest, fields)).decode()] = name
        # an id repeated in one batch: both are valid input, both are embedded
        twice = encode_chunk(Chunk("same-id", "the same id twice"))
        await client.xadd(settings.keys.ingest, {PAYLOAD_FIELD: twice})
        await client.xadd(settings.keys.ingest, {PAYLOAD_FIELD: twice})
        await client.xadd(settings.keys.ingest, {PAYLOAD_FIELD: encode_chunk(Chunk("ok", "fine"))})
        await recorder.wait_for(
            lambda r: sum(r.dead.values()) == len(BAD_INPUTS) and r.texts_written == 3,
            "every bad input dead-lettered and the 3 good ones written",
        )
        # still running and embedding after all that
        await client.xadd(settings.keys.ingest, {PAYLOAD_FIELD: encode_chunk(Chunk("after", "x"))})
        await recorder.wait_for(lambda r: r.texts_written == 4, "the chunk sent after written")
    assert recorder.dead == Counter(REASON_OF.values())  # one letter per bad input, no more
    assert await client.xlen(settings.keys.dead) == len(BAD_INPUTS)
    assert await client.xlen(settings.keys.results) == 4
    for dead_id, fields in await client.xrange(settings.keys.dead):
        letter = DeadLetter.from_fields(dead_id, fields)
        name = entry_reasons[letter.entry_id]
        assert BAD_INPUTS[name][1] in letter.detail, name
        assert letter.reason is REASON_OF[name], name
        sent = BAD_INPUTS[name][0].get(PAYLOAD_FIELD)
        if sent is None:
            assert letter.payload is None and letter.payload_prefix is None
        elif len(sent) > settings.dead_payload_max_bytes:  # 10 MB text, oversized meta
            assert letter.payload is None and letter.payload_prefix == sent[:256], name
        else:  # kept whole, so it can be replayed once fixed
            assert letter.payload == sent, name
    assert (await client.xpending(settings.keys.ingest, settings.group))["pending"] == 0
    # bulk entries are decoded with their tokenization, off the event loop
    assert decoding_threads and all(name.startswith("tokenize") for name in decoding_threads)


async def test_entries_of_a_dead_consumer_are_reclaimed(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, encoder
) -> None:
    fast = settings.model_copy(update={"reclaim_idle_ms": 300})
    async with enqueued(fast, client, 40, "r") as producer:
        # a consumer that reads and dies without acknowledging
        await client.xreadgroup(fast.group, "dead-worker", {fast.keys.ingest: ">"}, count=40)
        async with workers.run(fast) as worker:
            progress = await producer.wait_for_job("r", timeout=60)
            recorder: Recorder = worker.listener

            async def ghost_removed() -> bool:
                consumers = await client.xinfo_consumers(fast.keys.ingest, fast.group)
                return b"dead-worker" not in {c["name"] for c in consumers}

            await until(ghost_removed, timeout=30)
    assert (progress.done, progress.dead) == (40, 0)
    assert recorder.reclaimed_count == 40 and recorder.texts_written == 40
    assert (await client.xpending(fast.keys.ingest, fast.group))["pending"] == 0


async def test_poison_entry_is_dead_lettered_after_max_deliveries(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, encoder
) -> None:
    strict = settings.model_copy(update={"reclaim_idle_ms": 200, "max_deliveries": 3})
    async with Producer(strict, client) as producer:
        await producer.enqueue([Chunk("poison", "kills every worker that reads it")], job="p")
    # three workers in a row read it and die (delivery count reaches 3)
    entry_id = (await client.xreadgroup(strict.group, "w1", {strict.keys.ingest: ">"}))[0][1][0][0]
    for victim in ("w2", "w3"):  # XCLAIM with min-idle 0 counts a delivery at once
        await client.xclaim(strict.keys.ingest, strict.group, victim, 0, [entry_id])
    (info,) = await client.xpending_range(
        strict.keys.ingest, strict.group, min="-", max="+", count=1
    )
    assert info["times_delivered"] == 3
    async with workers.run(strict) as worker:
        recorder: Recorder = worker.listener
        await recorder.wait_for(lambda r: r.dead["deliveries"] == 1, "the poison dead-lettered")
    ((_, fields),) = await client.xrange(strict.keys.dead)
    assert fields[b"deliveries"] == b"3" and b"never acknowledged" in fields[b"detail"]
    assert fields[b"reason"] == DeadReason.DELIVERIES.value.encode()
    assert await client.xlen(strict.keys.results) == 0
    assert (await client.xpending(strict.keys.ingest, strict.group))["pending"] == 0


async def crash_on(client: aioredis.Redis, settings: Settings, times: int) -> None:
    """Workers that read the one ingest entry and die on it ``times`` times in a row (each
    XCLAIM with min-idle 0 counts a delivery at once)."""
    entry_id = (await client.xreadgroup(settings.group, "c1", {settings.keys.ingest: ">"}))[0][1][
        0
    ][0]
    for n in range(2, times + 1):
        await client.xclaim(settings.keys.ingest, settings.group, f"c{n}", 0, [entry_id])


async def test_a_poison_chunk_counts_against_its_job_and_answers_its_caller(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, encoder
) -> None:
    """A chunk dead-lettered by the reclaimer keeps its id, job and reply: the job finishes
    (wait_for_job returns), the caller's reply list gets the error, `dead list --job` shows it."""
    strict = settings.model_copy(update={"reclaim_idle_ms": 200, "max_deliveries": 3})
    async with Producer(strict, client) as producer:
        await producer.enqueue(
            [Chunk("poison", "kills every worker that reads it", reply="caller-1")], job="p"
        )
        await crash_on(client, strict, 3)
        async with workers.run(strict):
            progress = await producer.wait_for_job("p", timeout=60)
    assert (progress.enqueued, progress.done, progress.dead) == (1, 0, 1)
    (answer,) = await client.lrange(strict.keys.reply("caller-1"), 0, -1)
    with pytest.raises(QueryFailedError, match="never acknowledged"):
        decode_result(answer)
    listed = await asyncio.to_thread(
        forks.run,
        ["dead", "list", "--job", "p", "--json"],
        text=True,
        timeout=120,
        env=cli_env(strict),
    )
    assert listed.returncode == 0, listed.stderr[-2000:]
    (row,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert (row["id"], row["job"], row["reason"]) == ("poison", "p", "deliveries")
    assert (await client.xpending(strict.keys.ingest, strict.group))["pending"] == 0


def lone_reclaimer(settings: Settings, client: aioredis.Redis) -> Reclaimer:
    """The reclaimer of ``settings``' consumer with no worker around it: nothing of its own in
    flight, its events and dead letters' events heard by nobody."""
    from embedfleet.workers.dead_letter_writer import DeadLetters
    from embedfleet.workers.events import WorkerEvents
    from embedfleet.workers.reclaim import InFlight, Reclaimer

    return Reclaimer(
        settings,
        client,
        InFlight(),
        DeadLetters(client, settings.keys, WorkerEvents(), 60, 65536),
        WorkerEvents(),
        read_count=settings.batching("cpu").read_count,
    )


async def test_one_reclaim_claims_at_most_one_read(
    settings: Settings, client: aioredis.Redis
) -> None:
    """After a mass restart, one pass takes one read's worth; the next pass goes on from there."""
    READ, IDLE = 10, 35
    small = settings.model_copy(update={"reclaim_idle_ms": 100, "read_count": READ})
    async with Producer(small, client) as producer:
        await producer.enqueue([Chunk(f"c{n}", f"text {n}") for n in range(IDLE)], job="mass")
    await client.xreadgroup(small.group, "gone", {small.keys.ingest: ">"}, count=IDLE)

    async def all_idle() -> bool:
        rows = await client.xpending_range(
            small.keys.ingest, small.group, min="-", max="+", count=IDLE, idle=small.reclaim_idle_ms
        )
        return len(rows) == IDLE

    await until(all_idle)
    reclaimer = lone_reclaimer(small, client)
    pages = [len(await reclaimer.claim(small.keys.ingest)) for _ in range(4)]
    assert pages == [READ, READ, READ, IDLE - 3 * READ]
    pending = await client.xpending(small.keys.ingest, small.group)
    assert {c["name"]: int(c["pending"]) for c in pending["consumers"]} == {
        small.consumer.encode(): IDLE
    }


async def test_live_worker_keeps_its_long_batch(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, encoder
) -> None:
    """Lease renewal: with a reclaim idle far below the batch time, nothing is stolen.

    The test first proves the entries were held past the reclaim idle time (else a thief
    finding nothing would prove nothing), then tries to steal them."""
    COUNT = 400  # several seconds of work, well past the reclaim idle time
    tight = settings.model_copy(update={"reclaim_idle_ms": 500, "read_count": COUNT})
    thief = tight.model_copy(update={"consumer": "thief"})
    idle_s = tight.reclaim_idle_ms / 1000
    async with enqueued(tight, client, COUNT, "lease") as producer, workers.run(tight) as worker:
        recorder: Recorder = worker.listener
        await recorder.wait_for(
            lambda r: r.read[tight.keys.ingest] >= COUNT, "all entries read in one go"
        )
        read_at = time.monotonic()
        # two renewals after the read: a full reclaim period has passed, entries still held
        renewals = recorder.lease_renewals
        await recorder.wait_for(
            lambda r: r.lease_renewals >= renewals + 2 and time.monotonic() - read_at > idle_s,
            "leases renewed past the reclaim idle time",
        )
        held_for = time.monotonic() - read_at
        pending = await client.xpending(tight.keys.ingest, tight.group)
        stolen = await lone_reclaimer(thief, client).claim(thief.keys.ingest)
        written_when_stolen = recorder.texts_written
        await producer.wait_for_job("lease", timeout=600)
    assert held_for > idle_s and written_when_stolen < COUNT
    # still held by the worker when the thief came: pending past the reclaim idle time
    assert pending["pending"] > 0 and {c["name"] for c in pending["consumers"]} == {
        tight.consumer.encode()
    }
    assert stolen == []


async def test_sigterm_drains_and_exits_zero(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis
) -> None:
    async with enqueued(settings, client, 400, "d") as producer:
        # a drain bound far above what finishing its windows takes, even on a loaded machine:
        # the test is that it drains, not that it runs out of time and is cancelled
        worker = eager_process(workers, "drainer", settings, 64, EMBEDFLEET_DRAIN_TIMEOUT_S="600")

        async def started() -> bool:
            return (await producer.progress("d")).done > 0

        await until(started, timeout=300)
        worker.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(worker.wait, 600)
        stderr = worker.log()
        progress = await producer.progress("d")
    assert code == 0, stderr[-2000:]
    assert '"draining' in stderr and '"worker stopped"' in stderr
    pending = await client.xpending(settings.keys.ingest, settings.group)
    assert pending["pending"] == 0, "a drained worker leaves nothing pending"
    # nothing lost: what was not embedded is still waiting in the stream
    assert progress.done + await client.xlen(settings.keys.ingest) == 400


async def test_second_signal_exits_at_once_and_others_reclaim(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, encoder
) -> None:
    fast = settings.model_copy(update={"reclaim_idle_ms": 500})
    async with enqueued(fast, client, 300, "k") as producer:
        worker = eager_process(workers, "impatient", fast, 300, EMBEDFLEET_RECLAIM_IDLE_MS="500")

        async def holding() -> bool:
            return (await client.xpending(fast.keys.ingest, fast.group))["pending"] > 0

        await until(holding, timeout=300)
        worker.send_signal(signal.SIGINT)
        # Two signals sent back to back can arrive as one (POSIX does not queue them): the
        # second goes once the worker says it is draining.
        await worker.wait_for_log('"draining')
        worker.send_signal(signal.SIGINT)
        # exits at once: does not finish the 300; 130 where the forward in flight outlasted
        # the grace (workers/runtime.py SECOND_SIGNAL_GRACE_S)
        code = await asyncio.to_thread(worker.wait, 60)
        async with workers.run(fast):
            progress = await producer.wait_for_job("k", timeout=180)
    assert '"second signal: exiting now' in worker.log()
    assert code in (0, 128 + signal.SIGINT), worker.log()[-2000:]
    assert (progress.done, progress.dead) == (300, 0)


async def test_redis_restart_mid_run_loses_nothing(
    workers: WorkerLauncher, tmp_path: Path, encoder
) -> None:
    binary = system_server_binary()
    if binary is None:
        pytest.skip("needs redis-server for an AOF restart")
    port = free_port()
    aof = ["--appendonly", "yes", "--appendfsync", "always"]

    def server() -> ServerProcess:
        return ServerProcess(binary, port=port, data_dir=tmp_path, extra_args=aof)

    first = server().start()
    settings = Settings(
        redis_url=first.url, namespace="restart", block_ms=100, reclaim_idle_ms=1000
    )
    client = connect(settings.effective_redis_url)
    try:
        async with (
            Producer(settings, client) as producer,
            workers.run(settings) as worker,
        ):
            recorder: Recorder = worker.listener
            await producer.enqueue(builtin_corpus(300), job="aof")
            await recorder.wait_for(lambda r: r.texts_written > 20, "20 written before the stop")
            first.stop()
            await recorder.wait_for(
                lambda r: r.outages.get("redis"), "the worker seeing Redis gone"
            )
            second = server().start()
            try:
                progress = await _wait_through_faults(producer, "aof", timeout=180)
                ids = [r.id async for r in producer.results(job="aof")]
            finally:
                pass
    finally:
        await client.aclose()
        second.stop()
    # exact: the Lua acknowledgement counts and writes an entry once, restart or not
    assert (progress.done, progress.dead) == (300, 0)
    assert sorted(ids) == sorted(c.id for c in builtin_corpus(300))  # one result per id
    assert recorder.transient["redis"] >= 1


async def _wait_through_faults(producer: Producer, job: str, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return await producer.wait_for_job(job, timeout=5)
        except Exception:
            await asyncio.sleep(0.2)
    raise AssertionError("job did not finish after the restart")


async def test_backpressure_holds_producers_at_the_high_water_mark(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, encoder
) -> None:
    capped = settings.model_copy(update={"backlog_high_water": 50})
    async with Producer(capped, client) as producer:
        with structlog.testing.capture_logs() as logged:
            enqueue = asyncio.create_task(
                producer.enqueue(builtin_corpus(200), job="bp", batch_size=25)
            )
            # the producer says when it starts holding back: wait for that, not for a while
            async with asyncio.timeout(60):
                while not any("high-water" in line["event"] for line in logged):
                    await asyncio.sleep(0.05)
        backlog_while_blocked = await client.xlen(capped.keys.ingest)
        assert not enqueue.done() and 50 <= backlog_while_blocked <= 50 + 25
        async with workers.run(capped):
            await enqueue
            progress = await producer.wait_for_job("bp", timeout=120)
    assert progress.done == 200


def _make_tls_files(directory: Path) -> dict[str, Path]:
    files = {name: directory / f"{name}.pem" for name in ("ca", "ca-key", "cert", "key")}
    csr = directory / "server.csr"
    commands = [
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=embedfleet-test-ca",
            "-keyout",
            files["ca-key"],
            "-out",
            files["ca"],
        ],
        [
            "openssl",
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-keyout",
            files["key"],
            "-out",
            csr,
        ],
        [
            "openssl",
            "x509",
            "-req",
            "-in",
            csr,
            "-CA",
            files["ca"],
            "-CAkey",
            files["ca-key"],
            "-CAcreateserial",
            "-days",
            "1",
            "-out",
            files["cert"],
            "-extfile",
            "/dev/stdin",
        ],
    ]
    for command in commands:
        extra = "subjectAltName=DNS:localhost,IP:127.0.0.1\n" if "-extfile" in command else None
        subprocess.run(command, check=True, capture_output=True, input=extra, text=True)
    return files


async def test_tls_and_acl_user(workers: WorkerLauncher, tmp_path: Path, encoder) -> None:
    binary = system_server_binary()
    if binary is None:
        pytest.skip("needs Debian's redis-server (built with TLS)")
    tls = _make_tls_files(tmp_path)
    port = free_port()
    args = [
        "--port",
        "0",
        "--tls-port",
        str(port),
        "--tls-cert-file",
        str(tls["cert"]),
        "--tls-key-file",
        str(tls["key"]),
        "--tls-ca-cert-file",
        str(tls["ca"]),
        "--tls-auth-clients",
        "no",
    ]
    server = ServerProcess(binary, port=free_port(), extra_args=args)
    # the launcher pings the plain port; with TLS only, start it by hand and ping over TLS
    server.port = port
    command = [
        binary,
        "--bind",
        "127.0.0.1",
        "--dir",
        str(tmp_path),
        "--save",
        "",
        "--appendonly",
        "no",
        *args,
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"rediss://embedder:s3cret@localhost:{port}/0?ssl_ca_certs={tls['ca']}"
    try:
        admin = connect(f"rediss://localhost:{port}/0?ssl_ca_certs={tls['ca']}")
        for _ in range(100):
            try:
                await admin.ping()
                break
            except Exception:
                await asyncio.sleep(0.05)
        await admin.execute_command(
            "ACL", "SETUSER", "embedder", "on", ">s3cret", "~*", "&*", "+@all"
        )
        await admin.execute_command("ACL", "SETUSER", "default", "off")
        await admin.aclose()
        anonymous = connect(f"rediss://localhost:{port}/0?ssl_ca_certs={tls['ca']}")
        with pytest.raises(Exception, match=r"(?i)auth|NOPERM|WRONGPASS|disabled"):
            await anonymous.ping()
        await anonymous.aclose()
        settings = Settings(redis_url=url, namespace="tls", block_ms=100)
        client = connect(url)
        async with (
            Producer(settings, client) as producer,
            workers.run(settings),
        ):
            await producer.enqueue([Chunk("secure", "over TLS as an ACL user")], job="tls")
            progress = await producer.wait_for_job("tls", timeout=60)
            vector = await producer.embed_query("and a query", timeout=30)
        await client.aclose()
    finally:
        process.terminate()
        process.wait(timeout=10)
    assert progress.done == 1 and vector.shape == (384,)
