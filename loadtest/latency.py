"""Query latency through the query stream, idle and with the ingest stream saturated.

    python -m loadtest.latency [--queries 200] [--window 15] [--rounds 5] [--pair-pause 0.1]
                               [--slice-ms MS] [--paths default,eager,frozen,int8,varlen]
                               [--images [--image-model DIR]]

Prints one table: query p50/p99 one at a time and 8 concurrent, with the ingest stream idle and
saturated (a backlog that outlasts the measurement), beside a bare in-process forward pass of
the same query; then bulk throughput with and without 10 queries/s, interleaved A B A B.

``--paths`` runs all of that once per forward path, each with a worker of its own forced onto it
by its settings (``PATHS``; the bare forward pass takes the same precision and query graph), and
ends with one table of the query stage's three promises per path (issue 27): saturated p99 <=
2 x idle p99 + slice, idle p50 within 2 ms of the bare forward, bulk throughput with 10
queries/s >= 0.90 of without; beside them the path the worker's bulk batches really took and
their longest slices (``embedfleet_bulk_slice_seconds{path}``), since a path forced by settings
is still only taken where the CPU runs it (int8: where ``auto`` kept bf16 and the copy won).

Bulk throughput is counted in real tokens (the worker's embedfleet_tokens_embedded_total), not
texts: the worker sorts each window of 1,024 chunks by length, so texts/s over a 15 s stretch
swings several-fold with where in the window the stretch falls (one run read 70 texts/s
without queries and 16 with, while the tokens computed differed by 25%).

``--images`` (issue 56): the worker serves a CLIP model (ViT-B/32's shapes, random weights:
tests/image_models.py ``clip_shaped_dir``), the queries are texts on its lane (the text tower)
and the bulk load is image chunks (``loadtest.image_bench``'s mixed sizes and formats), so the
lane's bound is measured under an image backlog; bulk rates are then images/s (the worker's
embedfleet_texts_embedded_total: chunks written), as an image has no tokens.

The bare forward pass and the idle one-at-a-time queries are measured in pairs, one after the
other, so both see the same machine: on a noisy 2-core VM the forward pass alone drifts by
several milliseconds between runs, more than the gap being measured.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import numpy as np
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from embedfleet.producer import Producer
from embedfleet.producer.chunker import builtin_corpus
from embedfleet.server import free_port
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.settings import Settings
from embedfleet.workers.events import QUERY_STAGES
from loadtest.common import (
    add_plot_argument,
    machine_load,
    percentile_ms,
    redis_server,
    worker_process,
)

if TYPE_CHECKING:
    from embedfleet.workers.model.encoder import Encoder

QUERY = "how do I read a file line by line in python"
TEXT_BACKLOG = 12_000
# --images: a ViT-B/32 embeds a few images a second per CPU core, and each is tens of KiB in
# the stream: a thousand outlast the measurement there (the throughput rounds top it up)
IMAGE_BACKLOG = 1_000
IMAGE_POOL = 64  # distinct files in the image bulk load

# Each forward path the worker may take for bulk batches, forced by its settings (the worker's
# environment; the bare forward pass reads the same settings). "default" changes nothing.
TORCH = {"EMBEDFLEET_CPU_BACKEND": "torch"}  # torch's paths, where the default takes OpenVINO
PATHS: dict[str, dict[str, str]] = {
    "default": {},
    # torch's path with every other default (the same as default where that is torch)
    "torch": TORCH,
    # float32: bulk batches eager, queries served between transformer layers
    "eager": {"EMBEDFLEET_DTYPE": "float32"},
    # bf16 weights (emulated, slowly, on a CPU without bf16), bulk eager: sliced per layer
    "eager-bf16": {**TORCH, "EMBEDFLEET_DTYPE": "bfloat16", "EMBEDFLEET_FROZEN_BULK": "false"},
    # bf16 weights, bulk through the frozen copy: no layer boundaries, a batch is one slice
    "frozen": {
        **TORCH,
        "EMBEDFLEET_DTYPE": "bfloat16",
        "EMBEDFLEET_CPU_INT8": "false",
        "EMBEDFLEET_FROZEN_BULK": "true",
    },
    # an int8 copy where one wins the timed race at start (CPU_INT8_PATH auto)
    "int8": {
        **TORCH,
        "EMBEDFLEET_DTYPE": "auto",
        "EMBEDFLEET_CPU_INT8": "true",
        "EMBEDFLEET_FROZEN_BULK": "true",
    },
    # each int8 copy forced (kept whenever it holds the float32 bar, no race)
    "int8-w8a8": {
        **TORCH,
        "EMBEDFLEET_DTYPE": "auto",
        "EMBEDFLEET_CPU_INT8": "true",
        "EMBEDFLEET_CPU_INT8_PATH": "w8a8",
        "EMBEDFLEET_FROZEN_BULK": "true",
    },
    "int8-dynamic": {
        **TORCH,
        "EMBEDFLEET_DTYPE": "auto",
        "EMBEDFLEET_CPU_INT8": "true",
        "EMBEDFLEET_CPU_INT8_PATH": "dynamic",
        "EMBEDFLEET_FROZEN_BULK": "true",
    },
    # OpenVINO's copy (workers/model/openvino.py) for queries and bulk, cut at its layers (a
    # slice is one layer, as eager) where the architecture allows it
    "openvino": {"EMBEDFLEET_CPU_BACKEND": "openvino"},
    # ONNX Runtime's copy (float32), whole: no layer boundaries, a batch is one slice
    "onnxruntime": {"EMBEDFLEET_CPU_BACKEND": "onnxruntime"},
    # packed rows (the CUDA layout) on the CPU, eager, sliced per layer
    "varlen": TORCH | {"EMBEDFLEET_LAYOUT": "varlen"},
}


def path_settings(path: str) -> Settings:
    """The settings a worker forced onto ``path`` runs with (its environment over this one's)."""
    overrides = PATHS[path]
    saved = {name: os.environ.get(name) for name in overrides}
    os.environ.update(overrides)
    try:
        return Settings()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# Between the two halves of a pair: long enough that each forward pass finds the machine as an
# idle lane does, with caches that the other process's forward pass (its own 90 MB copy of
# the weights) has not just filled. The state matters more than the gap being measured: on the
# 2-core VM a forward pass 20 ms after the same one takes 6.9 ms, 100 ms after it 14.5 ms; 20 ms
# after the *other* process's pass 13.7 ms. At 20 ms the paired gap read 3.0-4.0 ms, at 100 ms
# 1.2-1.3 ms (same run, same code; docs/BENCHMARKS.md).
PAIR_PAUSE_S = 0.1


def bare_encoder(settings: Settings | None = None) -> Encoder:
    """The floor: the same query through the model in this process, no queue at all, on the
    forward pass the worker's query stage uses with ``settings`` (the default worker's when
    None: its precision, and the frozen graph or an int8 copy: workers/model/frozen.py,
    workers/model/int8.py). Where the int8 copy is chosen by a timed race at start (CPU_INT8_PATH
    auto) this process can decide it the other way: the table shows both paths; the forced
    int8 paths (``int8-w8a8``, ``int8-dynamic``) skip the race."""
    from embedfleet.workers.model.encoder import Encoder
    from embedfleet.workers.queries import prepare_forward_paths

    settings = settings or Settings()
    encoder = Encoder(settings.model, dtype=settings.dtype)
    prepare_forward_paths(encoder, settings)  # as the worker's query stage does at start
    print(f"bare forward path: {encoder.forward_path}")
    for _ in range(10):
        bare_forward(encoder)
    return encoder


def bare_path(encoder: Encoder) -> str:
    """Which forward pass the bare query took (the worker's query stage reports its own)."""
    return encoder.serve_query(encoder.collate(encoder.tokenize([QUERY])))[1]


def bare_forward(encoder: Encoder) -> None:
    encoder.embed_query(encoder.collate(encoder.tokenize([QUERY])))


async def paired_latencies(
    encoder: Encoder, producer: Producer, count: int, pause_s: float = PAIR_PAUSE_S
) -> tuple[list[float], list[float]]:
    """``count`` pairs: a bare forward pass in this process, then the query through the lane."""
    bare: list[float] = []
    queued: list[float] = []
    for _ in range(count):
        started = time.perf_counter()
        bare_forward(encoder)
        bare.append(time.perf_counter() - started)
        await asyncio.sleep(pause_s)
        started = time.perf_counter()
        await producer.embed_query(QUERY, timeout=30)
        queued.append(time.perf_counter() - started)
        await asyncio.sleep(pause_s)
    return bare, queued


async def query_latencies(producer: Producer, count: int, concurrency: int) -> list[float]:
    """Round trips of ``count`` queries (at least one per client), ``concurrency`` in flight."""
    samples: list[float] = []

    async def one_client(n: int) -> None:
        for _ in range(n):
            started = time.perf_counter()
            await producer.embed_query(QUERY, timeout=30)
            samples.append(time.perf_counter() - started)

    await asyncio.gather(*(one_client(max(1, count // concurrency)) for _ in range(concurrency)))
    return samples


def bulk_corpus(count: int, images: Sequence[bytes] = ()) -> list[Chunk]:
    """``count`` bulk chunks: the built-in corpus's texts in turn, or ``images`` (``--images``)."""
    if images:
        tag = uuid.uuid4().hex[:8]
        return [Chunk(id=f"b{tag}-{i}", image=images[i % len(images)]) for i in range(count)]
    texts = [c.text for c in builtin_corpus()]
    return [
        Chunk(id=f"b{uuid.uuid4().hex[:8]}-{i}", text=texts[i % len(texts)]) for i in range(count)
    ]


async def keep_saturated(
    producer: Producer, settings: Settings, backlog: int, images: Sequence[bytes] = ()
) -> None:
    """Top the ingest stream up between throughput runs, so none of them runs it dry (a fast
    machine got through 12,000 chunks before the last run once, and read half the rate)."""
    if await producer.client.xlen(settings.keys.ingest) < backlog // 2:
        await producer.enqueue(bulk_corpus(backlog, images), job="saturate")


# what a bulk rate counts: real tokens of texts, or chunks written (an image has no tokens)
TOKENS = "embedfleet_tokens_embedded_total"
CHUNKS = "embedfleet_texts_embedded_total"


async def bulk_tokens(
    session: aiohttp.ClientSession, metrics_url: str, metric: str = TOKENS
) -> float:
    """Real tokens of bulk work the worker has embedded so far (queries are not counted), or
    the bulk chunks it has written (``CHUNKS``: the images of ``--images``)."""
    async with session.get(metrics_url) as response:
        text = await response.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == metric:
                return sample.value
    raise RuntimeError(f"no {metric} in {metrics_url}")


@dataclass
class SliceReport:
    """What the worker's metrics say of its bulk slices and query paths (workers/metrics.py)."""

    target_ms: float = math.nan  # embedfleet_slice_target_seconds
    # path -> (slices, mean ms, bucket bounds: le -> cumulative count)
    slices: dict[str, tuple[int, float, dict[float, float]]] = field(default_factory=dict)
    query_paths: dict[str, float] = field(default_factory=dict)

    @property
    def bulk_path(self) -> str:
        """The path most bulk batches took ("-" if none was sliced)."""
        if not self.slices:
            return "-"
        return max(self.slices, key=lambda path: self.slices[path][0])

    @property
    def query_path(self) -> str:
        taken = {path: n for path, n in self.query_paths.items() if n > 0}
        return max(taken, key=lambda path: taken[path]) if taken else "-"

    def quantile_ms(self, q: float) -> float:
        """The bucket bound under which ``q`` of the main path's slices fell (an upper bound)."""
        if not self.slices:
            return math.nan
        count, _, buckets = self.slices[self.bulk_path]
        for bound in sorted(buckets):
            if buckets[bound] >= q * count:
                return bound * 1000
        return math.inf

    def share_within_ms(self, limit_ms: float) -> float:
        """Share of the main path's slices at most the largest bucket bound <= ``limit_ms``."""
        if not self.slices:
            return math.nan
        count, _, buckets = self.slices[self.bulk_path]
        under = [n for bound, n in buckets.items() if bound * 1000 <= limit_ms + 1e-9]
        return (max(under) if under else 0.0) / max(1, count)


async def slice_report(metrics_url: str) -> SliceReport:
    report = SliceReport()
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    buckets: dict[str, dict[float, float]] = {}
    async with aiohttp.ClientSession() as session, session.get(metrics_url) as response:
        text = await response.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels: dict[str, Any] = sample.labels
            if sample.name == "embedfleet_slice_target_seconds":
                report.target_ms = sample.value * 1000
            elif sample.name == "embedfleet_queries_served_total":
                report.query_paths[labels["path"]] = sample.value
            elif sample.name == "embedfleet_bulk_slice_seconds_sum":
                sums[labels["path"]] = sample.value
            elif sample.name == "embedfleet_bulk_slice_seconds_count":
                counts[labels["path"]] = int(sample.value)
            elif sample.name == "embedfleet_bulk_slice_seconds_bucket":
                bound = float(labels["le"])
                buckets.setdefault(labels["path"], {})[bound] = sample.value
    for path, count in counts.items():
        if count:
            mean_ms = sums.get(path, 0.0) / count * 1000
            report.slices[path] = (count, mean_ms, buckets.get(path, {}))
    return report


async def query_stage_totals(metrics_url: str) -> dict[str, tuple[float, float]]:
    """Per step of the worker's query stage (embedfleet_query_stage_seconds): (seconds, count)
    so far; two snapshots give the stages' means over the queries between them."""
    totals: dict[str, list[float]] = {stage: [0.0, 0.0] for stage in QUERY_STAGES}
    async with aiohttp.ClientSession() as session, session.get(metrics_url) as response:
        text = await response.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            stage = sample.labels.get("stage")
            if stage not in totals:
                continue
            if sample.name == "embedfleet_query_stage_seconds_sum":
                totals[stage][0] = sample.value
            elif sample.name == "embedfleet_query_stage_seconds_count":
                totals[stage][1] = sample.value
    return {stage: (total[0], total[1]) for stage, total in totals.items()}


def stage_means_ms(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Mean ms per stage over the queries answered between two snapshots."""
    means = {}
    for stage in QUERY_STAGES:
        seconds = after[stage][0] - before[stage][0]
        count = after[stage][1] - before[stage][1]
        means[stage] = seconds / count * 1000 if count else math.nan
    return means


def resolved_slice_ms(settings: Settings) -> float:
    """EMBEDFLEET_SLICE_MS as a CPU worker resolves it (-1: the CPU's auto value)."""
    from embedfleet.workers.slices import SLICE_MS_AUTO

    return settings.slice_ms if settings.slice_ms >= 0 else SLICE_MS_AUTO["cpu"]


async def bulk_rate(
    producer: Producer,
    metrics_url: str,
    window: float,
    queries_per_s: float,
    metric: str = TOKENS,
) -> float:
    """Tokens/s of bulk work over ``window`` seconds (``metric``: what is counted), optionally
    serving queries at a fixed rate.

    The counter moves in steps of one batch (about a second of work here), so the rate is the
    least-squares slope over samples every 100 ms, not (last - first) / window.
    """
    stop = asyncio.Event()

    async def query_load() -> None:
        interval = 1 / queries_per_s
        next_at = time.perf_counter()
        while not stop.is_set():
            await producer.embed_query(QUERY, timeout=30)
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))

    loader = asyncio.create_task(query_load()) if queries_per_s else None
    started = time.perf_counter()
    times: list[float] = []
    tokens: list[float] = []
    async with aiohttp.ClientSession() as session:  # one connection for all the samples
        while (now := time.perf_counter()) - started < window:
            tokens.append(await bulk_tokens(session, metrics_url, metric))
            times.append(now - started)
            await asyncio.sleep(0.1)
    stop.set()
    if loader:
        await loader
    slope, _intercept = np.polyfit(times, tokens, 1)
    return float(slope)


@dataclass
class PathRun:
    """One worker's run: the samples, and what its metrics said."""

    path: str
    slice_ms: float
    bare: list[float]
    rows: dict[tuple[str, int], list[float]]
    left: int
    without: list[float]
    with_queries: list[float]
    left_after: int
    slices: SliceReport
    bare_query_path: str
    # "idle" / "saturated" (one at a time) -> mean ms per query stage (QUERY_STAGES)
    stages: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def idle_p99(self) -> float:
        return percentile_ms(self.rows[("idle", 1)], 99)

    @property
    def saturated_p99(self) -> float:
        return percentile_ms(self.rows[("saturated", 1)], 99)

    @property
    def bound(self) -> float:
        return 2 * self.idle_p99 + self.slice_ms

    @property
    def idle_gap(self) -> float:
        """Idle p50 less the bare forward's p50, ms."""
        return percentile_ms(self.rows[("idle", 1)], 50) - percentile_ms(self.bare, 50)

    @property
    def paired_gap(self) -> float:
        pairs = zip(self.bare, self.rows[("idle", 1)], strict=True)
        return statistics.median((q - b) * 1000 for b, q in pairs)

    @property
    def ratio(self) -> float:
        ratios = [b / a for a, b in zip(self.without, self.with_queries, strict=True) if a > 0]
        return statistics.median(ratios) if ratios else math.nan


async def run_path(path: str, args: argparse.Namespace) -> PathRun:
    """The whole scenario with one worker forced onto ``path`` (PATHS)."""
    forced = path_settings(path)
    env = dict(PATHS[path])
    if args.slice_ms is not None:
        env["EMBEDFLEET_SLICE_MS"] = f"{args.slice_ms:g}"
        forced = forced.model_copy(update={"slice_ms": args.slice_ms})
    if args.image_model is not None:  # --images: a CLIP lane, text queries, images in bulk
        env["EMBEDFLEET_MODEL"] = str(args.image_model)
        forced = forced.model_copy(update={"model": str(args.image_model)})
    with redis_server() as server:
        settings = Settings(redis_url=server.url, namespace=f"lat{uuid.uuid4().hex[:6]}")
        port = free_port()
        metrics_url = f"http://127.0.0.1:{port}/metrics"
        with worker_process(settings, "latency-worker", EMBEDFLEET_HEALTH_PORT=str(port), **env):
            async with Producer(settings) as producer:
                await producer.embed_query(QUERY, timeout=300)  # waits for the model to load
                for _ in range(20):
                    await producer.embed_query(QUERY, timeout=30)
                encoder = bare_encoder(forced)
                rows = {}
                before_idle = await query_stage_totals(metrics_url)
                bare, rows[("idle", 1)] = await paired_latencies(
                    encoder, producer, args.queries, args.pair_pause
                )
                after_idle = await query_stage_totals(metrics_url)
                rows[("idle", 8)] = await query_latencies(producer, args.queries, 8)
                backlog = bulk_corpus(args.backlog, args.bulk_images)
                await producer.enqueue(backlog, job="saturate")
                await asyncio.sleep(3)  # the worker is deep in bulk batches
                before_saturated = await query_stage_totals(metrics_url)
                rows[("saturated", 1)] = await query_latencies(producer, args.queries, 1)
                after_saturated = await query_stage_totals(metrics_url)
                rows[("saturated", 8)] = await query_latencies(producer, args.queries, 8)
                stages = {
                    "idle": stage_means_ms(before_idle, after_idle),
                    "saturated": stage_means_ms(before_saturated, after_saturated),
                }
                left = await producer.client.xlen(settings.keys.ingest)
                without, with_queries = [], []
                for _ in range(args.rounds):
                    for queries_per_s, rates in ((0, without), (10, with_queries)):
                        await keep_saturated(producer, settings, args.backlog, args.bulk_images)
                        rates.append(
                            await bulk_rate(
                                producer, metrics_url, args.window, queries_per_s, args.bulk_metric
                            )
                        )
                left_after = await producer.client.xlen(settings.keys.ingest)
                slices = await slice_report(metrics_url)
    slice_ms = slices.target_ms if math.isfinite(slices.target_ms) else resolved_slice_ms(forced)
    return PathRun(
        path,
        slice_ms,
        bare,
        rows,
        left,
        without,
        with_queries,
        left_after,
        slices,
        bare_path(encoder),
        stages,
    )


async def scenario(args: argparse.Namespace) -> None:
    runs: list[PathRun | tuple[str, str]] = []
    for path in args.paths:
        if len(args.paths) > 1:
            print(f"\n## path: {path} ({' '.join(f'{k}={v}' for k, v in PATHS[path].items())})")
        try:
            run = await run_path(path, args)
        except Exception as error:  # one path failing (a query timed out) must not hide the rest
            if "LOADTEST_PROCESS_LOG" not in os.environ:
                # the worker's own output is discarded (loadtest/common.py): say how to keep it
                print(
                    f"path {path}: the worker's output was discarded; to see why it failed, run "
                    "again with LOADTEST_PROCESS_LOG=worker.log",
                    file=sys.stderr,
                )
            if len(args.paths) == 1:
                raise
            print(f"path {path} failed: {type(error).__name__}: {error}")
            runs.append((path, f"{type(error).__name__}"))
            continue
        runs.append(run)
        print_table(run, args)
    if len(runs) > 1 or args.paths != ["default"]:
        print_promises(runs)
    measured = [run for run in runs if isinstance(run, PathRun)]
    if args.plot is not None and measured:
        from loadtest.plots import plot_latency_cdf

        run = measured[0]
        labelled = {"bare in-process forward": run.bare}
        for (state, concurrency), samples in run.rows.items():
            how = "1 at a time" if concurrency == 1 else f"{concurrency} concurrent"
            labelled[f"{state}, {how}"] = samples
        subtitle = f"{args.queries} queries per line; {run.path} path; {machine_load()}"
        print(f"chart: {plot_latency_cdf(labelled, args.plot, subtitle, run.bound)}")


def print_table(run: PathRun, args: argparse.Namespace) -> None:
    bare, rows = run.bare, run.rows
    print(
        f"# query latency ({args.queries} queries per row; bare/idle pairs "
        f"{args.pair_pause * 1000:.0f} ms apart; {machine_load()})"
    )
    print("| ingest stream | concurrency | p50 ms | p99 ms |")
    print("|---|---|---|---|")
    print(
        f"| bare in-process forward | 1 | {percentile_ms(bare, 50):.1f} | "
        f"{percentile_ms(bare, 99):.1f} |"
    )
    for (state, concurrency), samples in rows.items():
        print(
            f"| {state} | {concurrency} | {percentile_ms(samples, 50):.1f} | "
            f"{percentile_ms(samples, 99):.1f} |"
        )
    print(
        f"\nsaturated p99 {run.saturated_p99:.1f} ms vs bound 2 x idle p99 + slice "
        f"({run.slice_ms:g} ms) = {run.bound:.1f} ms: "
        f"{'OK' if run.saturated_p99 <= run.bound else 'OVER'}"
    )
    print(
        f"idle p50 - bare p50 = {run.idle_gap:.2f} ms; median of the paired differences = "
        f"{run.paired_gap:.2f} ms (target <= 2 ms)"
    )
    print(
        f"backlog left when the saturated rows ended: {run.left} entries; after the throughput "
        f"rounds: {run.left_after}"
    )
    print(_slice_line(run))
    for state, means in run.stages.items():
        print(
            f"query stages, {state}, 1 at a time (mean ms, the worker's "
            "embedfleet_query_stage_seconds): "
            + ", ".join(f"{stage} {ms:.1f}" for stage, ms in means.items())
        )
    unit = "images/s" if args.bulk_images else "real tokens/s"
    print(f"\n| bulk load | {unit} (median of rounds) |")
    print("|---|---|")
    print(f"| no queries | {statistics.median(run.without):,.0f} |")
    print(f"| 10 queries/s | {statistics.median(run.with_queries):,.0f} |")
    print(
        f"rounds ({unit}): without "
        + " ".join(f"{r:.0f}" for r in run.without)
        + "; with "
        + " ".join(f"{r:.0f}" for r in run.with_queries)
    )
    print(
        f"ratio with/without (median of {len(run.without)} interleaved pairs): "
        f"{run.ratio:.3f} (target >= 0.90)"
    )


def _slice_line(run: PathRun) -> str:
    report = run.slices
    if not report.slices:
        return "bulk slices: none reported (no slice target: EMBEDFLEET_SLICE_MS=0 or CUDA)"
    parts = [
        f"{path} {count} (mean {mean:.1f} ms)" for path, (count, mean, _) in report.slices.items()
    ]
    return (
        f"bulk slices by path: {', '.join(parts)}; main path p99 <= "
        f"{report.quantile_ms(0.99):g} ms, {report.share_within_ms(run.slice_ms):.0%} within "
        f"the {run.slice_ms:g} ms target (bucket bounds); queries by path: "
        + ", ".join(f"{p} {n:.0f}" for p, n in report.query_paths.items() if n)
    )


def print_promises(runs: list[PathRun | tuple[str, str]]) -> None:
    """The query stage's three promises, one row per forced path."""
    print(
        "\n# the query stage's promises by forward path "
        "(bound: saturated p99 <= 2 x idle p99 + slice; idle: p50 within 2 ms of the bare "
        "forward; bulk: tokens/s with 10 queries/s >= 0.90 x without)"
    )
    print(
        "| forced | bulk path taken | query path (bare) | slice ms | slice p99 ms | "
        "idle p99 | saturated p99 | bound | OK | idle p50 - bare p50 (paired) | OK | "
        "bulk ratio | OK |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---|---:|---|---:|---|")
    for run in runs:
        if not isinstance(run, PathRun):
            path, error = run
            print(f"| {path} | failed: {error} |" + " |" * 11)
            continue
        bound_ok = run.saturated_p99 <= run.bound
        idle_ok = run.idle_gap <= 2.0
        ratio_ok = run.ratio >= 0.90
        print(
            f"| {run.path} | {run.slices.bulk_path} | {run.slices.query_path} "
            f"({run.bare_query_path}) | {run.slice_ms:g} | {run.slices.quantile_ms(0.99):g} | "
            f"{run.idle_p99:.1f} | {run.saturated_p99:.1f} | {run.bound:.1f} | "
            f"{'yes' if bound_ok else 'NO'} | {run.idle_gap:.2f} ({run.paired_gap:.2f}) | "
            f"{'yes' if idle_ok else 'NO'} | {run.ratio:.3f} | {'yes' if ratio_ok else 'NO'} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--queries", type=int, default=200, help="queries per row")
    parser.add_argument(
        "--backlog",
        type=int,
        default=None,
        help=f"bulk chunks enqueued (default {TEXT_BACKLOG:,}; with --images {IMAGE_BACKLOG:,})",
    )
    parser.add_argument("--window", type=float, default=15.0, help="seconds per throughput run")
    parser.add_argument(
        "--pair-pause",
        type=float,
        default=PAIR_PAUSE_S,
        help="seconds between the bare and the queued query of a pair, and between pairs",
    )
    parser.add_argument("--rounds", type=int, default=5, help="A/B throughput pairs")
    parser.add_argument(
        "--slice-ms",
        type=float,
        default=None,
        help="EMBEDFLEET_SLICE_MS for the worker (default: the environment's, else auto)",
    )
    parser.add_argument(
        "--paths",
        type=_path_list,
        default=["default"],
        help=f"comma-separated forward paths to force, one worker each: {', '.join(PATHS)}",
    )
    parser.add_argument(
        "--images",
        action="store_true",
        help="the bulk load is images (issue 56): a CLIP lane (ViT-B/32's shapes, random "
        "weights) embeds them while text queries are measured; bulk rates in images/s",
    )
    parser.add_argument(
        "--image-model",
        type=Path,
        default=None,
        help="--images: the CLIP model's directory, built there if absent (default: a temporary "
        "directory)",
    )
    add_plot_argument(parser, "the latency CDFs, idle vs saturated,")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="latency-") as scratch:
        image_load(args, Path(scratch))
        uvloop.run(scenario(args))


def image_load(args: argparse.Namespace, scratch: Path) -> None:
    """The bulk load's settings on ``args``: texts, or with ``--images`` a pool of
    ``IMAGE_POOL`` files enqueued in turn (the worker's vector cache is off: repeats are
    embedded again, as the texts' are) and the CLIP model, built in ``scratch`` unless given."""
    args.bulk_images, args.bulk_metric = (), TOKENS
    if not args.images:
        args.image_model = None
        args.backlog = args.backlog or TEXT_BACKLOG
        return
    from loadtest.image_bench import round_images
    from tests.image_models import clip_shaped_dir

    args.image_model = clip_shaped_dir(args.image_model or scratch / "clip-vit-b-32-random")
    args.bulk_images = round_images(IMAGE_POOL, 0, "latency bulk")
    args.bulk_metric = CHUNKS
    args.backlog = args.backlog or IMAGE_BACKLOG


def _path_list(text: str) -> list[str]:
    paths = [path.strip() for path in text.split(",") if path.strip()]
    unknown = [path for path in paths if path not in PATHS]
    if unknown or not paths:
        raise argparse.ArgumentTypeError(
            f"unknown path(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(PATHS)}"
        )
    return paths


if __name__ == "__main__":
    main()
