"""The side-by-side throughput benchmark: ``python -m loadtest.bench``.

Every contender embeds texts of the same token lengths (``loadtest.corpus``, RAG-like, skewed)
with the same number of torch threads, but never the same texts: each round and contender gets
texts of its own (``loadtest.corpus.FreshCorpora``), new to it and to the fleet, because the
fleet's vector cache (on by default, as users run it) answers a text it has embedded before.
Contenders run interleaved (A B C, B C A, ... a rotation per round) for ``--rounds`` rounds and
the table quotes the median, so a machine that gets busier or quieter during the run affects
every contender alike. Contenders:

1. ``st encode(32)``: ``SentenceTransformer.encode`` in-process, batch 32: the baseline (1).
   ``st encode(best)``: the same at the batch size that won a short sweep in this run.
2. ``naive padded(32)``: tokenize and embed batches of 32 in arrival order, padded.
3. ``fleet fp32`` / ``fleet auto`` / ``fleet auto cache off``: end to end: enqueue into a real
   Redis-compatible server (``embedfleet.server.ServerProcess``) → an in-process worker (as
   ``embedfleet demo`` runs it) → results on the results stream; the clock runs from the first
   enqueue to the last result. Each is a line of ``FLEET_VARIANTS``: the EMBEDFLEET_* settings
   it runs with beside the defaults (the vector cache on unless it says otherwise).

``--engines`` adds in-process contenders for the forward-pass layout and precision choices
(sorted padded micro-batches vs packed rows vs varlen, fp32 vs auto; ``--compile`` adds
``torch.compile``), which is how ``workers.model.packing.preferred_layout`` and
``workers.model.precision.CPU_BF16_METHOD`` were chosen. Rows (``loadtest/packed_rows.py``) is a
contender only; varlen is the worker's own CUDA path (``workers/bulk.py``).

Per contender: texts/s, real tokens/s, padding waste, ratio to (1) (median of the per-round
ratios), parity (cosine to float32 sentence-transformers on the contender's own texts), and
model-FLOPs utilisation: useful model FLOPs (matmuls on real tokens only:
2 x matmul parameters per token + 4 x layers x hidden x length per token for attention) over
the matmul peak of this machine in this precision, measured in the same run with a large
``torch.matmul``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # same for every contender
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import click
import numpy as np
import torch

from embedfleet.shared.settings import Settings
from embedfleet.workers.cpus import usable_cpus
from embedfleet.workers.model.encoder import Encoder, resolve_model_path
from embedfleet.workers.model.packing import PackedEncoder
from embedfleet.workers.model.precision import cosines
from loadtest.common import cpu_identity, cpu_line
from loadtest.corpus import CorpusText, FreshCorpora, describe
from loadtest.packed_rows import RowsEncoder, plan_rows
from loadtest.peers import InfinityConfig, InfinityPeer, infinity_available

if TYPE_CHECKING:
    from embedfleet.producer.chunks import ChunkLike

ST_SWEEP = (16, 32, 64, 128, 256)


# --- results -------------------------------------------------------------------------------
@dataclass
class Run:
    """One contender's pass over the corpus."""

    seconds: float
    texts: int
    real_tokens: int
    padded_tokens: int
    vectors: np.ndarray | None = None  # (texts, dim) in corpus order, for parity
    model_busy: float | None = None  # fleet: model seconds / wall seconds
    inputs: list[str] = field(default_factory=list)  # the texts embedded (parity's reference)
    cache_hits: int | None = None  # fleet: texts the vector cache answered (0 on new texts)


@dataclass
class Contender:
    name: str
    precision: str  # "fp32", "bf16" or "int8": which matmul peak its MFU is measured against
    run: Callable[[list[CorpusText]], Run]  # embeds these texts (new to it: FreshCorpora)
    runs: list[Run] = field(default_factory=list)


@dataclass(frozen=True)
class Peak:
    fp32: float  # FLOP/s
    bf16: float

    def of(self, precision: str) -> float:
        """The peak a contender's MFU is measured against: int8 rows too against bf16's (what
        the same work would peak at without int8), so their MFU can pass 100%."""
        return self.fp32 if precision == "fp32" else self.bf16


def measure_peak(
    device: torch.device, with_bf16: bool, seconds: float = 1.0, size: int | None = None
) -> Peak:
    """The best matmul rate of a large square ``torch.matmul``, fp32 and (when the device runs
    it natively) bf16. Without native bf16 (AVX2-only CPUs) one bf16 matmul of this size takes
    minutes in emulation, and no contender runs in bf16 there anyway."""
    size = size or (8192 if device.type == "cuda" else 2048)  # large enough for the peak there
    rates = {torch.bfloat16: float("nan")}
    for dtype in (torch.float32, torch.bfloat16) if with_bf16 else (torch.float32,):
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        best = 0.0
        deadline = time.perf_counter() + seconds
        for attempt in range(100):
            _sync(device)
            started = time.perf_counter()
            for _ in range(3):
                torch.matmul(a, b)
            _sync(device)
            elapsed = time.perf_counter() - started
            if attempt:  # the first call pays for kernel selection
                best = max(best, 3 * 2 * size**3 / elapsed)
            if time.perf_counter() > deadline and attempt >= 3:
                break
        rates[dtype] = best
    return Peak(fp32=rates[torch.float32], bf16=rates[torch.bfloat16])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_parameters(encoder: Encoder) -> int:
    """Weights of the linear layers inside the transformer layers (no embeddings, no pooler)."""
    layers = encoder._model.encoder.layer  # BERT-class models, which this benchmark targets
    return sum(
        module.weight.numel() for module in layers.modules() if isinstance(module, torch.nn.Linear)
    )


def useful_flops(lengths: Sequence[int], encoder: Encoder) -> float:
    """Model FLOPs for these (truncated) texts, counting real tokens only.

    Per token: 2 x matmul parameters (each weight is one multiply-add); per token per layer:
    4 x hidden x length for attention (QK^T and attention x V over the text's own length).
    """
    config = encoder._model.config
    per_token = 2 * matmul_parameters(encoder)
    attention = 4 * config.num_hidden_layers * config.hidden_size
    return float(sum(per_token * n + attention * n * n for n in lengths))


# --- contenders ----------------------------------------------------------------------------
def st_contender(model: object, texts: list[str], lengths: list[int], batch_size: int) -> Run:
    started = time.perf_counter()
    vectors = model.encode(  # type: ignore[attr-defined]
        texts, batch_size=batch_size, convert_to_numpy=True, show_progress_bar=False
    )
    seconds = time.perf_counter() - started
    return Run(
        seconds,
        len(texts),
        sum(lengths),
        st_padded_tokens(texts, lengths, batch_size),
        np.asarray(vectors, dtype=np.float32),
    )


def st_padded_tokens(texts: list[str], lengths: list[int], batch_size: int) -> int:
    """What sentence-transformers computes: it sorts by character length (a proxy for tokens)
    and pads each batch to its longest text in tokens."""
    order = np.argsort([-len(text) for text in texts], kind="stable")
    padded = 0
    for start in range(0, len(order), batch_size):
        batch = [lengths[i] for i in order[start : start + batch_size]]
        padded += max(batch) * len(batch)
    return padded


def naive_contender(encoder: Encoder, texts: list[str], batch_size: int = 32) -> Run:
    """Arrival order, fixed batches, padded to the longest of each batch (fp32)."""
    started = time.perf_counter()
    vectors, real, padded = [], 0, 0
    for start in range(0, len(texts), batch_size):
        batch = encoder.collate(encoder.tokenize(texts[start : start + batch_size]))
        vectors.append(encoder.embed(batch))
        real += batch.real_tokens
        padded += batch.padded_tokens
    return Run(time.perf_counter() - started, len(texts), real, padded, np.concatenate(vectors))


def engine_contender(
    encoder: Encoder,
    texts: list[str],
    layout: str,
    window: int,
    token_budget: int,
    max_batch: int,
    frozen: bool = False,
) -> Run:
    """The worker's compute path without Redis: windows of ``window`` texts, tokenize, plan,
    embed; tokenization is inline (no overlap), as in the sentence-transformers contenders."""
    from embedfleet.workers.batcher import plan_batches, plan_packed_batches

    packer = None if layout == "padded" else _packer(encoder, layout)
    started = time.perf_counter()
    vectors = np.zeros((len(texts), encoder.dim), dtype=np.float32)
    real = padded = 0
    for base in range(0, len(texts), window):
        tokens = encoder.tokenize(texts[base : base + window])
        lengths = [t.length for t in tokens]
        if layout == "padded":
            for planned in plan_batches(lengths, token_budget, max_batch):
                batch = encoder.collate([tokens[p] for p in planned.positions])
                # frozen: the query stage's frozen, pre-packed graph (no layer hooks) for bulk too
                embed = encoder.embed_query if frozen else encoder.embed
                vectors[[base + p for p in planned.positions]] = embed(batch)
                real += batch.real_tokens
                padded += batch.padded_tokens
            continue
        assert packer is not None
        if layout == "varlen":
            groups = [b.positions for b in plan_packed_batches(lengths, token_budget, max_batch)]
        else:  # rows as wide as the model's limit, token_budget // width rows per batch
            groups = plan_rows(lengths, token_budget, encoder.max_length)
        for positions in groups:
            batch = packer.collate([tokens[p] for p in positions])
            vectors[[base + p for p in positions]] = packer.embed(batch)
            real += batch.real_tokens
            padded += batch.padded_tokens
    return Run(time.perf_counter() - started, len(texts), real, padded, vectors)


def bare_forward_contender(
    encoder: Encoder,
    settings: Settings,
    texts: list[str],
    window: int,
    token_budget: int,
    max_batch: int,
) -> Run:
    """The fleet's own engine alone (issue 53: end to end ÷ bare forward): the default
    worker's encoder and bulk path (the frozen or other engine's copy where a worker takes it,
    ``Slices.bulk_frozen``), its windows planned as the worker plans them without a slice limit,
    tokenized and collated before the clock; the clock runs over the forward passes only."""
    from embedfleet.workers.batcher import plan_batches

    frozen = (
        settings.frozen_bulk and encoder.has_query_graph and encoder.computes_in_reduced_precision
    )
    embed = encoder.embed_query if frozen else encoder.embed
    batches = []
    real = padded = 0
    for base in range(0, len(texts), window):
        tokens = encoder.tokenize(texts[base : base + window])
        for planned in plan_batches([t.length for t in tokens], token_budget, max_batch):
            batch = encoder.collate([tokens[p] for p in planned.positions])
            batches.append(([base + p for p in planned.positions], batch))
            real += batch.real_tokens
            padded += batch.padded_tokens
    vectors = np.zeros((len(texts), encoder.dim), dtype=np.float32)
    started = time.perf_counter()
    for positions, batch in batches:
        vectors[positions] = embed(batch)
    return Run(time.perf_counter() - started, len(texts), real, padded, vectors)


_PACKERS: dict[tuple[int, str], PackedEncoder | RowsEncoder] = {}


def _packer(encoder: Encoder, layout: str) -> PackedEncoder | RowsEncoder:
    """One packer per encoder and layout (varlen installs its attention once)."""
    key = (id(encoder), layout)
    if key not in _PACKERS:
        _PACKERS[key] = PackedEncoder(encoder) if layout == "varlen" else RowsEncoder(encoder)
    return _PACKERS[key]


class Fleet:
    """A real server for every fleet run; each run gets a fresh namespace and worker.

    ``vector_cache``: the worker's vector cache as the settings have it (on by default), as users
    run it: every text must then be new to the fleet (loadtest.bench's fresh corpora). Without
    it the cache is off (EMBEDFLEET_VECTOR_CACHE_MB=0), for the harnesses that repeat texts."""

    def __init__(self, url: str, vector_cache: bool = False) -> None:
        self.url = url
        self.vector_cache = vector_cache

    def run(
        self,
        encoder: Encoder,
        texts: list[str],
        ids: list[str],
        keep: bool,
        slice_ms: float = -1,
        settings: dict[str, object] | None = None,
        poll_s: float | None = None,
    ) -> Run:
        """One end-to-end run; ``settings`` overrides worker settings (the GPU check's budgets,
        loadtest.precisions' output dtype); ``poll_s`` reads the job's counters at that fixed
        interval instead of the producer's paced reads (producer/polling.py)."""
        chunks = [{"id": i, "text": t} for i, t in zip(ids, texts, strict=True)]
        return asyncio.run(self._run(encoder, chunks, ids, keep, slice_ms, settings or {}, poll_s))

    def run_images(self, encoder: Encoder, images: list[bytes], ids: list[str]) -> Run:
        """One end-to-end run of image chunks (issue 56: loadtest/image_bench.py), their
        vectors read back after the clock."""
        from embedfleet.shared.protocol import Chunk

        chunks = [Chunk(id=i, image=data) for i, data in zip(ids, images, strict=True)]
        return asyncio.run(self._run(encoder, chunks, ids, True, -1, {}, None))

    async def _run(
        self,
        encoder: Encoder,
        chunks: Sequence[ChunkLike],
        ids: list[str],
        keep: bool,
        slice_ms: float,
        overrides: dict[str, object],
        poll_s: float | None,
    ) -> Run:
        from embedfleet.producer.client import Producer
        from embedfleet.shared.protocol import Chunk
        from embedfleet.shared.redis_conn import connect
        from embedfleet.shared.settings import load_settings
        from embedfleet.sinks import RedisStreamSink
        from embedfleet.workers.worker import Worker

        namespace = f"bench{uuid.uuid4().hex[:8]}"
        run_settings: dict[str, object] = {
            "redis_url": self.url,
            "namespace": namespace,
            "consumer": "bench",
            "log_level": "warning",
            "slice_ms": slice_ms,
        }
        if not self.vector_cache:
            # every text through the model, as every other contender does: a corpus that
            # repeats a text must not be answered from the vector cache (issue 31)
            run_settings["vector_cache_mb"] = 0
        settings = load_settings(**(run_settings | overrides))
        worker_client = connect(self.url)
        worker = Worker(
            settings, encoder, worker_client, RedisStreamSink(worker_client, settings.keys)
        )
        # an int8/uint8 output's fleet-wide calibration exists before the clock starts (a
        # worker makes it once per model and dimension, not per run); other dtypes need none
        await worker.outputs.prepare([Chunk(id="c", text="c")], worker.on_model_thread)
        task = asyncio.create_task(worker.run())
        job = "bench"
        try:
            async with Producer(settings) as producer:
                # a running worker: its bulk path chosen and its cost model seeded (the probe
                # batches of Slices.seed_speed run once at a worker's start, not per job)
                ready = asyncio.ensure_future(worker.compute.ready.wait())
                await asyncio.wait((ready, task), return_when=asyncio.FIRST_COMPLETED)
                if not ready.done():
                    ready.cancel()
                    task.result()  # the worker failed before it was ready: its error
                    raise RuntimeError("the benchmark's worker stopped before it was ready")
                busy_before = worker.stats.model_seconds
                started = time.perf_counter()
                await producer.enqueue(chunks, job=job)
                # an interval of 10 ms or less is a fixed one (the pacer never waits less)
                pacing = {} if poll_s is None else {"interval": poll_s}
                progress = await producer.wait_for_job(job, timeout=3600, **pacing)
                seconds = time.perf_counter() - started
                busy = (worker.stats.model_seconds - busy_before) / seconds
                stats = worker.stats
                vectors = None
                if keep:
                    latest = {r.id: r.vector async for r in producer.results(job=job)}
                    vectors = np.stack([latest[i].astype(np.float32) for i in ids])
                worker.drain()
                await asyncio.wait_for(task, timeout=60)
                await producer.client.flushdb()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            await worker_client.aclose()
        if progress.dead:
            raise RuntimeError(f"{progress.dead} chunks were dead-lettered during the benchmark")
        run = Run(seconds, progress.done, stats.real_tokens, stats.padded_tokens, vectors, busy)
        run.cache_hits = stats.cache.hits  # texts answered by the vector cache, not the model
        return run


# --- the fleet contenders ------------------------------------------------------------------
@dataclass(frozen=True)
class FleetVariant:
    """A fleet contender: the worker with these EMBEDFLEET_* settings beside the defaults, as a
    user would set them (docs/SETTINGS.md); the encoder is loaded and its forward path chosen
    as `embedfleet worker` does with them (workers/runtime.py load_encoder, the query stage's
    prepare_query_graph)."""

    name: str
    env: Mapping[str, str] = field(default_factory=dict)
    default: bool = False  # run without --only (otherwise only when --only names it)
    # where it is worth a row, judged on the default worker's encoder (None: always)
    when: Callable[[Encoder], bool] | None = None
    poll_s: float | None = None  # read the job's counters at this fixed interval


# the default worker's engine alone (bare_forward_contender)
BARE_FORWARD = "fleet auto bare forward"
# One line per fleet contender. The defaults run with the vector cache on, as users run them;
# every round's texts are new to the fleet, so the cache's lookup and store are a cost it pays
# and never a shortcut, and the cache-off row beside it shows that cost.
FLOAT32 = {"EMBEDFLEET_DTYPE": "float32"}
# torch's own paths, where the class default would take another engine (OpenVINO on CPUs with
# native bf16: workers/model/backends.py's adopted_engine)
TORCH = {"EMBEDFLEET_CPU_BACKEND": "torch"}
FLEET_VARIANTS = (
    FleetVariant("fleet fp32", FLOAT32, default=True),
    # what the query stage's slices cost bulk work
    FleetVariant("fleet fp32 unsliced", FLOAT32 | {"EMBEDFLEET_SLICE_MS": "0"}),
    FleetVariant("fleet auto", default=True),
    FleetVariant("fleet auto cache off", {"EMBEDFLEET_VECTOR_CACHE_MB": "0"}, default=True),
    # torch's path beside the default (the same row where the class default is torch)
    FleetVariant("fleet auto torch", TORCH, default=True),
    FleetVariant("fleet auto unsliced", {"EMBEDFLEET_SLICE_MS": "0"}),
    # bulk batches eager in auto's precision (not through the frozen or int8 copy), sliced per
    # layer; queries still through the copy
    FleetVariant(
        "fleet auto eager bulk",
        TORCH | {"EMBEDFLEET_FROZEN_BULK": "false"},
        when=lambda auto: auto.precision.dtype != torch.float32,
    ),
    # the bf16 frozen copy, as before int8 was the default
    FleetVariant(
        "fleet auto bf16",
        TORCH | {"EMBEDFLEET_CPU_INT8": "false"},
        when=lambda a: a.computes_in_int8,
    ),
    # the other CPU engines (workers/model/backends.py), each a float32 export compiled by its
    # runtime (OpenVINO: bf16 where the CPU has it natively), gated to parity at start
    FleetVariant("fleet auto openvino", {"EMBEDFLEET_CPU_BACKEND": "openvino"}),
    FleetVariant(
        "fleet auto openvino unsliced",
        {"EMBEDFLEET_CPU_BACKEND": "openvino", "EMBEDFLEET_SLICE_MS": "0"},
    ),
    FleetVariant("fleet auto onnxruntime", {"EMBEDFLEET_CPU_BACKEND": "onnxruntime"}),
    FleetVariant("fleet auto 10ms polls", poll_s=0.01),  # a producer polling beside the worker
)
# Settings the worker reads but the encoder does not: variants that differ only in these share
# one loaded encoder (and its chosen path); any other setting gets an encoder of its own.
WORKER_ONLY_SETTINGS = frozenset(
    {"EMBEDFLEET_VECTOR_CACHE_MB", "EMBEDFLEET_SLICE_MS", "EMBEDFLEET_FROZEN_BULK"}
)


def settings_overrides(env: Mapping[str, str]) -> dict[str, object]:
    """EMBEDFLEET_* variables as keyword overrides of ``load_settings`` (validated there)."""
    from embedfleet.shared.settings import ENV_PREFIX

    overrides: dict[str, object] = {}
    for variable, value in env.items():
        name = variable.removeprefix(ENV_PREFIX).lower()
        if not variable.startswith(ENV_PREFIX) or name not in Settings.model_fields:
            raise click.UsageError(f"{variable}: not a setting (docs/SETTINGS.md)")
        overrides[name] = value
    return overrides


class FleetEncoders:
    """The encoders of the fleet contenders, one per distinct model setting, each loaded and
    prepared (its forward path chosen) before the warm-up, so no round pays for it and every
    row is labelled with what it computes in."""

    def __init__(self, device: str, threads: int, model: str | None = None) -> None:
        # ``model``: another model than the settings' (the images benchmark's CLIP directory)
        self._base: dict[str, object] = {"device": device, "threads": threads}
        if model is not None:
            self._base["model"] = model
        self._encoders: dict[frozenset[tuple[str, str]], Encoder] = {}
        # each other engine's build cost (export_s, compile_s, rss_mib), for the report
        self.load_costs: dict[str, dict[str, float]] = {}

    def settings(self, env: Mapping[str, str]) -> Settings:
        from embedfleet.shared.settings import load_settings

        return load_settings(**(self._base | settings_overrides(env)))

    def encoder(self, env: Mapping[str, str]) -> Encoder:
        from embedfleet.workers.queries import prepare_forward_paths
        from embedfleet.workers.runtime import load_encoder

        key = frozenset((k, v) for k, v in env.items() if k not in WORKER_ONLY_SETTINGS)
        if key not in self._encoders:
            settings = self.settings(dict(key))
            encoder = load_encoder(settings)
            prepare_forward_paths(encoder, settings)  # as the worker's query stage at start
            for engine, cost in encoder.paths.backend_costs.items():
                # what another engine's copy cost to make at start (workers/model/backends.py)
                self.load_costs[engine] = cost.log_fields()
                print(
                    f"{engine} copy made at start: export {cost.export_s:.1f} s, compile "
                    f"{cost.compile_s:.1f} s, +{cost.rss_mib:.0f} MiB resident"
                )
            self._encoders[key] = encoder
        return self._encoders[key]


def fleet_precision(encoder: Encoder, settings: Settings) -> str:
    """What a fleet contender's bulk batches compute in: the peak its MFU is measured against."""
    if encoder.computes_in_int8 and settings.frozen_bulk:
        return "int8"
    copy = getattr(encoder.query_path, "copy", None)
    if getattr(copy, "cost", None) is not None:  # another engine's copy says what it computes in
        return "fp32" if copy.precision == "f32" else "bf16"
    return "fp32" if encoder.precision.dtype == torch.float32 else "bf16"


# --- serving-engine peers ------------------------------------------------------------------
def start_infinity_peers(
    wanted: bool,
    device: torch.device,
    auto_precision: str,
    threads: int,
    say: Callable[[str], None],
    only: set[str] | frozenset[str] = frozenset(),
) -> list[InfinityPeer]:
    """Infinity's torch engine in float32 and (where the fleet runs bf16) bfloat16, and its ONNX
    engine where the peer environment can export the model offline; of those, the ones ``only``
    names where it names any (a peer not run is not loaded)."""
    if not wanted:
        return []
    if not infinity_available():
        say("no Infinity contenders: `make bench-peers` builds .venv-infinity for them")
        return []
    configs = [InfinityConfig("torch", "float32")]
    if auto_precision == "bf16":
        configs.append(InfinityConfig("torch", "bfloat16"))
    configs.append(InfinityConfig("optimum", "float32"))
    if only:
        configs = [config for config in configs if config.label in only]
    model_dir = resolve_model_path("all-MiniLM-L6-v2")
    started: list[InfinityPeer] = []
    for config in configs:
        try:
            started.append(InfinityPeer(config, model_dir, threads, str(device)))
        except RuntimeError as error:  # e.g. no ONNX export possible offline: say so, go on
            say(f"{config.label}: not run ({error})")
    return started


def peer_contender(peer: InfinityPeer, lengths: list[int]) -> Contender:
    """A peer's run, with padding counted as for a length-sorted batch of its batch size."""
    precision = "bf16" if peer.config.dtype == "bfloat16" else "fp32"

    def run(corpus: list[CorpusText]) -> Run:
        n = len(corpus)  # every corpus has the same lengths, text for text
        seconds, vectors = peer.embed([item.text for item in corpus])
        padded = sorted_batch_padded_tokens(lengths[:n], peer.config.batch_size)
        return Run(seconds, n, sum(lengths[:n]), padded, vectors)

    return Contender(peer.config.label, precision, run)


def sorted_batch_padded_tokens(lengths: Sequence[int], batch_size: int) -> int:
    ordered = sorted(lengths, reverse=True)
    return sum(
        max(ordered[i : i + batch_size]) * len(ordered[i : i + batch_size])
        for i in range(0, len(ordered), batch_size)
    )


# --- the run -------------------------------------------------------------------------------
# the server of the fleet runs (here and in loadtest.precisions): --redis-url, else _server's own
redis_url_option = click.option(
    "--redis-url", default=None, help="Use this server instead of starting one."
)


@contextlib.contextmanager
def _server(redis_url: str | None) -> Iterator[str]:
    if redis_url:
        yield redis_url
        return
    from embedfleet.server import ServerProcess

    with ServerProcess() as server:
        yield server.url


def best_st_batch(
    model: object, texts: list[str], lengths: list[int]
) -> tuple[int, dict[int, float]]:
    """A short interleaved sweep (2 passes over a subset) for encode's best batch size."""
    rates: dict[int, list[float]] = {size: [] for size in ST_SWEEP}
    for _ in range(2):
        for size in ST_SWEEP:
            run = st_contender(model, texts, lengths, size)
            rates[size].append(run.texts / run.seconds)
    medians = {size: statistics.median(values) for size, values in rates.items()}
    return max(medians, key=medians.__getitem__), medians


def machine_line() -> str:
    """The machine a figure was measured on: the CPU with its model's flags (common.cpu_line),
    cores, torch, threads and load."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return (
        f"{cpu_line()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )


@click.command()
@click.option("--texts", "count", type=int, default=1000, show_default=True)
@click.option("--rounds", type=int, default=3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=int, default=0, help="torch threads (0 = all cores).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto")
@click.option("--engines", is_flag=True, help="Add in-process layout/precision contenders.")
@click.option(
    "--compile",
    "use_compile",
    is_flag=True,
    help="Add torch.compile contenders (dynamic shapes; plain and with inductor freezing).",
)
@click.option("--only", default="", help="Comma-separated contender names to run (debugging).")
@redis_url_option
@click.option(
    "--peers/--no-peers",
    default=True,
    show_default=True,
    help="Add Infinity (infinity-emb) contenders from .venv-infinity (`make bench-peers`).",
)
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option(
    "--images",
    "image_count",
    type=int,
    default=0,
    help="Images per round: the images benchmark (loadtest/image_bench.py, issue 56) instead.",
)
@click.option(
    "--image-model",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="--images: the CLIP model's directory, built there (ViT-B/32's shapes) if absent; "
    "default: built in a temporary directory.",
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also draw texts/s per contender, parity marked, to this PNG (needs matplotlib).",
)
def main(
    count: int,
    rounds: int,
    seed: int,
    threads: int,
    device: str,
    engines: bool,
    use_compile: bool,
    only: str,
    redis_url: str | None,
    peers: bool,
    json_out: Path | None,
    image_count: int,
    image_model: Path | None,
    plot: Path | None,
) -> None:
    """Side-by-side throughput: sentence-transformers vs a naive loop vs the fleet, every
    contender on texts new to it each round (the fleet with its vector cache on, as users run
    it, and off beside it)."""
    import logging

    from sentence_transformers import SentenceTransformer

    from embedfleet.shared.logging import configure_logging

    configure_logging("warning", "console")
    logging.getLogger("sentence_transformers").setLevel(logging.WARNING)
    threads = threads or usable_cpus()
    torch.set_num_threads(threads)
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    if image_count:
        from loadtest.image_bench import ImageBench, run_images

        bench = ImageBench(image_count, rounds, seed, threads, device, only, redis_url)
        run_images(bench, image_model, say, json_out)
        return

    # Every (round, contender) gets a corpus of its own, of the same token lengths, text for
    # text, and no text any other corpus of the run holds: the vector cache, on by default,
    # answers a text it has seen, and a benchmark that repeats texts measures the cache.
    corpora = FreshCorpora(count, seed=seed)
    fp32 = Encoder(device=device, dtype="float32", threads=threads)
    dev = fp32.device
    fleet_encoders = FleetEncoders(device, threads)
    # the default worker's encoder, its path chosen as a default worker would (EMBEDFLEET_CPU_INT8)
    auto = fleet_encoders.encoder({})
    # truncated to the model's limit: the same for every corpus, as its raw lengths are
    lengths = [t.length for t in fp32.tokenize([c.text for c in corpora.corpus("lengths")])]
    raw = describe(list(corpora.lengths), fp32.max_length)  # before truncation
    flops = useful_flops(lengths, fp32)
    defaults = Settings()
    cpu = cpu_identity()
    say(f"machine: {machine_line()}")
    say(
        f"corpus: {count} texts, median {raw['median_tokens']:.0f} tokens, mean "
        f"{raw['mean_tokens']:.1f}, p99 {raw['p99_tokens']}, "
        f"{raw['over_max_fraction']:.1%} over {fp32.max_length} (truncated); new texts of these "
        f"lengths for every round and contender"
    )
    say(auto.parity.line() if auto.parity else f"precision auto: {auto.precision.describe()}")
    auto_precision = "bf16" if auto.precision.dtype != torch.float32 else "fp32"

    st = SentenceTransformer(str(resolve_model_path(fp32.name)), device=str(dev))
    sweep_texts = [c.text for c in corpora.corpus("st batch sweep", min(count, 400))]
    best, sweep = best_st_batch(st, sweep_texts, lengths[: len(sweep_texts)])
    say("encode batch sweep (texts/s): " + ", ".join(f"{k}: {v:.0f}" for k, v in sweep.items()))

    def texts_of(corpus: list[CorpusText]) -> list[str]:
        return [item.text for item in corpus]

    contenders = [
        Contender(
            "st encode(32)",
            "fp32",
            lambda c: st_contender(st, texts_of(c), lengths[: len(c)], 32),
        ),
    ]
    if best != 32:
        contenders.append(
            Contender(
                f"st encode({best})",
                "fp32",
                lambda c: st_contender(st, texts_of(c), lengths[: len(c)], best),
            )
        )
    contenders.append(
        Contender("naive padded(32)", "fp32", lambda c: naive_contender(fp32, texts_of(c)))
    )
    batching = defaults.batching(dev.type)
    window, budget, max_batch = batching.read_count, batching.token_budget, batching.max_batch
    if engines:
        varlen32 = Encoder(device=device, dtype="float32", threads=threads)
        varlen_auto = Encoder(device=device, dtype="auto", threads=threads)
        for label, encoder, varlen_encoder, precision in (
            ("fp32", fp32, varlen32, "fp32"),
            ("auto", auto, varlen_auto, auto_precision),
        ):
            for layout in ("padded", "rows", "varlen"):
                chosen = varlen_encoder if layout == "varlen" else encoder
                contenders.append(
                    Contender(
                        f"engine {layout} {label}",
                        precision,
                        lambda c, e=chosen, la=layout: engine_contender(
                            e, texts_of(c), la, window, budget, max_batch
                        ),
                    )
                )
        if auto.precision.method == "weights" and dev.type == "cpu":
            autocast = Encoder(device=device, dtype="float32", threads=threads)
            from embedfleet.workers.model.precision import Precision

            autocast.precision = Precision(torch.bfloat16, "autocast")
            contenders.append(
                Contender(
                    "engine padded bf16 autocast",
                    "bf16",
                    lambda c: engine_contender(
                        autocast, texts_of(c), "padded", window, budget, max_batch
                    ),
                )
            )
    if engines and dev.type == "cpu":
        frozen_auto = Encoder(device=device, dtype="auto", threads=threads)
        if frozen_auto.prepare_query_graph():
            contenders.append(
                Contender(
                    "engine padded auto frozen",
                    auto_precision,
                    lambda c: engine_contender(
                        frozen_auto, texts_of(c), "padded", window, budget, max_batch, frozen=True
                    ),
                )
            )
    if use_compile:
        compiled = Encoder(device=device, dtype="auto", threads=threads)
        compiled._model.forward = torch.compile(compiled._model.forward, dynamic=True)
        contenders.append(
            Contender(
                "engine padded auto compiled",
                auto_precision,
                lambda c: engine_contender(
                    compiled, texts_of(c), "padded", window, budget, max_batch
                ),
            )
        )
        # inductor's freezing: weights folded in as constants and pre-packed for oneDNN, bias
        # and activations fused into the linear layers (the frozen TorchScript graph's
        # counterpart; its compile is a start-up cost, paid in the warm-up round)
        inductor_frozen = Encoder(device=device, dtype="auto", threads=threads)
        inductor_frozen._model.forward = torch.compile(
            inductor_frozen._model.forward, dynamic=True, options={"freezing": True}
        )
        contenders.append(
            Contender(
                "engine padded auto inductor frozen",
                auto_precision,
                lambda c: engine_contender(
                    inductor_frozen, texts_of(c), "padded", window, budget, max_batch
                ),
            )
        )
    wanted = {name.strip() for name in only.split(",") if name.strip()}
    infinity = start_infinity_peers(peers, dev, auto_precision, threads, say, wanted)
    contenders += [peer_contender(peer, lengths) for peer in infinity]
    if wanted:
        contenders = [c for c in contenders if c.name in wanted or c.name == "st encode(32)"]

    with _server(redis_url) as url:
        # the vector cache as the settings have it (on by default): the variants say otherwise
        fleet = Fleet(url, vector_cache=True)

        def fleet_contender(variant: FleetVariant) -> Contender:
            encoder = fleet_encoders.encoder(variant.env)
            overrides = settings_overrides(variant.env)

            def run(corpus: list[CorpusText]) -> Run:
                return fleet.run(
                    encoder,
                    texts_of(corpus),
                    [item.id for item in corpus],
                    True,  # read back (after the clock) for parity
                    settings=overrides,
                    poll_s=variant.poll_s,
                )

            precision = fleet_precision(encoder, fleet_encoders.settings(variant.env))
            return Contender(variant.name, precision, run)

        if not wanted or BARE_FORWARD in wanted:
            # the default worker's engine alone, beside it: what end to end is measured against
            contenders.append(
                Contender(
                    BARE_FORWARD,
                    fleet_precision(auto, fleet_encoders.settings({})),
                    lambda c: bare_forward_contender(
                        auto, fleet_encoders.settings({}), texts_of(c), window, budget, max_batch
                    ),
                )
            )
        contenders += [
            fleet_contender(variant)
            for variant in FLEET_VARIANTS
            if (variant.name in wanted if wanted else variant.default)
            and (variant.when is None or variant.when(auto))
        ]
        if unknown := wanted - {c.name for c in contenders}:
            say(f"--only names no contender run here: {', '.join(sorted(unknown))}")

        say(f"warming up {len(contenders)} contenders")
        for contender in contenders:
            contender.run(corpora.corpus(f"warm-up/{contender.name}", min(64, count)))
        with_bf16 = auto_precision == "bf16"
        peak_before = measure_peak(dev, with_bf16)
        for number in range(rounds):
            order = contenders[number % len(contenders) :] + contenders[: number % len(contenders)]
            for contender in order:
                corpus = corpora.corpus(f"round {number + 1}/{contender.name}")
                run = contender.run(corpus)
                run.inputs = texts_of(corpus)
                contender.runs.append(run)
                if run.cache_hits:  # the corpora's promise broken: this run measured the cache
                    raise RuntimeError(
                        f"{contender.name}: {run.cache_hits} texts answered by the vector cache"
                    )
                say(
                    f"round {number + 1}/{rounds} {contender.name}: "
                    f"{run.texts / run.seconds:.1f} texts/s ({run.seconds:.1f} s)"
                )
        peak_after = measure_peak(dev, with_bf16)
    for peer in infinity:
        peer.close()
    peak = Peak(max(peak_before.fp32, peak_after.fp32), max(peak_before.bf16, peak_after.bf16))

    baseline = contenders[0]
    rows = []
    for contender in contenders:
        rates = [run.texts / run.seconds for run in contender.runs]
        ratios = [
            (run.texts / run.seconds) / (base.texts / base.seconds)
            for run, base in zip(contender.runs, baseline.runs, strict=True)
        ]
        first_run = contender.runs[0]
        median_seconds = statistics.median(run.seconds for run in contender.runs)
        parity = parity_vs_st(st, contender, baseline)
        busy = [run.model_busy for run in contender.runs if run.model_busy is not None]
        rows.append(
            {
                "name": contender.name,
                "precision": contender.precision,
                "texts_per_s": statistics.median(rates),
                "tokens_per_s": first_run.real_tokens / median_seconds,
                "padding_waste": 1 - first_run.real_tokens / first_run.padded_tokens,
                "ratio": statistics.median(ratios),
                "mfu": flops / median_seconds / peak.of(contender.precision),
                "model_busy": statistics.median(busy) if busy else None,
                "min_cosine_vs_st": None if parity is None else float(parity.min()),
                "mean_cosine_vs_st": None if parity is None else float(parity.mean()),
                "rates": rates,
            }
        )
    table = render_table(rows)
    by_name = {contender.name: contender for contender in contenders}
    ends: list[float] = []  # issue 53: the fleet end to end ÷ its engine alone, per round
    end_to_end_vs_bare: float | None = None
    if BARE_FORWARD in by_name and "fleet auto" in by_name:
        ends = [
            (run.texts / run.seconds) / (bare.texts / bare.seconds)
            for run, bare in zip(
                by_name["fleet auto"].runs, by_name[BARE_FORWARD].runs, strict=True
            )
        ]
        end_to_end_vs_bare = statistics.median(ends)
    print(f"machine: {machine_line()}")
    print(
        f"corpus: {count} texts (seed {seed}), median {raw['median_tokens']:.0f} tokens, "
        f"{raw['over_max_fraction']:.1%} truncated, new texts of these lengths for every round "
        f"and contender; {rounds} rounds interleaved; worker defaults: read_count {window}, "
        f"token_budget {budget}, max_batch {max_batch}, vector cache "
        f"{defaults.vector_cache_mb} MB"
    )
    print(
        f"matmul peak (this run): fp32 {peak.fp32 / 1e9:.0f} GFLOP/s, bf16 "
        f"{peak.bf16 / 1e9:.0f} GFLOP/s; model {flops / sum(lengths) / 1e6:.1f} MFLOP per real "
        f"token on this corpus"
    )
    print(auto.parity.line() if auto.parity else f"precision auto: {auto.precision.describe()}")
    print(
        f"st encode batch sweep (texts/s): {', '.join(f'{k}: {v:.0f}' for k, v in sweep.items())}"
    )
    print(table)
    if end_to_end_vs_bare is not None:
        print(
            f"fleet auto end to end ÷ {BARE_FORWARD} (per round, median): "
            f"{end_to_end_vs_bare:.2f} ({', '.join(f'{r:.2f}' for r in ends)})"
        )
    for engine, cost in fleet_encoders.load_costs.items():
        print(f"{engine} copy's cost to load: {cost}")
    if plot is not None:
        from loadtest.plots import plot_throughput

        subtitle = (
            f"{machine_line()}\n{count} texts (seed {seed}), new each round, {rounds} rounds "
            f"interleaved; min cos vs st: the worst text's cosine to sentence-transformers' vector"
        )
        print(f"chart: {plot_throughput(rows, plot, subtitle)}")
    if json_out is not None:
        json_out.write_text(
            json.dumps(
                {
                    "machine": machine_line(),
                    "cpu": cpu,
                    "corpus": raw | {"seed": seed, "fresh_texts_per_round": True},
                    "peak": {"fp32": peak.fp32, "bf16": peak.bf16},
                    "rows": rows,
                    "end_to_end_vs_bare_forward": end_to_end_vs_bare,
                    "backend_load": fleet_encoders.load_costs,
                },
                indent=2,
            )
        )


def parity_vs_st(st: object, contender: Contender, baseline: Contender) -> np.ndarray | None:
    """Per-text cosine of a contender's vectors (its first run that kept them) to float32
    sentence-transformers' (``encode``, batch 32) on the same texts, the contender's own: its
    texts are no other contender's. The baseline is that reference itself."""
    run = next((run for run in contender.runs if run.vectors is not None), None)
    if run is None:
        return None
    if contender is baseline:
        return cosines(run.vectors, run.vectors)
    reference = st_contender(st, run.inputs, [0] * len(run.inputs), 32).vectors
    assert reference is not None
    return cosines(reference, run.vectors)


def render_table(rows: list[dict]) -> str:
    lines = [
        "| contender | texts/s | real tokens/s | padding waste | × encode(32) | MFU | model busy "
        "| min cos vs st | mean cos vs st |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        busy = "" if row["model_busy"] is None else f"{row['model_busy']:.0%}"
        parity = "" if row["min_cosine_vs_st"] is None else f"{row['min_cosine_vs_st']:.5f}"
        mean = "" if row["mean_cosine_vs_st"] is None else f"{row['mean_cosine_vs_st']:.6f}"
        lines.append(
            f"| {row['name']} ({row['precision']}) | {row['texts_per_s']:.1f} | "
            f"{row['tokens_per_s']:,.0f} | {row['padding_waste']:.1%} | {row['ratio']:.2f} | "
            f"{row['mfu']:.1%} | {busy} | {parity} | {mean} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
