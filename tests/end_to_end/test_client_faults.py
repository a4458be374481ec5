"""The client rides out Redis restarts and dropped connections, on every path.

Each test runs its own redis-server with an AOF (appendfsync always) and SIGKILLs it, as a crash
would, while the path under test is in use, then starts it again on the same port: the path
completes with the right result, no job counter is off by one, and the client said once that it
was waiting and once that Redis was back. A TCP proxy the test controls cuts the connection at
the moment that matters for a pipelined batch: after the server applied it, before the client
read the reply. Synchronisation is on events (the client's outage notices, the proxy's cut, the
CLI's own output), never on sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import pyte
import pytest
import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from embedfleet.ops.dead_letter_admin import REPLAY_SCRIPT
from embedfleet.producer import Producer, QueryTimeoutError
from embedfleet.producer.chunker import builtin_corpus
from embedfleet.producer.enqueue import ENQUEUE_SCRIPT
from embedfleet.server import ServerProcess, free_port, isolated_settings, system_server_binary
from embedfleet.shared.jobs import IDS_TTL_AFTER_DONE_FIELD
from embedfleet.shared.protocol import (
    PAYLOAD_FIELD,
    Chunk,
    Result,
    decode_chunk,
    encode_chunk,
    encode_result,
)
from embedfleet.shared.redis_conn import connect
from embedfleet.shared.retry import RedisUnavailableError
from embedfleet.shared.settings import Settings
from tests import forks
from tests.conftest import WorkerLauncher, shared_encoder, start_cli, until, worker_env

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
# waits: it mostly waits on clients' timeouts (Makefile, test-full)
pytestmark = [pytest.mark.slow, pytest.mark.waits]

AOF = ["--appendonly", "yes", "--appendfsync", "always"]


# --- the test's own Redis, and what the client says about it --------------------------------------
@pytest.fixture
def aof_server(tmp_path: Path) -> Iterator[ServerProcess]:
    binary = system_server_binary()
    if binary is None:
        pytest.skip("needs redis-server for an AOF restart")
    data = tmp_path / "redis"
    data.mkdir()
    server = ServerProcess(binary, data_dir=data, extra_args=AOF).start()
    yield server
    server.stop()


@dataclass
class AofRedis:
    """The test's own Redis, which it SIGKILLs and starts again on the same port (its AOF keeps
    what was written); the settings on it; and a client of the test's own, straight to the
    server (never through the proxy)."""

    server: ServerProcess
    settings: Settings
    direct: aioredis.Redis

    async def start_again(self) -> None:
        await asyncio.to_thread(self.server.start)

    async def restart_when_down(self, outages: Outages) -> None:
        """Start the killed server again once the client has found it gone."""
        await outages.down.wait()
        await self.start_again()

    async def reconnected(self) -> aioredis.Redis:
        """The direct client without the connections the killed server left it (the test's
        checks are not the client under test: they should not have to ride anything out)."""
        await self.direct.connection_pool.disconnect()
        return self.direct

    async def restart_seen_by(self, cli_output: WaitsForText) -> None:
        """SIGKILL the server; start it again once the CLI says it is waiting for Redis, and
        return once it says Redis is back."""
        self.server.kill()
        await cli_output.wait_for("waiting for Redis")
        await self.start_again()
        await cli_output.wait_for("is back")

    async def counters(self, job: str) -> dict[str, int]:
        values = await self.direct.hgetall(self.settings.keys.job(job))
        zero = {"enqueued": 0, "done": 0, "dead": 0}
        counters = {k.decode(): int(v) for k, v in values.items()}
        counters.pop(IDS_TTL_AFTER_DONE_FIELD, None)  # not a counter: the id record's TTL
        return zero | counters


class WaitsForText(Protocol):
    """A CLI's output as the test reads it (a pipe, or the screen of a terminal)."""

    async def wait_for(self, text: str) -> None: ...


@pytest.fixture
async def aof(aof_server: ServerProcess) -> AsyncIterator[AofRedis]:
    # queries run eager: no graph to build at the first worker's start
    settings = isolated_settings(aof_server.url, frozen_queries=False)
    direct = connect(settings.effective_redis_url)
    yield AofRedis(aof_server, settings, direct)
    await direct.aclose()


@pytest.fixture
def aof_workers(aof: AofRedis, encoder, tmp_path: Path) -> Iterator[WorkerLauncher]:
    """Workers on the test's own server; the model is loaded before the test kills anything."""
    launcher = WorkerLauncher(aof.settings, shared_encoder, tmp_path)
    yield launcher
    launcher.stop_all()


class Outages:
    """An OutageListener that counts the notices and lets the test wait for them."""

    def __init__(self) -> None:
        self.down, self.back = asyncio.Event(), asyncio.Event()
        self.downs = self.backs = 0

    def redis_down(self, server: str, error: BaseException, give_up_after_s: float) -> None:
        self.downs += 1
        self.down.set()

    def redis_back(self, server: str, down_s: float) -> None:
        self.backs += 1
        self.back.set()


def chunks_of(count: int, job: str) -> list[Chunk]:
    texts = [chunk.text for chunk in builtin_corpus(max_chars=200)]
    return [Chunk(id=f"c{i}", text=texts[i % len(texts)], job=job) for i in range(count)]


def write_jsonl(path: Path, chunks: list[Chunk]) -> None:
    """``chunks`` as the JSON lines `embedfleet enqueue` reads."""
    path.write_text("".join(json.dumps({"id": c.id, "text": c.text}) + "\n" for c in chunks))


async def stream_ids(client: aioredis.Redis, stream: str) -> list[str]:
    return [decode_chunk(fields[PAYLOAD_FIELD]).id for _, fields in await client.xrange(stream)]


# --- a proxy that cuts the connection at the moment the test chooses ------------------------------
def eval_of(script: str) -> bytes:
    """How a pipelined EVAL of ``script`` looks in RESP: the command's name, then the script as
    a bulk string of its length (a batch carries other scripts too: the backlog check's)."""
    return b"\r\nEVAL\r\n$%d\r\n" % len(script.encode())


class BatchCutter:
    """A TCP proxy between the client and Redis that cuts one pipelined batch's connection.

    It counts the EVALs of ``script`` (one enqueue script per batch) the client sends. At the
    ``cut_at``-th it calls ``on_cut`` and closes both sides: with ``applied=True`` after Redis
    ran the batch, when its first reply bytes come back (they are not passed on), so the client
    never learns that it was applied; with ``applied=False`` before the batch reaches Redis.
    """

    def __init__(
        self,
        upstream_port: int,
        *,
        cut_at: int,
        applied: bool,
        on_cut: Callable[[], Awaitable[None]],
        script: str = ENQUEUE_SCRIPT,
    ) -> None:
        self.upstream_port = upstream_port
        self.eval = eval_of(script)
        self.cut_at, self.applied, self.on_cut = cut_at, applied, on_cut
        self.evals_seen = 0
        # EVALs a restarted Redis refused while it was still reading its AOF (-LOADING): they
        # never ran, and the client rightly sends them again
        self.refused_while_loading = 0
        self.cut = asyncio.Event()
        self._handlers: set[asyncio.Task[None]] = set()
        self._sockets: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def evals_run(self) -> int:
        """EVALs that reached a Redis able to run them."""
        return self.evals_seen - self.refused_while_loading

    async def __aenter__(self) -> BatchCutter:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        for socket in self._sockets:  # each relay then sees its end of file and returns
            socket.close()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()  # asyncio runs each connection as a task of its own
        assert handler is not None
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)
        try:
            upstream_reader, upstream = await asyncio.open_connection(
                "127.0.0.1", self.upstream_port
            )
        except OSError:  # Redis is down: so is this connection
            writer.close()
            return
        self._sockets |= {writer, upstream}
        reply_to_cut = asyncio.Event()

        async def to_server() -> None:
            tail = b""
            while data := await reader.read(65536):
                window = tail + data
                tail = window[-(len(self.eval) - 1) :]
                before = self.evals_seen
                self.evals_seen += window.count(self.eval)
                if not self.cut.is_set() and before < self.cut_at <= self.evals_seen:
                    if not self.applied:
                        await self._cut()
                        return
                    reply_to_cut.set()  # before forwarding: the reply cannot come sooner
                upstream.write(data)
                await upstream.drain()

        async def to_client() -> None:
            while data := await upstream_reader.read(65536):
                if reply_to_cut.is_set() and not self.cut.is_set():
                    await self._cut()
                    return
                self.refused_while_loading += data.count(b"-LOADING")
                writer.write(data)
                await writer.drain()

        pumps = [asyncio.create_task(to_server()), asyncio.create_task(to_client())]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            writer.close()
            upstream.close()
            self._sockets -= {writer, upstream}

    async def _cut(self) -> None:
        await self.on_cut()
        self.cut.set()


# --- enqueue, mid-pipelined batch -----------------------------------------------------------------
@pytest.mark.parametrize("applied", [True, False], ids=["after-redis-applied-it", "before"])
async def test_enqueue_rides_out_a_sigkill_mid_batch(aof: AofRedis, applied: bool) -> None:
    """Redis SIGKILLed with a batch in flight: the batch is sent again after the restart and
    every chunk is added and counted once, whether or not Redis had applied it."""
    chunks = chunks_of(150, "j")
    counted_at_cut: list[int] = []

    async def kill() -> None:
        counted_at_cut.append((await aof.counters("j"))["enqueued"])
        aof.server.kill()

    outages = Outages()
    async with BatchCutter(aof.server.port, cut_at=2, applied=applied, on_cut=kill) as cutter:
        proxied = aof.settings.model_copy(
            update={"redis_url": f"redis://127.0.0.1:{cutter.port}/0"}
        )
        restart = asyncio.create_task(aof.restart_when_down(outages))
        async with Producer(proxied, on_outage=outages) as producer:
            sent = await producer.enqueue(chunks, job="j", batch_size=50)
            progress = await producer.progress("j")
        await restart
    assert cutter.cut.is_set() and counted_at_cut == [100 if applied else 50]
    assert cutter.evals_run == 4  # three batches, the second one twice
    assert (outages.downs, outages.backs) == (1, 1)
    assert sent == 150 and progress.enqueued == 150
    ids = await stream_ids(await aof.reconnected(), aof.settings.keys.ingest)
    assert len(ids) == 150 and set(ids) == {c.id for c in chunks}


async def test_a_reply_lost_after_the_batch_was_applied_is_re_sent_and_counted_once(
    aof: AofRedis, aof_workers: WorkerLauncher
) -> None:
    """The connection dropped between a batch's write and its reply: the client cannot tell
    whether it was applied and sends it again; every id is embedded once and ``enqueued``
    equals the number of distinct ids."""
    chunks = chunks_of(120, "drop")
    counted_at_cut: list[int] = []

    async def note() -> None:
        counted_at_cut.append((await aof.counters("drop"))["enqueued"])

    outages = Outages()
    async with BatchCutter(aof.server.port, cut_at=2, applied=True, on_cut=note) as cutter:
        proxied = aof.settings.model_copy(
            update={"redis_url": f"redis://127.0.0.1:{cutter.port}/0"}
        )
        async with Producer(proxied, on_outage=outages) as producer:
            await producer.enqueue(chunks, job="drop", batch_size=40)
    async with Producer(aof.settings, aof.direct) as producer:
        async with aof_workers.run(client=aof.direct):
            progress = await producer.wait_for_job("drop", timeout=300)
        results = [result async for result in producer.results(job="drop")]
    assert counted_at_cut == [80] and cutter.evals_run == 4  # applied, then re-sent
    assert outages.downs == 1 and outages.backs == 1
    ids = [result.id for result in results]
    assert len(ids) == 120 and set(ids) == {c.id for c in chunks}  # each embedded once
    assert (progress.enqueued, progress.done, progress.dead) == (120, 120, 0)


# --- Redis out of memory (maxmemory, noeviction) --------------------------------------------------
FILLER = "filler"


async def fill_up(client: aioredis.Redis) -> int:
    """Write filler keys until Redis refuses writes (OOM); how many it took. Large values first,
    then small ones: a refused large SET frees its own query buffer and can leave memory just
    under the limit; a refused small one leaves it over, so every write is refused after."""
    keys = 0
    for size in (64 * 1024, 64):
        with contextlib.suppress(redis_errors.OutOfMemoryError):
            while True:
                await client.set(f"{FILLER}:{keys}", b"x" * size)
                keys += 1
    return keys


@pytest.fixture
def full_server() -> Iterator[ServerProcess]:
    """A Redis with a small maxmemory and noeviction, the fleet's policy: full, it refuses
    writes instead of dropping keys."""
    extra = ["--maxmemory", "8mb", "--maxmemory-policy", "noeviction"]
    with ServerProcess(system_server_binary() or None, extra_args=extra) as server:
        yield server


async def test_enqueue_waits_while_redis_is_out_of_memory(full_server: ServerProcess) -> None:
    """OOM is transient: the producer waits (one outage notice) and sends once memory is freed."""
    settings = isolated_settings(full_server.url, redis_retry_s=120)
    chunks = chunks_of(30, "oom")
    other = connect(settings.effective_redis_url)
    outages = Outages()
    async with Producer(settings, on_outage=outages) as producer:
        await producer.progress("oom")  # connected before Redis fills up
        filler_keys = await fill_up(other)
        enqueue = asyncio.create_task(producer.enqueue(chunks, job="oom"))
        down = asyncio.create_task(outages.down.wait())
        await asyncio.wait({enqueue, down}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        down.cancel()
        if enqueue.done():  # failed at once (or, full as it is, wrote): either way, not waiting
            raise AssertionError(f"enqueue did not wait for memory: {enqueue.exception()!r}")
        assert outages.down.is_set() and outages.backs == 0
        # an operator (or the workers draining the backlog) frees memory
        for start in range(0, filler_keys, 500):
            await other.unlink(
                *(f"{FILLER}:{n}" for n in range(start, min(start + 500, filler_keys)))
            )
        sent = await asyncio.wait_for(enqueue, timeout=60)
        progress = await producer.progress("oom")
    ids = await stream_ids(other, settings.keys.ingest)
    await other.aclose()
    assert sent == 30 and progress.enqueued == 30 and sorted(ids) == sorted(c.id for c in chunks)
    assert (outages.downs, outages.backs) == (1, 1)


async def test_a_client_that_gives_up_on_a_full_redis_says_it_is_full(
    full_server: ServerProcess,
) -> None:
    settings = isolated_settings(full_server.url, redis_retry_s=0.5)
    other = connect(settings.effective_redis_url)
    async with Producer(settings, on_outage=Outages()) as producer:
        await producer.progress("full")
        await fill_up(other)
        with pytest.raises(RedisUnavailableError, match="maxmemory") as raised:
            await producer.enqueue(chunks_of(3, "full"), job="full")
    await other.aclose()
    assert "refused writes" in str(raised.value) and "drain the backlog" in str(raised.value)


# --- following a job, reading results, queries ----------------------------------------------------
async def test_wait_for_job_rides_out_a_sigkill(aof: AofRedis, aof_workers: WorkerLauncher) -> None:
    outages = Outages()
    polled = asyncio.Event()
    chunks = chunks_of(40, "w")
    async with Producer(aof.settings, on_outage=outages) as producer:
        await producer.enqueue(chunks, job="w")
        waiting = asyncio.create_task(
            producer.wait_for_job("w", interval=0.05, on_progress=lambda _: polled.set())
        )
        await polled.wait()  # the wait is under way, with nothing done yet
        aof.server.kill()
        await aof.restart_when_down(outages)
        async with aof_workers.run(client=await aof.reconnected()):
            progress = await asyncio.wait_for(waiting, 300)
    assert (progress.enqueued, progress.done, progress.dead) == (40, 40, 0)
    assert (outages.downs, outages.backs) == (1, 1)
    # each embedded once: the vector cache's misses too (an entry redelivered after the
    # restart is looked up again only if it was not acknowledged)
    assert await aof.counters("w") == {"enqueued": 40, "done": 40, "dead": 0, "cache_misses": 40}


async def test_results_ride_out_a_sigkill_between_pages(aof: AofRedis) -> None:
    rng = np.random.default_rng(20)
    written = [
        Result(id=f"r{i}", model="m", vector=rng.standard_normal(8).astype(np.float16), job="r")
        for i in range(35)
    ]
    for result in written:
        await aof.direct.xadd(aof.settings.keys.results, {PAYLOAD_FIELD: encode_result(result)})
    outages = Outages()
    read: list[Result] = []
    async with Producer(aof.settings, on_outage=outages) as producer:
        restart = asyncio.create_task(aof.restart_when_down(outages))
        async for result in producer.results(job="r", page=10):
            read.append(result)
            if len(read) == 5:  # in the middle of the first page: the next page meets no server
                aof.server.kill()
        await restart
    assert [r.id for r in read] == [r.id for r in written]  # each once, in order
    assert all(np.array_equal(a.vector, b.vector) for a, b in zip(read, written, strict=True))
    assert (outages.downs, outages.backs) == (1, 1)


async def test_queries_ride_out_a_sigkill_within_their_timeout(
    aof: AofRedis, aof_workers: WorkerLauncher, encoder
) -> None:
    texts = ["how do I open a file?", "what is a generator?", "sort a list in place"]
    outages = Outages()
    async with Producer(aof.settings, on_outage=outages) as producer:
        asking = asyncio.create_task(producer.embed_queries(texts, timeout=240))
        one = asyncio.create_task(producer.embed_query(texts[0], timeout=240))

        async def all_queued() -> bool:
            return await aof.direct.xlen(aof.settings.keys.query) == 4

        await until(all_queued)  # both calls are blocked on their reply keys: no worker yet
        aof.server.kill()
        await aof.restart_when_down(outages)
        async with aof_workers.run(client=await aof.reconnected()):
            vectors, single = await asyncio.wait_for(asyncio.gather(asking, one), 240)
    expected = encoder.embed_texts(texts)
    assert vectors.shape == (3, 384)
    assert min(float(v @ e) for v, e in zip(vectors, expected, strict=True)) > 0.999
    assert float(single @ expected[0]) > 0.999
    assert (outages.downs, outages.backs) == (1, 1)


# --- the bound, and the message that names the server ---------------------------------------------
async def test_the_client_gives_up_after_the_bound_and_names_the_server() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    outages = Outages()
    bounded = Settings(redis_url=url, redis_retry_s=0.5)
    started = time.monotonic()
    with pytest.raises(RedisUnavailableError) as raised:
        async with Producer(bounded, on_outage=outages) as producer:
            await producer.enqueue([Chunk("a", "text")], job="j")
    assert time.monotonic() - started < 5
    assert url in str(raised.value) and "EMBEDFLEET_REDIS_RETRY_S" in str(raised.value)
    assert (outages.downs, outages.backs) == (1, 0)

    # a query gives up at its own timeout, not at the (long) bound
    patient = Producer(Settings(redis_url=url, redis_retry_s=300), on_outage=Outages())
    started = time.monotonic()
    with pytest.raises(QueryTimeoutError, match="unreachable") as timed_out:
        await patient.embed_query("anything", timeout=0.5)
    await patient.close()
    assert time.monotonic() - started < 5 and url in str(timed_out.value)


# --- the command line -----------------------------------------------------------------------------
class Output:
    """A subprocess's stdout or stderr, read as it comes; the test waits for text in it."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self.data = bytearray()
        self.closed = False
        self._changed = asyncio.Condition()
        self._task = asyncio.create_task(self._read(stream))

    async def _read(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(4096):
            async with self._changed:
                self.data += chunk
                self._changed.notify_all()
        async with self._changed:
            self.closed = True
            self._changed.notify_all()

    @property
    def text(self) -> str:
        return self.data.decode(errors="replace")

    async def wait_for(self, text: str, *, count: int = 1, timeout: float = 120) -> None:
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: self.text.count(text) >= count or self.closed)
        assert self.text.count(text) >= count, f"{text!r} not seen in: {self.text[-3000:]}"

    async def finished(self) -> str:
        await self._task
        return self.text


@contextlib.asynccontextmanager
async def cli(
    env: dict[str, str], *args: str
) -> AsyncIterator[tuple[asyncio.subprocess.Process, Output, Output]]:
    process = await start_cli(env, *args)
    assert process.stdout is not None and process.stderr is not None
    stdout, stderr = Output(process.stdout), Output(process.stderr)
    try:
        yield process, stdout, stderr
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def said_once(stderr: str, server: str) -> None:
    assert stderr.count(f"waiting for Redis at {server}") == 1, stderr[-3000:]
    assert stderr.count(f"Redis at {server} is back after") == 1, stderr[-3000:]
    assert "Traceback" not in stderr


async def test_cli_enqueue_wait_keeps_its_bar_across_a_sigkill(
    aof: AofRedis, aof_workers: WorkerLauncher, tmp_path: Path
) -> None:
    source, chunks = tmp_path / "chunks.jsonl", chunks_of(60, "cli")
    write_jsonl(source, chunks)
    env = worker_env(aof.settings)
    async with cli(env, "enqueue", str(source), "--job", "cli", "--wait") as (process, out, err):
        await err.wait_for("enqueue: finished")  # every chunk sent: now it follows the job
        await aof.restart_seen_by(err)
        async with aof_workers.run(client=await aof.reconnected()):
            code = await asyncio.wait_for(process.wait(), 300)
        stdout, stderr = await out.finished(), await err.finished()
    assert code == 0, stderr[-3000:]
    assert "enqueued 60 chunks as job 'cli'" in stdout
    said_once(stderr, aof.settings.effective_redis_url)
    # Off a terminal the bar is a log line per 10 s and one at the end: the same one, across
    # the outage, finishing with the right totals.
    after_outage = stderr.rsplit("is back", 1)[1]
    finished = [json.loads(line) for line in after_outage.splitlines() if "embedded: fin" in line]
    assert [(line["chunks"], line["total"]) for line in finished] == [(60, 60)]
    assert await aof.counters("cli") == {"enqueued": 60, "done": 60, "dead": 0, "cache_misses": 60}


class Terminal:
    """A CLI run in a pseudo-terminal, its output fed to ``pyte`` (a VT100 emulator): the test
    reads the screen a person would see, and waits for text to appear on it."""

    COLUMNS, ROWS = 120, 200

    def __init__(self, env: dict[str, str], *args: str) -> None:
        self._leader, follower = os.openpty()
        # the window size tqdm reads to draw its bar (TIOCGWINSZ)
        size = struct.pack("HHHH", self.ROWS, self.COLUMNS, 0, 0)
        fcntl.ioctl(follower, termios.TIOCSWINSZ, size)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "embedfleet.cli", *args],
            stdin=follower,
            stdout=follower,
            stderr=follower,
            env={**env, "COLUMNS": str(self.COLUMNS), "TERM": "xterm-256color"},
            start_new_session=True,
        )
        os.close(follower)
        self.screen = pyte.Screen(self.COLUMNS, self.ROWS)
        self._stream = pyte.ByteStream(self.screen)
        self._fed = asyncio.Event()
        self.closed = False
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._leader, self._read)

    def _read(self) -> None:
        try:
            data = os.read(self._leader, 65536)
        except OSError:  # EIO: every process holding the terminal has exited
            data = b""
        if data:
            self._stream.feed(data)
        else:
            self._loop.remove_reader(self._leader)
            self.closed = True
        self._fed.set()

    @property
    def lines(self) -> list[str]:
        return [line.rstrip() for line in self.screen.display if line.strip()]

    async def wait_for(self, text: str, timeout: float = 120) -> None:
        async with asyncio.timeout(timeout):
            while not any(text in line for line in self.lines) and not self.closed:
                self._fed.clear()
                await self._fed.wait()
        assert any(text in line for line in self.lines), "\n".join(self.lines)

    async def finished(self, timeout: float = 300) -> int:
        code = await asyncio.wait_for(asyncio.to_thread(self.process.wait), timeout)
        async with asyncio.timeout(30):
            while not self.closed:
                self._fed.clear()
                await self._fed.wait()
        return code

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if not self.closed:
            self._loop.remove_reader(self._leader)
        os.close(self._leader)


async def test_cli_enqueue_wait_keeps_its_bar_on_a_terminal_across_a_sigkill(
    aof: AofRedis, aof_workers: WorkerLauncher, tmp_path: Path
) -> None:
    """What a person at a terminal sees: the two notices above one bar, finished at 60/60."""
    source, chunks = tmp_path / "chunks.jsonl", chunks_of(60, "tty")
    write_jsonl(source, chunks)
    terminal = Terminal(worker_env(aof.settings), "enqueue", str(source), "--job", "tty", "--wait")
    try:
        await terminal.wait_for("embedded:")  # the wait's bar is drawn: every chunk was sent
        await aof.restart_seen_by(terminal)
        async with aof_workers.run(client=await aof.reconnected()):
            code = await terminal.finished()
        screen = terminal.lines
    finally:
        terminal.close()
    text = "\n".join(screen)
    print(text)  # the screen, for whoever reads a failure
    assert code == 0
    server = aof.settings.effective_redis_url
    waiting = [i for i, line in enumerate(screen) if f"waiting for Redis at {server}" in line]
    back = [i for i, line in enumerate(screen) if f"Redis at {server} is back after" in line]
    bars = [i for i, line in enumerate(screen) if line.startswith("embedded:")]
    assert len(waiting) == 1 and len(back) == 1 and len(bars) == 1, text
    # the notices went above the bar, which was drawn again below them and finished there
    assert waiting[0] < back[0] < bars[0]
    assert re.search(r"100%\|.*\| 60/60 \[", screen[bars[0]]), screen[bars[0]]
    assert "enqueued 60 chunks as job 'tty'" in text
    assert await aof.counters("tty") == {"enqueued": 60, "done": 60, "dead": 0, "cache_misses": 60}


async def test_cli_status_watch_rides_out_a_sigkill(aof: AofRedis) -> None:
    async with Producer(aof.settings, aof.direct) as producer:
        await producer.enqueue(chunks_of(23, "st"), job="st")
    env = {**worker_env(aof.settings)}
    args = ("status", "--watch", "--json", "--interval", "0.2")
    async with cli(env, *args) as (process, out, err):
        await out.wait_for("\n")
        await aof.restart_seen_by(err)
        frames_before = out.text.count("\n")
        await out.wait_for("\n", count=frames_before + 1)  # watching again
        process.send_signal(signal.SIGINT)
        code = await asyncio.wait_for(process.wait(), 60)
        stdout, stderr = await out.finished(), await err.finished()
    assert code == 0, stderr[-3000:]
    said_once(stderr, aof.settings.effective_redis_url)
    last = json.loads(stdout.splitlines()[-1])
    assert last["jobs"] == [
        {
            "job": "st",
            "enqueued": 23,
            "done": 0,
            "dead": 0,
            "remaining": 23,
            "cache_hits": 0,
            "cache_misses": 0,
            "tokens_saved": 0,
        }
    ]
    assert last["streams"]["ingest"]["lag"] == 23


async def test_cli_search_rides_out_a_sigkill(
    aof: AofRedis, aof_workers: WorkerLauncher, tmp_path: Path
) -> None:
    from embedfleet.sinks import build_sink

    sink = f"lancedb://{tmp_path / 'vectors'}"
    settings = aof.settings.model_copy(update={"sink": sink})
    chunks = chunks_of(12, "s")

    def sink_worker() -> contextlib.AbstractAsyncContextManager[object]:
        return aof_workers.run(settings, sink=build_sink(settings, aof.direct), client=aof.direct)

    async with Producer(settings, aof.direct) as producer, sink_worker():
        await producer.enqueue(chunks, job="s")
        await producer.wait_for_job("s", timeout=300)
    env = worker_env(settings, EMBEDFLEET_SINK=sink)
    args = ("search", chunks[3].text, "--k", "2", "--json", "--timeout", "240")
    async with cli(env, *args) as (process, out, err):

        async def queued() -> bool:
            return await aof.direct.xlen(settings.keys.query) == 1

        await until(queued)  # the query is in: the CLI is blocked on its reply, no worker
        aof.server.kill()
        await err.wait_for("waiting for Redis")
        await aof.start_again()
        await aof.reconnected()
        async with sink_worker():
            code = await asyncio.wait_for(process.wait(), 300)
        stdout, stderr = await out.finished(), await err.finished()
    assert code == 0, stderr[-3000:]
    said_once(stderr, settings.effective_redis_url)
    hits = [json.loads(line) for line in stdout.splitlines()]
    assert [hit["id"] for hit in hits][:1] == [chunks[3].id] and len(hits) == 2


@pytest.mark.parametrize(
    "verb", [["enqueue", "{source}"], ["query", "hello"], ["dead", "list"], ["calibration"]]
)
def test_a_verb_whose_redis_never_came_up_says_so_within_seconds(
    tmp_path: Path, verb: list[str]
) -> None:
    """A Redis that was never reached is a wrong URL or a server not started: the verb names the
    server and EMBEDFLEET_REDIS_CONNECT_S and exits 1 within seconds, not after the 300 s an
    outage is ridden out for."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    source = tmp_path / "one.jsonl"
    source.write_text('{"id": "a", "text": "hello"}\n')
    env = {**os.environ, "EMBEDFLEET_REDIS_URL": url, "EMBEDFLEET_REDIS_CONNECT_S": "1"}
    args = [part.format(source=source) for part in verb]
    started = time.monotonic()
    result = forks.run(args, text=True, env=env, timeout=120)
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    assert result.stderr.count(f"waiting for Redis at {url}") <= 1
    assert f"Redis at {url} unreachable" in result.stderr
    assert "EMBEDFLEET_REDIS_CONNECT_S" in result.stderr and "Traceback" not in result.stderr
    # the bound (1 s) plus the interpreter's start and imports, far from EMBEDFLEET_REDIS_RETRY_S
    assert elapsed < 60, f"{verb} took {elapsed:.1f}s to give up"


def test_the_first_contact_bound_holds_only_until_redis_was_reached() -> None:
    from embedfleet.shared.retry import RedisRetry

    retry = RedisRetry("redis://x", give_up_after_s=300.0, first_contact_s=2.0)
    assert retry.bound == (2.0, "EMBEDFLEET_REDIS_CONNECT_S")
    retry.attempts("read").succeeded()
    assert retry.bound == (300.0, "EMBEDFLEET_REDIS_RETRY_S")  # now an outage: ride it out
    assert RedisRetry("redis://x", 300.0).bound == (300.0, "EMBEDFLEET_REDIS_RETRY_S")


async def test_an_inner_retry_that_gave_up_is_not_retried_again() -> None:
    """RedisUnavailableError is a redis ConnectionError (transient by type), yet final: a retry
    around a call that retries on its own must not wait the bound a second time."""
    from embedfleet.shared.retry import RedisRetry

    url = f"redis://127.0.0.1:{free_port()}/0"
    inner = Producer(Settings(redis_url=url, redis_retry_s=0.3), on_outage=Outages())
    outer = RedisRetry(url, give_up_after_s=300, listener=Outages())
    started = time.monotonic()
    with pytest.raises(RedisUnavailableError):
        await outer.call("read progress", lambda: inner.progress("j"))
    await inner.close()
    assert time.monotonic() - started < 5


# --- dead letters ------------------------------------------------------------------------------
async def write_dead_letters(
    client: aioredis.Redis, settings: Settings, job: str, count: int
) -> list[Chunk]:
    """A job whose chunks all ended as dead letters, written as a worker writes them."""
    from embedfleet.shared.dead_letters import DeadReason, dead_letter_fields

    chunks = chunks_of(count, job)
    for index, chunk in enumerate(chunks):
        fields = dead_letter_fields(
            reason=DeadReason.TOO_LONG,
            detail="over the model's 256 tokens",
            stream=settings.keys.ingest,
            entry_id=f"1-{index}",
            payload=encode_chunk(chunk),
            max_payload_bytes=settings.dead_payload_max_bytes,
            chunk_id=chunk.id,
            job=job,
        )
        await client.xadd(settings.keys.dead, fields)
    await client.hset(settings.keys.job(job), mapping={"enqueued": count, "dead": count})
    return chunks


async def test_cli_dead_replay_rides_out_a_sigkill_after_a_replay_was_applied(
    aof: AofRedis,
) -> None:
    """Redis killed right after it ran the second letter's replay, before the CLI read the
    reply: the CLI waits, sends that replay again, and every letter is replayed exactly once."""
    chunks = await write_dead_letters(aof.direct, aof.settings, "dj", 5)

    async def kill() -> None:
        aof.server.kill()

    cut = BatchCutter(aof.server.port, cut_at=2, applied=True, on_cut=kill, script=REPLAY_SCRIPT)
    async with cut as cutter:
        proxied = f"redis://127.0.0.1:{cutter.port}/0"
        env = {**worker_env(aof.settings), "EMBEDFLEET_REDIS_URL": proxied}
        async with cli(env, "dead", "replay", "--job", "dj") as (process, out, err):
            await err.wait_for("waiting for Redis")
            await aof.start_again()
            code = await asyncio.wait_for(process.wait(), 120)
            stdout, stderr = await out.finished(), await err.finished()
    assert code == 0, stderr[-3000:]
    assert cutter.cut.is_set() and cutter.evals_run == 6  # five replays, the second one twice
    said_once(stderr, proxied)
    assert "replayed 5, skipped 0" in stdout, stdout + stderr
    await aof.reconnected()
    assert await aof.direct.xlen(aof.settings.keys.dead) == 0
    ids = await stream_ids(aof.direct, aof.settings.keys.ingest)
    assert sorted(ids) == sorted(chunk.id for chunk in chunks)  # each sent once
    assert await aof.counters("dj") == {"enqueued": 5, "done": 0, "dead": 0}


async def test_cli_dead_list_waits_for_redis_to_come_back(aof: AofRedis) -> None:
    chunks = await write_dead_letters(aof.direct, aof.settings, "dl", 3)
    aof.server.kill()  # the verb starts while Redis is away
    async with cli(worker_env(aof.settings), "dead", "list", "--json") as (process, out, err):
        await err.wait_for("waiting for Redis")
        await aof.start_again()
        code = await asyncio.wait_for(process.wait(), 120)
        stdout, stderr = await out.finished(), await err.finished()
    assert code == 0, stderr[-3000:]
    said_once(stderr, aof.settings.effective_redis_url)
    listed = [json.loads(line) for line in stdout.splitlines()]
    assert [letter["id"] for letter in listed] == [chunk.id for chunk in chunks]
