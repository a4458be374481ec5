"""A long synthetic run: does Redis's memory follow the bounds, not the run, while results drain?

    python -m loadtest.drain --chunks 1000000 --workers 2 --json drain.json
    python -m loadtest.drain --chunks 20000 --high-water 5000 --results-max 2000   # minutes

Worker processes (`embedfleet worker`) run the benchmark stand-in encoder at zero cost
(EMBEDFLEET_BENCHMARK_STANDIN_ENCODER_US_PER_TOKEN=0, workers/model/standin.py: the real tokenizer,
no model), so the pace is the pipeline's: enqueue, read, tokenize, plan, write, acknowledge and
drain. One producer enqueues CHUNKS chunks in one job (waiting at EMBEDFLEET_BACKLOG_HIGH_WATER),
the workers write them to the results stream (waiting at EMBEDFLEET_RESULTS_MAX_ENTRIES), and a
consuming reader in its own process drains it (`Producer.results_reader`: XREADGROUP, XACK +
XDEL per page), counting every id once. Every half second Redis's `used_memory` is sampled.

With `--sink parquet:///dir` (or `s3://bucket/prefix` with EMBEDFLEET_S3_ENDPOINT_URL and the
AWS variables) the workers write Parquet shards instead (embedfleet/sinks/parquet/sink.py): no
reader runs, the results never enter Redis, and the run ends when the job does; every id is then
counted once in the dataset (shards read back with pyarrow, the `id` column only).

Reported: `used_memory` at the start (workers up, nothing enqueued), its peak and at the end
(the job's id record expired: EMBEDFLEET_JOB_IDS_FINISHED_TTL_S is set to --finished-ttl-s),
the bound the settings imply (backlog mark × bytes per backlog entry + results bound × bytes
per result + the job's id record + in-flight entries, with the bytes `embedfleet plan
--measure` measures on the same server), and the run's throughput from the first enqueue to the
last result read. Redis is a fresh local server (Debian's redis-server, else the embedded
Valkey) unless --redis-url names one (then other clients' memory counts too).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from embedfleet.ops.plan import measure_entry_sizes
from embedfleet.producer import Producer
from embedfleet.shared.logging import configure_logging
from embedfleet.shared.redis_conn import connect
from embedfleet.shared.settings import Settings
from loadtest.common import cpu_name, machine_load, print_report, run_on_redis, worker_process

SAMPLE_EVERY_S = 0.5
WORDS = [
    "the",
    "fleet",
    "reads",
    "a",
    "window",
    "of",
    "chunks",
    "sorts",
    "them",
    "by",
    "length",
    "and",
    "packs",
    "batches",
    "under",
    "a",
    "token",
    "budget",
    "so",
    "that",
    "padding",
    "is",
    "not",
    "computed",
    "while",
    "results",
    "drain",
    "from",
    "redis",
    "to",
    "their",
    "readers",
]


def texts(count: int) -> Iterator[dict[str, str]]:
    """Chunks of 8 to 80 words, cheap to make (the producer's pace is the pipeline's)."""
    for index in range(count):
        length = 8 + (index * 7919) % 73
        start = index % len(WORDS)
        words = [WORDS[(start + k) % len(WORDS)] for k in range(length)]
        yield {"id": f"d{index}", "text": f"chunk {index}: " + " ".join(words)}


@dataclass
class Sample:
    t: float
    used_memory: int
    backlog: int
    results_held: int
    drained: int


@dataclass
class Report:
    chunks: int
    workers: int
    seconds: float
    chunks_per_s: float
    used_memory_start: int
    used_memory_peak: int
    used_memory_end: int
    peak_over_start_mib: float
    expected_bound_mib: float
    within_bound: bool
    most_backlog: int
    most_results_held: int
    duplicates: int
    sizes: dict[str, float]
    settings: dict[str, Any]
    machine: str
    samples: list[Sample] = field(default_factory=list)


def _reader(url: str, namespace: str, chunks: int, page: int, drained: Any, out: Any) -> None:
    """The consuming reader, in its own process: drains until every chunk's result was read."""
    import uvloop

    async def main() -> None:
        settings = Settings(redis_url=url, namespace=namespace, log_format="json")
        seen: set[str] = set()
        duplicates = 0
        async with Producer(settings) as producer:
            reader = producer.results_reader(page=page)
            while len(seen) < chunks:
                taken = await reader.next_page(follow=True)
                assert taken is not None  # follow mode, no stop: a page or it waits
                for result in taken.results:
                    if result.id in seen:
                        duplicates += 1
                    seen.add(result.id)
                await reader.acknowledge(taken)
                drained.value = len(seen)
            await reader.close()
        out.put({"read": len(seen), "duplicates": duplicates, "done_at": time.time()})

    uvloop.run(main())


def _count_shard_ids(settings: Settings, sink: str) -> dict[str, int]:
    """Every id in the Parquet shards, read back (the ``id`` column only): how many distinct,
    and how many rows repeat one (a redelivery after a crash; none in a clean run)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from embedfleet.sinks import open_backend, parse_sink_url
    from embedfleet.sinks.parquet import ParquetBackend, open_location

    backend = open_backend(parse_sink_url(sink, settings.sink_table, settings.s3_endpoint_url))
    assert isinstance(backend, ParquetBackend)
    fs, _ = open_location(backend.target)
    rows = 0
    seen: set[str] = set()
    for path in backend.shard_files():
        ids = pq.read_table(path, filesystem=fs, columns=["id"]).column("id")
        rows += len(ids)
        seen.update(pc.unique(ids).to_pylist())
    distinct = len(seen)
    return {"read": distinct, "duplicates": rows - distinct}


async def _sample(
    client: aioredis.Redis, settings: Settings, drained: Any, started: float
) -> Sample:
    info = await client.info("memory")
    pipe = client.pipeline(transaction=False)
    pipe.xlen(settings.keys.ingest)
    pipe.xlen(settings.keys.results)
    backlog, held = await pipe.execute()
    return Sample(
        round(time.monotonic() - started, 2), int(info["used_memory"]), backlog, held, drained.value
    )


async def run(args: argparse.Namespace, url: str) -> Report:
    namespace = f"drain{uuid.uuid4().hex[:6]}"
    overrides = {
        "backlog_high_water": args.high_water,
        "results_max_entries": args.results_max,
        "job_ids_finished_ttl_s": args.finished_ttl_s,
    }
    settings = Settings(redis_url=url, namespace=namespace, log_format="json", **overrides)
    client = connect(url)
    sizes = await measure_entry_sizes(client, namespace, dim=384, text_chars=300)
    env = {
        "EMBEDFLEET_BENCHMARK_STANDIN_ENCODER_US_PER_TOKEN": str(args.us_per_token),
        "EMBEDFLEET_RESULTS_MAX_ENTRIES": str(args.results_max),
        "EMBEDFLEET_DEVICE": "cpu",
        "EMBEDFLEET_THREADS": "1",
    }
    if args.sink:
        env["EMBEDFLEET_SINK"] = args.sink
        env["EMBEDFLEET_PARQUET_SHARD_ROWS"] = str(args.shard_rows)
    context = multiprocessing.get_context("spawn")
    drained = context.Value("q", 0)
    finished: Any = context.Queue()
    with contextlib.ExitStack() as stack:
        for index in range(args.workers):
            stack.enter_context(worker_process(settings, f"{namespace}-w{index}", **env))
        async with Producer(settings) as producer:
            while await producer.model_card() is None:  # the workers publish it once up
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)  # let the workers' first reads settle before the start
            start = await _sample(client, settings, drained, time.monotonic())
            reader = context.Process(
                target=_reader,
                args=(url, namespace, args.chunks, args.page, drained, finished),
                daemon=True,
            )
            if not args.sink:
                reader.start()
            began = time.monotonic()
            samples = [start]

            async def sampler() -> None:
                while True:
                    samples.append(await _sample(client, settings, drained, began))
                    await asyncio.sleep(SAMPLE_EVERY_S)

            sampling = asyncio.create_task(sampler())
            await producer.enqueue(texts(args.chunks), job="drain")
            if args.sink:  # the shards are the results: the run ends with the job
                progress = await producer.wait_for_job("drain")
                seconds = time.monotonic() - began
                result = await asyncio.to_thread(_count_shard_ids, settings, args.sink)
            else:
                result = await asyncio.to_thread(finished.get)
                seconds = time.monotonic() - began
                reader.join(30)
                progress = await producer.wait_for_job("drain", timeout=60)
            # the finished job's id record expires after --finished-ttl-s
            deadline = time.monotonic() + args.finished_ttl_s + 30
            while await client.exists(settings.keys.job_ids("drain")):
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            sampling.cancel()
            end = await _sample(client, settings, drained, began)
            samples.append(end)
    await client.aclose()
    assert result["read"] == args.chunks == progress.done, (result, progress)
    peak = max(sample.used_memory for sample in samples)
    inflight = 2 * 1024 * args.workers  # two CPU reads per worker
    if args.sink:  # and the shard being filled: pending until it is written
        inflight += args.shard_rows * args.workers
    results_bound = 0 if args.sink else args.results_max  # Parquet: no results in Redis
    bound = (
        args.high_water * sizes["bytes_per_backlog_entry"]
        + results_bound * sizes["bytes_per_result_dim384"]
        + args.chunks * sizes["bytes_per_job_id"]
        + inflight * (sizes["bytes_per_backlog_entry"] + sizes["bytes_per_pending_entry"])
    )
    return Report(
        chunks=args.chunks,
        workers=args.workers,
        seconds=round(seconds, 1),
        chunks_per_s=round(args.chunks / seconds),
        used_memory_start=start.used_memory,
        used_memory_peak=peak,
        used_memory_end=end.used_memory,
        peak_over_start_mib=round((peak - start.used_memory) / 2**20, 1),
        expected_bound_mib=round(bound / 2**20, 1),
        within_bound=peak - start.used_memory <= bound,
        most_backlog=max(sample.backlog for sample in samples),
        most_results_held=max(sample.results_held for sample in samples),
        duplicates=result["duplicates"],
        sizes=sizes,
        settings=overrides
        | {"us_per_token": args.us_per_token, "page": args.page, "sink": args.sink or "redis"},
        machine=f"{cpu_name()}; {machine_load()}",
        samples=samples,
    )


def render(report: Report) -> str:
    mib = 2**20
    return "\n".join(
        [
            f"{report.chunks:,} chunks, {report.workers} stand-in workers, "
            + (
                f"sink {report.settings['sink']}"
                if report.settings["sink"] != "redis"
                else "one draining reader"
            ),
            f"throughput        {report.chunks_per_s:,} chunks/s end to end "
            f"({report.seconds:,} s, first enqueue to last result drained)",
            f"used_memory       start {report.used_memory_start / mib:,.1f} MiB, peak "
            f"{report.used_memory_peak / mib:,.1f} MiB (+{report.peak_over_start_mib:,} MiB), "
            f"end {report.used_memory_end / mib:,.1f} MiB",
            f"expected bound    +{report.expected_bound_mib:,} MiB (backlog mark, results bound, "
            "the job's id record, in flight; bytes measured on this server: "
            f"{report.sizes}): peak within it: {report.within_bound}",
            f"streams at most  backlog {report.most_backlog:,} (mark "
            f"{report.settings['backlog_high_water']:,}), results held "
            f"{report.most_results_held:,} (bound {report.settings['results_max_entries']:,})",
            f"every result read once: {report.duplicates == 0} ({report.duplicates} duplicates)",
            f"machine           {report.machine}",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--high-water", type=int, default=100_000, help="backlog mark")
    parser.add_argument("--results-max", type=int, default=20_000, help="results bound")
    parser.add_argument("--page", type=int, default=1000, help="the reader's page")
    parser.add_argument("--us-per-token", type=float, default=0.0, help="stand-in cost")
    parser.add_argument("--finished-ttl-s", type=int, default=2, help="finished job's id record")
    parser.add_argument("--redis-url", default=None, help="default: a fresh local server")
    parser.add_argument(
        "--sink", default="", help="parquet:///dir or s3://bucket/prefix (default: results stream)"
    )
    parser.add_argument(
        "--shard-rows", type=int, default=20_000, help="with --sink: EMBEDFLEET_PARQUET_SHARD_ROWS"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()
    # the producer's "waiting at the high-water mark" lines are the run working as meant
    configure_logging("error", "console")

    async def go(url: str) -> Report:
        return await run(args, url)

    report = run_on_redis(args.redis_url, go)
    print_report(report, render(report), args.json)


if __name__ == "__main__":
    main()
