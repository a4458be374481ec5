"""Re-ingestion (issue 31): a corpus embedded, then enqueued again with some of it changed.

    python -m loadtest.reingest --chunks 2000 --json reingest.json
    python -m loadtest.reingest --chunks 20000 --changed 0.1 --new 0.05 --removed 0.05

One in-process worker with the real model (EMBEDFLEET_MODEL, the packaged MiniLM by default)
writes to a LanceDB table in a temporary folder; Redis is a fresh local server (Debian's
redis-server, else the embedded Valkey). The first run enqueues CHUNKS short chunks under one
job and waits for it; then the job's id record is deleted (what EMBEDFLEET_JOB_IDS_FINISHED_TTL_S
does an hour after the job finished: the next day's run sends every chunk again), and the
corpus is enqueued again with --changed of its texts changed, --new chunks added and --removed
chunks left out, followed by the prune of the removed ids. Each run's wall time is from the
first enqueue to the job's end (the second's includes the prune). Reported: both times and
their ratio, the texts and tokens the model computed in each run (the worker's own counters),
the cache's hits and tokens saved, and the machine (CPU model, its SIMD flags from lscpu, the
load average before and after).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from embedfleet.ops.prune import prune
from embedfleet.producer import Producer
from embedfleet.shared.logging import configure_logging
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.redis_conn import connect
from embedfleet.shared.settings import Settings
from embedfleet.sinks import build_sink, local_sink_url
from embedfleet.workers.model.encoder import Encoder
from embedfleet.workers.worker import Worker
from loadtest.common import cpu_name, machine_load, redis_server

WORDS = [
    "river",
    "stone",
    "garden",
    "lamp",
    "paper",
    "cloud",
    "engine",
    "violin",
    "harbor",
    "maple",
    "orbit",
    "candle",
]
SIMD_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def text_of(n: int, version: int) -> str:
    first, second = WORDS[n % len(WORDS)], WORDS[(n // len(WORDS)) % len(WORDS)]
    mood = ("quiet", "bright", "rebuilt")[version]
    return f"Note {n}: the {first} by the {second} was {mood} this morning, said the log."


def corpora(count: int, changed: float, new: float, removed: float) -> tuple[list[Chunk], ...]:
    first = [Chunk(id=f"doc-{n}", text=text_of(n, 0)) for n in range(count)]
    kept = first[: count - round(count * removed)]
    changing = round(count * changed)  # of the whole corpus, spread evenly over what is kept
    positions = {position * len(kept) // changing for position in range(changing)}
    second = [
        dataclasses.replace(c, text=text_of(n, 1)) if n in positions else c
        for n, c in enumerate(kept)
    ]
    second += [
        Chunk(id=f"doc-{n}", text=text_of(n, 2)) for n in range(count, count + round(count * new))
    ]
    return first, second


def cpu_flags() -> str:
    """The SIMD flags that matter to the model, as lscpu lists them."""
    try:
        listing = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "lscpu unavailable"
    flags = next(
        (
            line.split(":", 1)[1].split()
            for line in listing.splitlines()
            if line.startswith("Flags")
        ),
        [],
    )
    return " ".join(flag for flag in SIMD_FLAGS if flag in flags) or "none of " + ",".join(
        SIMD_FLAGS
    )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    configure_logging("warning", "json")
    first, second = corpora(args.chunks, args.changed, args.new, args.removed)
    with redis_server() as server, tempfile.TemporaryDirectory() as folder:
        settings = Settings(
            redis_url=server.url,
            namespace=f"ri{uuid.uuid4().hex[:8]}",
            consumer="reingest",
            block_ms=100,
            log_format="json",
            log_level="warning",
            sink=local_sink_url("lancedb", Path(folder)),
            sink_table="chunks",
        )
        client = connect(settings.effective_redis_url)
        encoder = Encoder(settings.model, device="cpu", dtype=settings.dtype)
        sink = build_sink(settings, client)
        await sink.setup(encoder.name, encoder.dim)
        worker = Worker(settings, encoder, client, sink)
        task = asyncio.create_task(worker.run())
        await worker.queries.ready.wait()
        load_before = machine_load()
        runs = []
        try:
            async with Producer(settings, client) as producer:
                for number, corpus in enumerate((first, second)):
                    if number:  # the next day: the job's id record has expired
                        await client.delete(settings.keys.job_ids("docs"))
                    before = dataclasses.replace(worker.stats)
                    started = time.perf_counter()
                    await producer.enqueue(corpus, job="docs")
                    enqueued = time.perf_counter()
                    await producer.wait_for_job("docs", timeout=3600)
                    finished = time.perf_counter()
                    pruned = await prune(settings, "docs", {c.id for c in corpus}) if number else []
                    seconds = time.perf_counter() - started
                    stats = worker.stats
                    runs.append(
                        {
                            "chunks": len(corpus),
                            "seconds": round(seconds, 3),
                            "enqueue_seconds": round(enqueued - started, 3),
                            "prune_seconds": round(seconds - (finished - started), 3),
                            "embedded_texts": stats.embedded - before.embedded,
                            "embedded_tokens": stats.real_tokens - before.real_tokens,
                            "cache_hits": stats.cache.hits - before.cache.hits,
                            "tokens_saved": stats.cache.tokens_saved - before.cache.tokens_saved,
                            "pruned": len(pruned),
                            "model_seconds": round(stats.model_seconds - before.model_seconds, 3),
                        }
                    )
        finally:
            worker.drain()
            await task
            await sink.close()
            await client.aclose()
    return {
        "command": args.command,
        "cpu": cpu_name(),
        "cpu_flags": cpu_flags(),
        "load_before": load_before,
        "load_after": machine_load(),
        "model": encoder.name,
        "forward_path": encoder.forward_path,
        "runs": runs,
        "second_to_first": round(runs[1]["seconds"] / runs[0]["seconds"], 3),
    }


def render(report: dict[str, Any]) -> str:
    lines = [
        f"$ {report['command']}",
        f"{report['cpu']} ({report['cpu_flags']}); {report['load_before']} before, "
        f"{report['load_after']} after; {report['model']}, {report['forward_path']}",
        "run     chunks  seconds  (enqueue, prune, model)  model texts  model tokens  "
        "cache hits  tokens saved  pruned",
    ]
    for name, r in zip(("first", "second"), report["runs"], strict=True):
        lines.append(
            f"{name:<7} {r['chunks']:>6,}  {r['seconds']:>7.2f}  ({r['enqueue_seconds']:.2f}, "
            f"{r['prune_seconds']:.2f}, {r['model_seconds']:.2f})  {r['embedded_texts']:>11,}  "
            f"{r['embedded_tokens']:>12,}  {r['cache_hits']:>10,}  {r['tokens_saved']:>12,}  "
            f"{r['pruned']:>6,}"
        )
    lines.append(f"second run / first run: {report['second_to_first']:.3f} of the wall time")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=2000)
    parser.add_argument("--changed", type=float, default=0.10, help="share of texts changed")
    parser.add_argument("--new", type=float, default=0.05, help="share of chunks added")
    parser.add_argument("--removed", type=float, default=0.05, help="share of chunks removed")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()
    args.command = "python -m loadtest.reingest " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items() if k in ("chunks", "changed", "new", "removed")
    )
    report = asyncio.run(run(args))
    print(render(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
