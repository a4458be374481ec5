"""Worker memory over a long run: RSS after 2,000 and after 20,000 chunks.

    python -m loadtest.soak [--chunks 20000] [--plot FILE.png]

A worker process embeds a long stream of chunks; its resident memory is read from /proc as the
job passes each mark. Acknowledged entries are deleted and every queue inside the worker is
bounded, so the two figures should differ by well under 10%. Every half second the RSS and the
backlog (the ingest stream's length: finished entries are deleted) are sampled too, for
``--plot``: RSS over chunks and the backlog draining over time.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
import uuid
from pathlib import Path

import uvloop

from embedfleet.producer import Producer
from embedfleet.producer.chunker import builtin_corpus
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.settings import Settings
from loadtest.common import add_plot_argument, machine_load, redis_server, rss_mib, worker_process


def chunks(count: int) -> list[Chunk]:
    texts = [c.text for c in builtin_corpus(max_chars=400)]
    return [Chunk(id=f"s{i}", text=t) for i, t in zip(range(count), itertools.cycle(texts))]


SAMPLE_EVERY_S = 0.5


async def soak(count: int, marks: list[int], plot: Path | None = None) -> None:
    with redis_server() as server:
        settings = Settings(redis_url=server.url, namespace=f"soak{uuid.uuid4().hex[:6]}")
        with worker_process(settings, "soak-worker") as worker:
            async with Producer(settings) as producer:
                await producer.embed_query("warm up", timeout=120)
                readings = {0: rss_mib(worker.pid)}
                samples: list[dict[str, float]] = []
                started = time.perf_counter()

                async def sample(done: int) -> float:
                    rss = rss_mib(worker.pid)
                    samples.append(
                        {
                            "seconds": time.perf_counter() - started,
                            "done": done,
                            "rss_mib": rss,
                            "backlog": await producer.client.xlen(settings.keys.ingest),
                        }
                    )
                    return rss

                enqueue = asyncio.create_task(producer.enqueue(chunks(count), job="soak"))
                next_sample = started
                for mark in marks:
                    while (done := (await producer.progress("soak")).done) < mark:
                        if time.perf_counter() >= next_sample:
                            next_sample += SAMPLE_EVERY_S
                            await sample(done)
                        await asyncio.sleep(0.1)
                    readings[mark] = await sample(done)
                    print(
                        f"{mark:>6} chunks: RSS {readings[mark]:.1f} MiB "
                        f"({time.perf_counter() - started:.0f} s)",
                        flush=True,
                    )
                await enqueue
                stream_left = await producer.client.xlen(settings.keys.ingest)
    first, last = readings[marks[0]], readings[marks[-1]]
    print(f"\n# worker RSS ({machine_load()})")
    print("| chunks embedded | RSS MiB |\n|---|---|")
    for mark, value in readings.items():
        print(f"| {mark} | {value:.1f} |")
    print(
        f"\nRSS at {marks[-1]} vs {marks[0]}: {100 * (last - first) / first:+.1f}% "
        f"(target: within 10%); entries left in the ingest stream: {stream_left}"
    )
    if plot is not None:
        from loadtest.plots import plot_soak

        subtitle = f"one worker process, {count:,} chunks of the built-in corpus; {machine_load()}"
        print(f"chart: {plot_soak(samples, plot, subtitle, marks)}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunks", type=int, default=20_000)
    add_plot_argument(parser, "RSS over chunks and the backlog over time")
    args = parser.parse_args()
    marks = sorted({min(2_000, args.chunks), args.chunks // 2, args.chunks})
    uvloop.run(soak(args.chunks, marks, args.plot))


if __name__ == "__main__":
    main()
