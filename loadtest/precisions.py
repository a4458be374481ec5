"""Output precisions side by side: ``python -m loadtest.precisions``.

The same corpus (``loadtest.corpus``) through the whole fleet (a real server, an in-process
worker, the Redis sink) once per output dtype, interleaved (a rotation per round, so a machine
that gets busier or quieter affects every dtype alike); the table gives texts/s per dtype and
the median of its per-round ratios to float16. int8/uint8 calibration is made before the clock
starts (a worker does it once per model and dimension, not per run).

It also times the output stage alone (``Outputs.results`` on 1024 vectors: truncation,
quantization, Result objects), which is what a dtype adds to the write path.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import sys
import time
import uuid

import click
import numpy as np

from embedfleet.shared.protocol import OUTPUT_DTYPES, Chunk
from embedfleet.workers.encoder import Encoder
from loadtest.bench import _server, machine_line
from loadtest.corpus import build_corpus


async def fleet_run(url: str, encoder: Encoder, chunks: list[dict], dtype: str) -> float:
    """Seconds from the first enqueue to the last result, every chunk written as ``dtype``."""
    from embedfleet.producer.client import Producer
    from embedfleet.shared.redis_conn import connect
    from embedfleet.shared.settings import load_settings
    from embedfleet.workers.sinks import RedisStreamSink
    from embedfleet.workers.worker import Worker

    settings = load_settings(
        redis_url=url,
        namespace=f"prec{uuid.uuid4().hex[:8]}",
        consumer="bench",
        log_level="warning",
        output_dtype=dtype,
    )
    client = connect(url)
    worker = Worker(settings, encoder, client, RedisStreamSink(client, settings.keys))
    # the fleet-wide calibration exists before the clock starts (made once per model and dim)
    await worker.outputs.prepare([Chunk(id="c", text="c", dtype=dtype)], worker.on_model_thread)
    task = asyncio.create_task(worker.run())
    try:
        async with Producer(settings) as producer:
            await asyncio.sleep(0.2)  # the worker is up and blocked on XREADGROUP
            started = time.perf_counter()
            await producer.enqueue(chunks, job="bench")
            progress = await producer.wait_for_job("bench", interval=0.01, timeout=3600)
            seconds = time.perf_counter() - started
            worker.drain()
            await asyncio.wait_for(task, timeout=60)
            await producer.client.flushdb()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await client.aclose()
    if progress.done != len(chunks):
        raise RuntimeError(f"{dtype}: {progress.done} of {len(chunks)} done")
    return seconds


def output_stage_us(encoder: Encoder, dtype: str, repeats: int = 20) -> float:
    """Microseconds per vector of the output stage alone, on 1024 random unit vectors."""
    from embedfleet.shared.settings import Settings
    from embedfleet.workers.calibration import Calibration, CalibrationStore
    from embedfleet.workers.output import Outputs

    outputs = Outputs(
        Settings(output_dtype=dtype), encoder, CalibrationStore(None, Settings().keys, "x")
    )
    generator = np.random.default_rng(0)
    vectors = generator.standard_normal((1024, encoder.dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    ranges = np.vstack((vectors.min(axis=0), vectors.max(axis=0)))
    outputs.calibrations._cache[outputs.variant(encoder.dim)] = Calibration(
        "x", "full", ranges, 1024, "bench"
    )
    chunks = [Chunk(id=str(i), text="t") for i in range(len(vectors))]
    truncated = [False] * len(vectors)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        outputs.results(chunks, vectors, truncated)
        best = min(best, time.perf_counter() - started)
    return best / len(vectors) * 1e6


@click.command()
@click.option("--texts", "count", type=int, default=600, show_default=True)
@click.option("--rounds", type=int, default=3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--redis-url", default=None, help="Use this server instead of starting one.")
def main(count: int, rounds: int, seed: int, redis_url: str | None) -> None:
    """Fleet throughput per output dtype, relative to float16, interleaved."""
    from embedfleet.shared.logging import configure_logging

    configure_logging("warning", "console")
    encoder = Encoder(device="cpu", dtype="float32")
    corpus = build_corpus(count, seed=seed)
    chunks = [{"id": item.id, "text": item.text} for item in corpus]
    print(f"machine: {machine_line()}", file=sys.stderr)
    rates: dict[str, list[float]] = {dtype: [] for dtype in OUTPUT_DTYPES}
    ratios: dict[str, list[float]] = {dtype: [] for dtype in OUTPUT_DTYPES}
    with _server(redis_url) as url:
        asyncio.run(fleet_run(url, encoder, chunks[:64], "float16"))  # warm-up
        for round_number in range(rounds):
            shift = round_number % len(OUTPUT_DTYPES)
            order = OUTPUT_DTYPES[shift:] + OUTPUT_DTYPES[:shift]
            this_round: dict[str, float] = {}
            for dtype in order:
                seconds = asyncio.run(fleet_run(url, encoder, chunks, dtype))
                this_round[dtype] = len(chunks) / seconds
                print(
                    f"round {round_number + 1} {dtype}: {this_round[dtype]:.1f} texts/s",
                    file=sys.stderr,
                )
            for dtype, rate in this_round.items():
                rates[dtype].append(rate)
                ratios[dtype].append(rate / this_round["float16"])
    print(f"\n{count} texts, {rounds} rounds interleaved; {machine_line()}\n")
    print(
        "| output dtype | texts/s (median) | vs float16 (median of per-round ratios) | "
        "output stage alone, µs/vector |"
    )
    print("|---|---|---|---|")
    for dtype in OUTPUT_DTYPES:
        print(
            f"| {dtype} | {statistics.median(rates[dtype]):.1f} | "
            f"{statistics.median(ratios[dtype]):.3f} "
            f"({min(ratios[dtype]):.3f}-{max(ratios[dtype]):.3f}) | "
            f"{output_stage_us(encoder, dtype):.2f} |"
        )


if __name__ == "__main__":
    main()
