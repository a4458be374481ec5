"""The host pipeline without the model (issue 29): ``python -m loadtest.host_pipeline``.

Everything a worker does around the model, end to end through a real redis-server, with the
benchmark stand-in encoder at zero cost (workers/model/standin.py: the model's real tokenizer,
maximum and dimension, made-up vectors, no forward pass): read, decode and validate, prompt,
tokenize, sort and plan, collate, "encode", cast, pack msgpack, write and acknowledge.

Each round, for each configuration (``--processes`` × ``--path``, interleaved, the order
rotated every round):

1. the ingest stream is filled with the corpus (loadtest/corpus.py, RAG-sized texts) before
   any worker reads;
2. N worker processes (this module's ``--child``: the worker the CLI builds, with the stand-in,
   the Redis results sink, and stage timers) load their tokenizer and wait;
3. all are told to go at once; the clock runs from then to the last result's entry id time
   on the results stream (start-up after the model load, warm-up and the first read included).

Each child times its stages by wrapping the functions that do them (the wrappers are installed
in the benchmark's own process only; the worker runs unchanged) and reads its threads' CPU
clocks; it reports, per stage, the wall time per entry and the share of its thread's wall time,
and per thread (event loop, tokenizer, model) the CPU share. Alongside, in the parent, the raw
tokenizer's rate on the same texts, in windows of the worker's read count, on one thread (as a
CPU worker tokenizes: TOKENIZERS_PARALLELISM=false): the floor the pipeline is compared with.

``--path before`` undoes issue 29's fixes in the child (one ``encode_result`` per result, the
masked-window planning programme, both kept here), ``--path after`` runs the worker as it is:
both in one run, so the ratio between them is measured under the same load.

Prints one table of rates and one per-stage table per packing path; ``--json FILE`` writes
every figure.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import click
import numpy as np
import redis

from embedfleet.shared.protocol import Chunk, Result, encode_chunk, encode_result, encode_results
from embedfleet.shared.settings import Settings
from embedfleet.shared.settings.batching import AUTO_BATCHING
from embedfleet.shared.tokens import encode_for_model, pack_token_ids
from embedfleet.workers.batcher import BATCH_COST_TOKENS, PlannedBatch
from loadtest.common import cpu_name, machine_load, redis_server
from loadtest.corpus import build_corpus, load_tokenizer

STANDIN_SETTING = "EMBEDFLEET_BENCHMARK_STANDIN_ENCODER_US_PER_TOKEN"
# the host path before issue 29's fixes (one encode_result per result, the masked-window
# planning programme), after them (encode_results, the sliced programme), and after with each
# chunk carrying its token ids from the producer (issue 53: the worker tokenizes nothing)
PATHS = ("before", "after", "ids")
# Python's own collector thresholds, as this process starts (before a worker sets its own)
PYTHON_COLLECTOR = gc.get_threshold()
# The worker as it is, and what an A/B puts beside it (``--variants``), each by the label it
# adds: Python's own collector thresholds (before stop 64's workers/runtime.py
# COLLECTOR_THRESHOLDS), one tokenizer thread, so one window opened at a time (before stop
# 65's two: workers/parts.py Threads.tokenizer), and every text through the tokenizer as
# configured (before stop 71's ASCII path, shared/ascii_path.py)
VARIANTS = {
    "worker": "",
    "python-collector": ", Python's collector",
    "one-opening": ", one opening at a time",
    "configured-tokenizer": ", every text through the configured tokenizer",
}
# (stage, thread it runs on), in pipeline order. An "(await)" stage's time is the wall time of
# its awaits: waiting on Redis included, overlapping the loop's other work (a blocking read
# waits for the stream to refill), so it is not the loop's CPU.
STAGES: tuple[tuple[str, str], ...] = (
    ("read", "event loop (await)"),
    ("decode + validate", "tokenizer"),
    ("prompt", "tokenizer"),
    ("tokenize", "tokenizer"),
    ("sort + plan", "tokenizer"),
    ("collate", "tokenizer"),
    ("encode (stand-in)", "model"),
    ("cast", "event loop"),
    ("pack msgpack", "event loop"),
    ("write + acknowledge", "event loop (await)"),
)
# ThreadPoolExecutor name prefixes of the worker's threads (workers/parts.py Threads); the
# encoding thread's batch tokenizer calls count as the tokenizer's
THREAD_PREFIXES = {
    "tokenize": "tokenizer",
    "encode": "tokenizer",
    "model": "model",
    "collect": "collect",
}
FILL_PIPELINE = 2000  # XADDs per round trip when filling the ingest stream


def masked_window_plan(
    lengths: Sequence[int],
    token_budget: int,
    max_batch: int,
    *,
    batch_cost_tokens: int = BATCH_COST_TOKENS,
    max_texts: Callable[[np.ndarray], np.ndarray] | None = None,
) -> list[PlannedBatch]:
    """``plan_batches`` as it was before issue 29 (each step costs every cut of the window, those
    over the budget, or over ``max_texts`` for their width, set to infinity): the "before" path,
    and the reference the faster programme is tested against (tests/unit/workers/test_batcher.py).
    It takes plan_batches' arguments, so the worker can call either."""
    order = sorted(range(len(lengths)), key=lambda position: lengths[position], reverse=True)
    ordered = np.array([lengths[p] for p in order], dtype=np.int64)
    cap = None if max_texts is None else np.asarray(max_texts(ordered), dtype=np.int64)
    best = np.full(len(ordered) + 1, np.inf)
    best[0] = 0.0
    start = np.zeros(len(ordered) + 1, dtype=np.int64)
    for end in range(1, len(ordered) + 1):
        first = max(0, end - max_batch)
        sizes = end - np.arange(first, end)
        cost = best[first:end] + sizes * ordered[first:end] + batch_cost_tokens
        over = sizes * ordered[first:end] > token_budget
        if cap is not None:
            over |= sizes > cap[first:end]
        cost[over & (sizes > 1)] = np.inf
        pick = int(np.argmin(cost))
        best[end], start[end] = cost[pick], first + pick
    batches: list[PlannedBatch] = []
    end = len(ordered)
    while end > 0:
        begin = int(start[end])
        positions = [order[k] for k in range(end - 1, begin - 1, -1)]
        batches.append(PlannedBatch(positions, int(ordered[begin]), int(ordered[begin:end].sum())))
        end = begin
    return batches[::-1]


def per_result_packing(results: Sequence[Result]) -> list[bytes]:
    """The Redis sink's packing before issue 29: one ``encode_result`` per result."""
    return [encode_result(result) for result in results]


# --- the child: one worker process with stage timers --------------------------------------
@dataclass
class StageClock:
    """Wall seconds and calls per stage, and the threads' CPU clocks over the timed span."""

    wall: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    on: bool = False
    started: float = 0.0
    last_write: float = 0.0
    texts: int = 0
    cpu_at_start: dict[str, float] = field(default_factory=dict)
    cpu_at_last_write: dict[str, float] = field(default_factory=dict)

    def add(self, stage: str, seconds: float) -> None:
        self.wall[stage] = self.wall.get(stage, 0.0) + seconds
        self.calls[stage] = self.calls.get(stage, 0) + 1

    def sync(self, stage: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return function(*args, **kwargs)
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.add(stage, time.perf_counter() - started)

        return timed

    def coroutine(
        self, stage: str, function: Callable[..., Awaitable[Any]]
    ) -> Callable[..., Awaitable[Any]]:
        async def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return await function(*args, **kwargs)
            started = time.perf_counter()
            try:
                return await function(*args, **kwargs)
            finally:
                self.add(stage, time.perf_counter() - started)

        return timed

    def start(self) -> None:
        self.on = True
        self.started = self.last_write = time.perf_counter()
        self.cpu_at_start = thread_cpu_seconds()

    def written(self, texts: int) -> None:
        self.texts += texts
        self.last_write = time.perf_counter()
        self.cpu_at_last_write = thread_cpu_seconds()

    def report(self) -> dict[str, Any]:
        span = max(1e-9, self.last_write - self.started)
        cpu = {
            thread: seconds - self.cpu_at_start.get(thread, 0.0)
            for thread, seconds in self.cpu_at_last_write.items()
        }
        wall = dict(self.wall)
        # the sink's write includes the packing it does before its round trip
        wall["write + acknowledge"] = wall.pop("sink write", 0.0) - wall.get("pack msgpack", 0.0)
        return {
            "texts": self.texts,
            "seconds": span,
            "stage_wall_s": wall,
            "stage_calls": self.calls,
            "thread_cpu_s": cpu,
        }


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds of each of this process's Python threads so far, by role (summed where
    several threads share one)."""
    totals: dict[str, float] = {}
    for thread in threading.enumerate():
        if thread.ident is None:
            continue
        role = "event loop" if thread is threading.main_thread() else "other"
        for prefix, name in THREAD_PREFIXES.items():
            if thread.name.startswith(prefix):
                role = name
        with contextlib.suppress(OSError, ProcessLookupError):
            clock = time.pthread_getcpuclockid(thread.ident)
            totals[role] = totals.get(role, 0.0) + time.clock_gettime(clock)
    # threads Python does not know (the tokenizer's Rust pool with TOKENIZERS_PARALLELISM,
    # torch's and numpy's pools): the process's CPU less its Python threads'
    totals["native pools"] = time.process_time() - sum(totals.values())
    return totals


def replace(owner: object, name: str, wrapper: Callable[..., Any]) -> None:
    """``owner.name = wrapper``: the wrappers keep no signature mypy could check."""
    setattr(owner, name, wrapper)


def install_clock(clock: StageClock, path: str) -> None:
    """Wrap the functions that do each stage (in this process only; the worker is unchanged)."""
    from embedfleet.sinks import redis_stream
    from embedfleet.workers import bulk, output, windows

    replace(windows, "decode_entries", clock.sync("decode + validate", windows.decode_entries))
    for method, stage in (
        ("plan", "sort + plan"),
        ("collate", "collate"),
        ("launch", "encode (stand-in)"),
    ):
        replace(bulk.BulkForward, method, clock.sync(stage, getattr(bulk.BulkForward, method)))
    replace(output.Outputs, "results", clock.sync("cast", output.Outputs.results))
    packer: Callable[..., list[bytes]] = encode_results
    if path == "before":
        packer = per_result_packing
        replace(bulk, "plan_batches", masked_window_plan)
    replace(redis_stream, "encode_results", clock.sync("pack msgpack", packer))


async def run_child(stats: Path, path: str, variant: str = "worker") -> None:
    """One worker process: load, say ``loaded``, wait for ``go`` on stdin, run until ``stop``,
    then write the stage figures to ``stats``."""
    from embedfleet.shared.logging import configure_logging
    from embedfleet.shared.redis_conn import connect_settings
    from embedfleet.sinks.redis_stream import RedisStreamSink
    from embedfleet.workers import worker as worker_module
    from embedfleet.workers.metrics import WorkerMetrics
    from embedfleet.workers.runtime import freeze_loaded_heap, load_encoder

    settings = Settings()
    configure_logging("error", "json")
    clock = StageClock()
    install_clock(clock, path)

    class Listener(WorkerMetrics):  # the metrics a worker keeps, as the CLI's worker does
        def results_written(self, *, texts: int, seconds: float) -> None:
            super().results_written(texts=texts, seconds=seconds)
            clock.written(texts)

    encoder = await asyncio.to_thread(load_encoder, settings)
    freeze_loaded_heap()  # as the CLI's worker process does (workers/runtime.py)
    if variant == "python-collector":  # Python's own thresholds, as before stop 64
        gc.set_threshold(*PYTHON_COLLECTOR)
    if variant == "configured-tokenizer":  # no ASCII path: as before stop 71
        encoder.text.ascii_path = None
    replace(encoder, "tokenize", clock.sync("tokenize", encoder.tokenize))
    client = connect_settings(settings)
    sink = RedisStreamSink(client, settings.keys)
    worker = worker_module.Worker(settings, encoder, client, sink, Listener())
    replace(worker.consumer, "read_ingest", clock.coroutine("read", worker.consumer.read_ingest))
    opener = worker.intake.opener
    if variant == "one-opening":  # one tokenizer thread: one window opened at a time
        threads = worker.intake.parts.threads
        threads.tokenizer.shutdown()
        threads.tokenizer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
    replace(opener, "_with_prompts", clock.sync("prompt", opener._with_prompts))
    replace(sink, "write", clock.coroutine("sink write", sink.write))
    loop = asyncio.get_running_loop()
    print("loaded", flush=True)
    if (await loop.run_in_executor(None, sys.stdin.readline)).strip() != "go":
        return
    clock.start()
    running = asyncio.ensure_future(worker.run())
    stop = loop.run_in_executor(None, sys.stdin.readline)  # "stop" (or the parent gone)
    await asyncio.wait({running, stop}, return_when=asyncio.FIRST_COMPLETED)
    if running.done():  # the worker ended before the parent said stop: it failed
        traceback.print_exception(running.exception() or RuntimeError("worker ended early"))
        # the stdin reader thread is still blocked: leave without joining it, so the parent
        # sees the exit (and says so) instead of waiting on results that never come
        os._exit(1)
    worker.drain()
    await running
    stats.write_text(json.dumps(clock.report()))
    await client.aclose()


# --- the parent -------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    processes: int
    path: str
    cores: int = 0  # the CPUs the children may use (their affinity); 0: all of the machine's
    # the worker as it is, or an A/B's other side (VARIANTS)
    variant: str = "worker"

    @property
    def label(self) -> str:
        cores = f", {self.cores} core{'s' if self.cores > 1 else ''}" if self.cores else ""
        processes = f"{self.processes} process{'es' if self.processes > 1 else ''}"
        return f"{processes}, {self.path}{cores}{VARIANTS[self.variant]}"


def host_environment(host: str) -> dict[str, str]:
    """The worker settings of the host the pipeline stands for: ``cuda`` (a GPU host: the CUDA
    defaults' read window and batches, shared/settings/batching.py, and no slice limit, as
    the CUDA query path serves queries beside bulk work: workers/slices.py) or ``cpu`` (the
    CPU defaults, slices sized by the cost model)."""
    if host == "cpu":
        return {}
    batching = AUTO_BATCHING["cuda"]
    return {
        "EMBEDFLEET_READ_COUNT": str(batching.read_count),
        "EMBEDFLEET_TOKEN_BUDGET": str(batching.token_budget),
        "EMBEDFLEET_MAX_BATCH": str(batching.max_batch),
        "EMBEDFLEET_SLICE_MS": "0",
    }


@contextlib.contextmanager
def children(
    settings: Settings, config: Config, folder: Path, host: dict[str, str]
) -> Iterator[list[Any]]:
    """``config.processes`` loaded children, each waiting for ``go``; stopped on exit."""
    environment = {
        **os.environ,
        "EMBEDFLEET_REDIS_URL": settings.effective_redis_url,
        "EMBEDFLEET_NAMESPACE": settings.namespace,
        STANDIN_SETTING: "0",
        "EMBEDFLEET_HEALTH_PORT": "0",
        "EMBEDFLEET_VECTOR_CACHE_MB": "0",  # every text through the pipeline, none cached
        "EMBEDFLEET_BLOCK_MS": "100",
        # the tokenizer's batch encoding on every core, as a CUDA worker sets it
        # (workers/model/tokenizer.py configure_tokenizer_threads): the host a GPU waits on
        "TOKENIZERS_PARALLELISM": "true",
        **host,
    }
    processes: list[subprocess.Popen[str]] = []
    try:
        for index in range(config.processes):
            stats = folder / f"child{index}.json"
            command = [sys.executable, "-m", "loadtest.host_pipeline", "--child", str(stats)]
            command += ["--path", config.path, "--variants", config.variant]
            child_env = {**environment, "EMBEDFLEET_CONSUMER": f"host-{index}"}
            cpus = children_cpus(config) if config.cores else None
            processes.append(start_child(command, child_env, cpus))
        for process in processes:
            assert process.stdout is not None
            line = process.stdout.readline()
            if line.strip() != "loaded":
                raise RuntimeError(f"a worker child failed to start (said {line!r})")
        yield processes
    finally:
        for process in processes:
            with contextlib.suppress(OSError, ValueError):
                stdin: IO[str] | None = process.stdin
                if stdin is not None:
                    stdin.write("stop\n")
                    stdin.close()
        for process in processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


def start_child(
    command: list[str], env: dict[str, str], cpus: list[int] | None
) -> subprocess.Popen[str]:
    """One worker child (``python -m loadtest.host_pipeline --child ...``): it reads ``go`` and
    ``stop`` on its stdin and says ``loaded`` on its stdout; on ``cpus`` when given (a one-core
    run: what one process does with a core, against all of them). tests/ forks it instead."""
    return subprocess.Popen(
        command,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=pinned_to(cpus),
    )


def children_cpus(config: Config) -> list[int]:
    """The CPUs a configuration's children run on: its first ``cores``, else all of ours."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[: config.cores] if config.cores else cpus


def pinned_to(cpus: list[int] | None) -> Callable[[], None] | None:
    """A child's pre-exec step that limits it to ``cpus`` (None: no limit)."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def fill(client: redis.Redis, stream: str, payloads: list[bytes]) -> None:
    for start in range(0, len(payloads), FILL_PIPELINE):
        pipe = client.pipeline(transaction=False)
        for payload in payloads[start : start + FILL_PIPELINE]:
            pipe.xadd(stream, {"m": payload})
        pipe.execute()


def one_run(
    url: str, config: Config, payloads: list[bytes], host: dict[str, str]
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder_name:
        folder = Path(folder_name)
        settings = Settings(redis_url=url, namespace=f"host{uuid.uuid4().hex[:8]}")
        keys = settings.keys
        client = redis.Redis.from_url(url)
        try:
            fill(client, keys.ingest, payloads)
            with children(settings, config, folder, host) as processes:
                redis_cpu_before = redis_cpu_seconds(client)
                go = time.time()
                for process in processes:
                    assert process.stdin is not None
                    process.stdin.write("go\n")
                    process.stdin.flush()
                while client.xlen(keys.results) < len(payloads):
                    for process in processes:
                        if process.poll() is not None:
                            raise RuntimeError(f"a worker child exited with {process.returncode}")
                    time.sleep(0.02)
                seconds = last_entry_time(client, keys.results) - go
                redis_cpu = redis_cpu_seconds(client) - redis_cpu_before
            figures = [json.loads(path.read_text()) for path in sorted(folder.glob("child*.json"))]
            client.delete(keys.ingest, keys.results)
        finally:
            client.close()
    return {
        "seconds": seconds,
        "texts_per_s": len(payloads) / seconds,
        # redis-server's own CPU over the run (the results' polling included, a few commands):
        # on a machine this small it shares the worker's cores, which a GPU host's does not
        "redis_cpu_s": redis_cpu,
        "children": figures,
    }


def redis_cpu_seconds(client: redis.Redis) -> float:
    """The server's CPU seconds so far, user and system, all its threads (INFO cpu)."""
    info: Any = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def last_entry_time(client: redis.Redis, stream: str) -> float:
    """Unix time of a stream's last entry, from its id (milliseconds-sequence)."""
    newest: Any = client.xrevrange(stream, count=1)
    entry_id = newest[0][0]
    entry_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    return int(entry_id.split("-")[0]) / 1000


def tokenizer_floor(texts: list[str], window: int) -> tuple[float, float, float]:
    """The model's raw tokenizer (``encode_batch`` on the texts as the worker cuts them) in
    windows of ``window`` texts, on this one thread: (texts per wall second, texts per CPU
    second of the thread; the second is what a shared machine's load changes least), and the
    texts per CPU second of its ``encode_batch_fast`` (the same ids without their offsets)."""
    from embedfleet.shared.tokens import counting_head
    from embedfleet.workers.model.standin import StandInEncoder

    encoder = _floor_encoder(StandInEncoder)
    prepared = [counting_head(text, encoder.max_length) for text in texts]
    backend = encoder.text.backend
    started, cpu_started = time.perf_counter(), time.thread_time()
    for start in range(0, len(prepared), window):
        backend.encode_batch(prepared[start : start + window])
    wall, cpu = time.perf_counter() - started, time.thread_time() - cpu_started
    fast_started = time.thread_time()
    for start in range(0, len(prepared), window):
        backend.encode_batch_fast(prepared[start : start + window])
    fast_cpu = time.thread_time() - fast_started
    return len(texts) / wall, len(texts) / max(1e-9, cpu), len(texts) / max(1e-9, fast_cpu)


_ENCODERS: dict[str, Any] = {}


def _floor_encoder(factory: Callable[[], Any]) -> Any:
    if "floor" not in _ENCODERS:
        _ENCODERS["floor"] = factory()
    return _ENCODERS["floor"]


def stage_rows(figures: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per stage (median over rounds of the first child): µs per entry and share of its
    thread's wall time; per thread its CPU share."""
    rows = []
    for stage, thread in STAGES:
        per_entry = [f["stage_wall_s"].get(stage, 0.0) / max(1, f["texts"]) for f in figures]
        share = [f["stage_wall_s"].get(stage, 0.0) / f["seconds"] for f in figures]
        rows.append(
            {
                "stage": stage,
                "thread": thread,
                "us_per_entry": statistics.median(per_entry) * 1e6,
                "share_of_thread": statistics.median(share),
            }
        )
    return rows


def thread_shares(figures: list[dict[str, Any]]) -> dict[str, float]:
    roles = sorted({role for f in figures for role in f["thread_cpu_s"]})
    return {
        role: statistics.median(f["thread_cpu_s"].get(role, 0.0) / f["seconds"] for f in figures)
        for role in roles
    }


def measure(
    count: int,
    process_counts: list[int],
    paths: list[str],
    rounds: int,
    core_counts: Sequence[int] = (),
    host: str = "cuda",
    redis_beside: bool = False,
    variants: Sequence[str] = ("worker",),
) -> dict[str, Any]:
    settings = Settings()
    window = settings.batching(host).read_count
    # the model the children load (EMBEDFLEET_MODEL: the device check's carried copy, where no
    # model package is installed) tokenizes the corpus and the floor
    corpus = build_corpus(count, tokenizer=load_tokenizer(settings.model))
    texts = [item.text for item in corpus]
    payloads = [encode_chunk(Chunk(id=item.id, text=item.text)) for item in corpus]
    from embedfleet.workers.model.standin import StandInEncoder

    encoder = _floor_encoder(lambda: StandInEncoder(settings.model))
    # the same chunks with their producer's token ids (producer/token_ids.py's encoding)
    with_ids = [
        encode_chunk(
            Chunk(
                id=item.id,
                text=item.text,
                token_ids=pack_token_ids(ids),
                tokenizer=encoder.text.fingerprint,
            )
        )
        for item, ids in zip(
            corpus,
            encode_for_model(
                encoder.text.backend, texts, encoder.max_length, encoder.text.ascii_path
            ),
            strict=True,
        )
    ]
    tokens = sum(t.length for t in encoder.tokenize(texts))
    configs = [Config(n, path) for n in process_counts for path in paths]
    configs += [Config(1, path, cores) for cores in core_counts for path in paths]
    configs = [
        dataclasses.replace(config, variant=variant) for config in configs for variant in variants
    ]
    runs: dict[Config, list[dict[str, Any]]] = {config: [] for config in configs}
    floors: list[float] = []
    cpu_floors: list[float] = []
    fast_floors: list[float] = []
    load_before = os.getloadavg()
    with redis_server() as server:
        for number in range(rounds):
            wall_rate, cpu_rate, fast_cpu_rate = tokenizer_floor(texts, window)
            fast_floors.append(fast_cpu_rate)
            floors.append(wall_rate)
            cpu_floors.append(cpu_rate)
            shift = number % len(configs)
            for config in configs[shift:] + configs[:shift]:
                chunks = with_ids if config.path == "ids" else payloads
                if redis_beside and server.process is not None:
                    os.sched_setaffinity(server.process.pid, children_cpus(config))
                run = one_run(server.url, config, chunks, host_environment(host))
                runs[config].append(run)
                print(
                    f"round {number + 1}: {config.label}: {run['texts_per_s']:.0f} texts/s "
                    f"(tokenizer floor {floors[-1]:.0f})",
                    file=sys.stderr,
                )
    first = configs[0]
    results = []
    for config in configs:
        rates = [run["texts_per_s"] for run in runs[config]]
        to_floor = [
            run["texts_per_s"] / config.processes / floor
            for run, floor in zip(runs[config], floors, strict=True)
        ]
        to_first = [
            run["texts_per_s"] / base["texts_per_s"]
            for run, base in zip(runs[config], runs[first], strict=True)
        ]
        firsts = [run["children"][0] for run in runs[config] if run["children"]]
        results.append(
            {
                "processes": config.processes,
                "cores": config.cores,
                "label": config.label,
                "variant": config.variant,
                "path": config.path,
                "texts_per_s": statistics.median(rates),
                "tokens_per_s": statistics.median(rates) * tokens / count,
                "per_process_to_floor": statistics.median(to_floor),
                "to_first_config": statistics.median(to_first),
                "rounds": rates,
                "redis_cores": statistics.median(
                    run["redis_cpu_s"] / run["seconds"] for run in runs[config]
                ),
                "redis_us_per_text": statistics.median(
                    run["redis_cpu_s"] / count * 1e6 for run in runs[config]
                ),
                "stages": stage_rows(firsts),
                "thread_cpu_share": thread_shares(firsts),
                # the cores one worker process keeps busy (all its threads), and so the rate one
                # host core carries (Redis's own CPU not counted: it is the shards')
                "cores_per_process": sum(thread_shares(firsts).values()),
                "texts_per_core_s": statistics.median(rates)
                / config.processes
                / max(1e-9, sum(thread_shares(firsts).values())),
            }
        )
    return {
        "machine": f"{cpu_name()}, {os.cpu_count()} cores",
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "texts": count,
        "tokens": tokens,
        "rounds": rounds,
        "read_count": window,
        "host": host,
        "redis_beside": redis_beside,
        "tokenizer_floor_texts_per_s": statistics.median(floors),
        "tokenizer_floor_rounds": floors,
        # per CPU second of the tokenizing thread: compare with texts_per_core_s
        "tokenizer_texts_per_cpu_s": statistics.median(cpu_floors),
        # the same tokenizer's encode_batch_fast (the same ids, no offsets), which the worker uses
        "tokenizer_fast_texts_per_cpu_s": statistics.median(fast_floors),
        "configs": results,
    }


def print_report(report: dict[str, Any]) -> None:
    floor = report["tokenizer_floor_texts_per_s"]
    print(f"machine: {report['machine']}; {machine_load()}")
    print(
        f"corpus: {report['texts']} texts, {report['tokens']} tokens; {report['rounds']} rounds "
        f"interleaved; {report['host']} host, read count {report['read_count']}; stand-in "
        "encoder at 0 µs/token"
    )
    print(
        f"raw tokenizer floor (one thread, same texts): {floor:.0f} texts/s (median), "
        f"{report['tokenizer_texts_per_cpu_s']:.0f} texts per CPU second "
        f"({report['tokenizer_fast_texts_per_cpu_s']:.0f} with encode_batch_fast)"
    )
    print()
    first = report["configs"][0]
    print(
        f"| configuration | texts/s | tokens/s | per process ÷ tokenizer floor | "
        f"× {first['label']} |"
    )
    print("|---|---:|---:|---:|---:|")
    for config in report["configs"]:
        label = config["label"]
        print(
            f"| {label} | {config['texts_per_s']:.0f} | {config['tokens_per_s']:.0f} | "
            f"{config['per_process_to_floor']:.2f} | {config['to_first_config']:.2f} |"
        )
    for config in report["configs"]:
        if config["processes"] != 1:
            continue
        print()
        print(f"stages, {config['label']} (median of rounds):")
        print("| stage | thread | µs per entry | share of the thread's wall time |")
        print("|---|---|---:|---:|")
        for row in config["stages"]:
            print(
                f"| {row['stage']} | {row['thread']} | {row['us_per_entry']:.2f} | "
                f"{row['share_of_thread']:.1%} |"
            )
        shares = ", ".join(f"{r} {s:.0%}" for r, s in config["thread_cpu_share"].items())
        print(
            f"CPU share of each thread: {shares}; {config['cores_per_process']:.2f} cores busy, "
            f"{config['texts_per_core_s']:.0f} texts/s per host core "
            f"({config['texts_per_core_s'] / report['tokenizer_texts_per_cpu_s']:.2f} of the raw "
            "tokenizer's texts per CPU second)"
        )
    print_ratios(report)


def print_ratios(report: dict[str, Any]) -> None:
    """Issue 53's ratios, where this run measured what they compare."""
    by_label = {config["label"]: config for config in report["configs"]}
    raw = report["tokenizer_texts_per_cpu_s"]
    lines = []
    after = by_label.get(Config(1, "after").label)
    ids = by_label.get(Config(1, "ids").label)
    if after:
        lines.append(
            f"host pipeline ÷ raw tokenizer, texts per CPU second: "
            f"{after['texts_per_core_s'] / raw:.2f}"
        )
    if after and ids:
        lines.append(
            f"producer's token ids ÷ tokenizing, texts per CPU second: "
            f"{ids['texts_per_core_s'] / after['texts_per_core_s']:.2f}"
        )
    for path in PATHS:
        one, two = by_label.get(Config(1, path, 1).label), by_label.get(Config(1, path, 2).label)
        if one and two:
            lines.append(
                f"one process, {path}: 2 cores ÷ 1 core, texts/s: "
                f"{two['texts_per_s'] / one['texts_per_s']:.2f}; "
                f"{core_scaling(one, two, report['redis_beside'])}"
            )
    for config in report["configs"]:
        if config["variant"] == "worker":
            continue
        worker = by_label.get(Config(config["processes"], config["path"], config["cores"]).label)
        if worker:
            per_round = [a / b for a, b in zip(worker["rounds"], config["rounds"], strict=True)]
            lines.append(
                f"the worker ÷ {config['variant']}, {worker['label']}, texts/s: per round "
                f"{', '.join(f'{ratio:.2f}' for ratio in per_round)} (median "
                f"{statistics.median(per_round):.2f})"
            )
    if lines:
        print()
        print("ratios (issue 53):")
        for line in lines:
            print(f"- {line}")


def core_scaling(one: dict[str, Any], two: dict[str, Any], redis_beside: bool = False) -> str:
    """The 2 ÷ 1 core ratio round by round (each round runs both, so the guest's drift between
    rounds cancels), and its bound. Where redis-server runs on any CPU (the default), the
    one-core run leaves it the other core and the two-core run shares both with it: with W the
    worker's CPU a text and R the server's, two fully used cores carry at most 2 / (W + R)
    texts a second against the one core's 1 / W, that is 2·W / (W + R). Pinned to the worker's
    cores in each run (``redis_beside``), both runs pay R and the bound is 2."""
    per_round = [b / a for a, b in zip(one["rounds"], two["rounds"], strict=True)]
    worker_us = 1e6 / max(1e-9, two["texts_per_core_s"])
    redis_us = two["redis_us_per_text"]
    bound = 2.0 if redis_beside else 2 * worker_us / (worker_us + redis_us)
    used = (two["cores_per_process"] + two["redis_cores"]) / 2
    where = "on the worker's cores in each run" if redis_beside else "on any CPU"
    return (
        f"per round {', '.join(f'{ratio:.2f}' for ratio in per_round)} (median "
        f"{statistics.median(per_round):.2f}); on 2 cores the worker {worker_us:.0f} µs of CPU a "
        f"text, redis-server {redis_us:.0f} µs ({two['redis_cores']:.2f} cores, {where}): bound "
        f"{bound:.2f} with both cores used, {used:.0%} of them used"
    )


@click.command()
@click.option("--texts", "count", type=int, default=20000, show_default=True)
@click.option("--processes", default="1,2", show_default=True, help="Worker processes to compare.")
@click.option(
    "--path",
    "paths",
    default=",".join(PATHS),
    show_default=True,
    help="Host paths to compare: before (issue 29's fixes undone in the child) and after.",
)
@click.option(
    "--cores",
    "core_counts",
    default="",
    help="Also run one worker process limited to this many CPUs (comma-separated, e.g. 1,2): "
    "its rate against the number of cores it has.",
)
@click.option(
    "--host",
    type=click.Choice(["cuda", "cpu"]),
    default="cuda",
    show_default=True,
    help="The host the pipeline stands for: cuda (a GPU host's read window, batches and no "
    "slice limit) or cpu (the CPU defaults, slices sized by the cost model).",
)
@click.option(
    "--redis-beside",
    is_flag=True,
    help="With --cores: pin redis-server to the worker's CPUs in each run, so that the one-core "
    "and the two-core runs both pay its CPU (by default it runs on any CPU: the one-core run "
    "leaves it a core of its own, as a GPU host's remote Redis would).",
)
@click.option(
    "--variants",
    default="worker",
    show_default=True,
    help="The children's worker, comma-separated: worker (as it is), python-collector (Python's "
    "own garbage collector thresholds, not workers/runtime.py's), one-opening (one tokenizer "
    "thread: one window opened at a time, not two beside each other), configured-tokenizer (every "
    "text through the tokenizer as configured, without shared/ascii_path.py's copy): each "
    "configuration is run with each, side by side in every round, and the worker's rate divided "
    "by each other's.",
)
@click.option("--rounds", type=int, default=3, show_default=True)
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None)
@click.option("--child", type=click.Path(path_type=Path), default=None, hidden=True)
def main(
    count: int,
    processes: str,
    paths: str,
    core_counts: str,
    host: str,
    redis_beside: bool,
    variants: str,
    rounds: int,
    json_out: Path | None,
    child: Path | None,
) -> None:
    """Texts/s of the host pipeline with the stand-in encoder, per stage, against the
    tokenizer alone."""
    if child is not None:
        import uvloop  # the worker's event loop (workers/runtime.py)

        uvloop.run(run_child(child, paths, variants))
        return
    chosen = [path for path in paths.split(",") if path]
    unknown = set(chosen) - set(PATHS)
    if unknown:
        raise click.BadParameter(f"unknown path {sorted(unknown)}", param_hint="--path")
    chosen_variants = [variant for variant in variants.split(",") if variant]
    if not chosen_variants or set(chosen_variants) - set(VARIANTS):
        raise click.BadParameter(
            f"{variants!r}: name one or more of {', '.join(VARIANTS)}", param_hint="--variants"
        )
    report = measure(
        count,
        [int(n) for n in processes.split(",") if n],
        chosen,
        rounds,
        [int(n) for n in core_counts.split(",") if n],
        host,
        redis_beside,
        chosen_variants,
    )
    print_report(report)
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
