"""Query latency through the priority lane, idle and with the ingest stream saturated.

    python -m loadtest.latency [--queries 200] [--window 20] [--rounds 2]

Prints one table: query p50/p99 one at a time and 8 concurrent, with the ingest stream idle and
saturated (a backlog that outlasts the measurement), beside a bare in-process forward pass of
the same query; then bulk throughput with and without 10 queries/s, interleaved A B A B.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import uvloop

from loadtest.common import machine_load, percentile_ms, redis_server, worker_process
from producer import Producer
from producer.chunker import builtin_corpus
from shared.protocol import Chunk
from shared.settings import Settings

QUERY = "how do I read a file line by line in python"


def bare_forward_seconds(count: int) -> list[float]:
    """The floor: the same query through the model in this process, no queue at all."""
    from workers.encoder import Encoder

    encoder = Encoder()
    for _ in range(10):
        encoder.embed_texts([QUERY])
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        encoder.embed_texts([QUERY])
        samples.append(time.perf_counter() - started)
    return samples


async def query_latencies(producer: Producer, count: int, concurrency: int) -> list[float]:
    samples: list[float] = []

    async def one_client(n: int) -> None:
        for _ in range(n):
            started = time.perf_counter()
            await producer.embed_query(QUERY, timeout=30)
            samples.append(time.perf_counter() - started)

    await asyncio.gather(*(one_client(count // concurrency) for _ in range(concurrency)))
    return samples


def bulk_corpus(count: int) -> list[Chunk]:
    texts = [c.text for c in builtin_corpus()]
    return [
        Chunk(id=f"b{uuid.uuid4().hex[:8]}-{i}", text=texts[i % len(texts)]) for i in range(count)
    ]


async def bulk_rate(producer: Producer, job: str, window: float, queries_per_s: float) -> float:
    """Texts/s of bulk work over ``window`` seconds, optionally serving queries at a fixed rate."""
    stop = asyncio.Event()

    async def query_load() -> None:
        interval = 1 / queries_per_s
        next_at = time.perf_counter()
        while not stop.is_set():
            await producer.embed_query(QUERY, timeout=30)
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))

    loader = asyncio.create_task(query_load()) if queries_per_s else None
    before = (await producer.progress(job)).done
    started = time.perf_counter()
    await asyncio.sleep(window)
    after = (await producer.progress(job)).done
    elapsed = time.perf_counter() - started
    stop.set()
    if loader:
        await loader
    return (after - before) / elapsed


async def scenario(args: argparse.Namespace) -> None:
    bare = bare_forward_seconds(args.queries)
    with redis_server() as server:
        settings = Settings(redis_url=server.url, namespace=f"lat{uuid.uuid4().hex[:6]}")
        with worker_process(settings, "latency-worker"):
            async with Producer(settings) as producer:
                await producer.embed_query(QUERY, timeout=120)  # waits for the model to load
                for _ in range(20):
                    await producer.embed_query(QUERY, timeout=30)
                rows = {}
                for concurrency in (1, 8):
                    rows[("idle", concurrency)] = await query_latencies(
                        producer, args.queries, concurrency
                    )
                backlog = bulk_corpus(args.backlog)
                await producer.enqueue(backlog, job="saturate")
                await asyncio.sleep(3)  # the worker is deep in bulk batches
                for concurrency in (1, 8):
                    rows[("saturated", concurrency)] = await query_latencies(
                        producer, args.queries, concurrency
                    )
                left = await producer.client.xlen(settings.keys.ingest)
                without, with_queries = [], []
                for _ in range(args.rounds):
                    without.append(await bulk_rate(producer, "saturate", args.window, 0))
                    with_queries.append(await bulk_rate(producer, "saturate", args.window, 10))
                left_after = await producer.client.xlen(settings.keys.ingest)
    print_table(bare, rows, left, without, with_queries, left_after, args)


def print_table(bare, rows, left, without, with_queries, left_after, args) -> None:
    slice_ms = 100.0  # the CPU default of EMBEDFLEET_SLICE_MS=-1 (auto)
    print(f"# query latency ({args.queries} queries per row; {machine_load()})")
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
    idle_p99 = percentile_ms(rows[("idle", 1)], 99)
    saturated_p99 = percentile_ms(rows[("saturated", 1)], 99)
    bound = 2 * idle_p99 + slice_ms
    print(
        f"\nsaturated p99 {saturated_p99:.1f} ms vs bound 2 x idle p99 + slice = {bound:.1f} ms: "
        f"{'OK' if saturated_p99 <= bound else 'OVER'}"
    )
    gap = percentile_ms(rows[("idle", 1)], 50) - percentile_ms(bare, 50)
    print(f"idle p50 - bare p50 = {gap:.2f} ms (target <= 2 ms)")
    print(
        f"backlog left when the saturated rows ended: {left} entries; after the throughput "
        f"rounds: {left_after}"
    )
    ratios = [b / a for a, b in zip(without, with_queries, strict=True)]
    print("\n| bulk load | texts/s (median of rounds) |")
    print("|---|---|")
    print(f"| no queries | {statistics.median(without):.1f} |")
    print(f"| 10 queries/s | {statistics.median(with_queries):.1f} |")
    print(
        f"ratio with/without (median of {len(ratios)} interleaved pairs): "
        f"{statistics.median(ratios):.3f} (target >= 0.90)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--queries", type=int, default=200, help="queries per row")
    parser.add_argument("--backlog", type=int, default=12000, help="bulk chunks enqueued")
    parser.add_argument("--window", type=float, default=15.0, help="seconds per throughput run")
    parser.add_argument("--rounds", type=int, default=3, help="A/B throughput pairs")
    args = parser.parse_args()
    uvloop.run(scenario(args))


if __name__ == "__main__":
    main()
