"""Fair share between tenants, measured (issue 30): a small job behind a large backlog, and a
3:1 split.

    python -m loadtest.fairness --json fairness.json
    python -m loadtest.fairness --small 1000 --ratio 20 --us-per-token 100 --workers 1

Worker processes (`embedfleet worker`) run the benchmark stand-in encoder
(EMBEDFLEET_BENCHMARK_STANDIN_ENCODER_US_PER_TOKEN, workers/model/standin.py: the real tokenizer and
pipeline, a fixed cost per real token instead of the model), so the pace is a device's that
costs ``--us-per-token`` per token, and the reads, the weighted round robin, the writes and
the acknowledgements are the fleet's own.

1. **Backlog**: tenant B's job of ``--small`` chunks, timed
   - *alone* (nothing else queued): the whole fleet is B's;
   - *fair*: tenant A enqueues ``--ratio`` times as many first, the workers start on it, then
     B enqueues; weights 1:1, so B's share is half the fleet and the time to expect is twice
     *alone*;
   - *FIFO*: the same, but A's and B's chunks are one tenant's (one stream, as before tenants):
     B finishes after A's backlog.
2. **Weights 3:1**: A (weight 3) and B (weight 1) each enqueue ``--split`` chunks at once;
   both jobs' done counters are read at the start and end of a window of ``--window-s``
   seconds, ``--warmup-s`` after the enqueues, while both have work (checked), and the ratio of
   their throughputs is reported (target: within 10% of 3).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from embedfleet.producer import Producer
from embedfleet.server import isolated_settings
from embedfleet.shared.logging import configure_logging
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.settings import Settings
from loadtest.common import (
    cpu_name,
    machine_load,
    print_report,
    run_on_redis,
    worker_process,
)

WORDS = [
    "the",
    "fleet",
    "reads",
    "every",
    "tenant",
    "by",
    "its",
    "weight",
    "whatever",
    "the",
    "others",
    "hold",
]


def texts(prefix: str, count: int) -> Iterator[Chunk]:
    """Chunks of about 14 tokens each, alike in length (the unit of fair share is an entry)."""
    for i in range(count):
        words = [WORDS[(i + k) % len(WORDS)] for k in range(10)]
        yield Chunk(id=f"{prefix}{i}", text=" ".join(words) + f" {i}")


@dataclass
class Setup:
    """What was run: B's and A's chunks, the workers and their pace, where and how."""

    small: int
    large: int
    workers: int
    us_per_token: float
    machine: str
    command: str


@dataclass
class BacklogRun:
    """The backlog scenario's figures (zeros where it was not run)."""

    alone_s: float = 0.0
    fair_s: float = 0.0
    fifo_s: float = 0.0
    expected_fair_s: float = 0.0  # alone at its share: alone_s / (B's weight share)
    large_left_when_small_enqueued_fair: int = 0
    large_left_when_small_enqueued_fifo: int = 0


@dataclass
class SplitRun:
    """The 3:1 scenario's figures (zeros where it was not run)."""

    split: int = 0
    weights: str = ""
    window_s: float = 0.0
    a_per_s: float = 0.0
    b_per_s: float = 0.0
    ratio: float = 0.0


@dataclass
class Report(SplitRun, BacklogRun, Setup):
    """The setup and both scenarios' figures in one flat record, as --json writes it: a
    dataclass takes its bases' fields last base first, so the setup's come first."""


def worker_env(us_per_token: float, weights: str) -> dict[str, str]:
    return {
        "EMBEDFLEET_BENCHMARK_STANDIN_ENCODER_US_PER_TOKEN": str(us_per_token),
        "EMBEDFLEET_TENANT_WEIGHTS": weights,
        "EMBEDFLEET_RESULTS_MAX_ENTRIES": "0",  # nothing drains the results here
        "EMBEDFLEET_BLOCK_MS": "100",
        "EMBEDFLEET_READ_COUNT": "256",
        "EMBEDFLEET_THREADS": "1",
    }


async def _until_ready(producer: Producer) -> None:
    """Until a worker of the namespace has published its model card (it is reading)."""
    async with asyncio.timeout(300):
        while await producer.model_card() is None:
            await asyncio.sleep(0.2)


async def _timed_job(
    producer: Producer, prefix: str, count: int, job: str, tenant: str | None
) -> float:
    started = time.monotonic()
    await producer.enqueue(texts(prefix, count), job=job, tenant=tenant)
    await producer.wait_for_job(job, timeout=3600, interval=0.05)
    return time.monotonic() - started


async def _behind(
    producer: Producer, args: argparse.Namespace, run: str, small_tenant: str | None
) -> tuple[float, int]:
    """A's backlog first (tenant a), the workers under way on it, then B's job (tenant
    ``small_tenant``): B's time and A's entries left when B enqueued. Waits for A's end."""
    large = args.small * args.ratio
    await producer.enqueue(texts(f"{run}a", large), job=f"{run}-a", tenant="a")
    while (await producer.progress(f"{run}-a")).done < min(500, large // 10):
        await asyncio.sleep(0.05)
    left = (await producer.progress(f"{run}-a")).remaining
    seconds = await _timed_job(producer, f"{run}b", args.small, f"{run}-b", small_tenant)
    await producer.wait_for_job(f"{run}-a", timeout=3600)
    return seconds, left


async def backlog_scenario(url: str, args: argparse.Namespace) -> BacklogRun:
    settings = isolated_settings(url, tenant_weights="a=1,b=1")
    env = worker_env(args.us_per_token, settings.tenant_weights)
    with _workers(settings, args.workers, env):
        async with Producer(settings) as producer:
            await _until_ready(producer)
            alone = await _timed_job(producer, "alone", args.small, "alone-b", "b")
            fair, fair_left = await _behind(producer, args, "fair", "b")
            fifo, fifo_left = await _behind(producer, args, "fifo", "a")
    share = 1 / 2  # weights 1:1
    return BacklogRun(
        alone_s=round(alone, 2),
        fair_s=round(fair, 2),
        fifo_s=round(fifo, 2),
        expected_fair_s=round(alone / share, 2),
        large_left_when_small_enqueued_fair=fair_left,
        large_left_when_small_enqueued_fifo=fifo_left,
    )


async def split_scenario(url: str, args: argparse.Namespace) -> SplitRun:
    weights = "a=3,b=1"
    settings = isolated_settings(url, tenant_weights=weights)
    env = worker_env(args.us_per_token, weights)
    with _workers(settings, args.workers, env):
        async with Producer(settings) as producer:
            await _until_ready(producer)
            # both at once (batches interleaved), so neither starts with the fleet to itself
            await asyncio.gather(
                producer.enqueue(texts("a", args.split), job="split-a", tenant="a"),
                producer.enqueue(texts("b", args.split), job="split-b", tenant="b"),
            )
            # the window: fixed times (not a counter's step, which would bias the counts), from
            # --warmup-s after both were enqueued, for --window-s, while both have work
            await asyncio.sleep(args.warmup_s)
            a0, b0, t0 = await _done(producer)
            await asyncio.sleep(args.window_s)
            a1, b1, t1 = await _done(producer)
            if a1 >= args.split or b1 >= args.split:
                raise SystemExit("a tenant ran out of work within the window: raise --split")
            await producer.wait_for_job("split-a", timeout=3600)
            await producer.wait_for_job("split-b", timeout=3600)
    window = t1 - t0
    a_rate, b_rate = (a1 - a0) / window, (b1 - b0) / window
    return SplitRun(
        split=args.split,
        weights=weights,
        window_s=round(window, 2),
        a_per_s=round(a_rate, 1),
        b_per_s=round(b_rate, 1),
        ratio=round(a_rate / b_rate, 3) if b_rate else float("inf"),
    )


async def _done(producer: Producer) -> tuple[int, int, float]:
    a, b = await asyncio.gather(producer.progress("split-a"), producer.progress("split-b"))
    return a.done, b.done, time.monotonic()


@contextlib.contextmanager
def _workers(settings: Settings, count: int, env: dict[str, str]) -> Iterator[None]:
    """``count`` worker processes on ``settings``' namespace, drained on exit."""
    with contextlib.ExitStack() as stack:
        for _ in range(count):
            stack.enter_context(worker_process(settings, f"fair-{uuid.uuid4().hex[:6]}", **env))
        yield


def render(report: Report) -> str:
    within = abs(report.ratio - 3) / 3 <= 0.10
    return "\n".join(
        [
            f"fair share, {report.workers} stand-in worker(s) at {report.us_per_token:g} us/token",
            f"backlog  B's {report.small:,} chunks alone {report.alone_s:.1f} s; behind A's "
            f"{report.large:,} with 1:1 weights {report.fair_s:.1f} s (alone at its half share: "
            f"{report.expected_fair_s:.1f} s; A had {report.large_left_when_small_enqueued_fair:,}"
            f" left); one FIFO stream {report.fifo_s:.1f} s (A had "
            f"{report.large_left_when_small_enqueued_fifo:,} left)",
            f"weights  {report.weights}: A {report.a_per_s:,.1f}/s, B {report.b_per_s:,.1f}/s over "
            f"{report.window_s:.1f} s with both busy: ratio {report.ratio:.2f} "
            f"({'within' if within else 'NOT within'} 10% of 3)",
            f"machine  {report.machine}",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", type=int, default=1000, help="B's job, chunks")
    parser.add_argument("--ratio", type=int, default=20, help="A's backlog over B's job")
    parser.add_argument("--split", type=int, default=6000, help="each tenant's chunks, 3:1 run")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--us-per-token", type=float, default=100.0, help="stand-in cost")
    parser.add_argument("--redis-url", default=None, help="default: a fresh local server")
    parser.add_argument("--warmup-s", type=float, default=2.0, help="3:1 run: before the window")
    parser.add_argument("--window-s", type=float, default=8.0, help="3:1 run: the window")
    parser.add_argument("--scenarios", default="backlog,split", help="which of backlog,split")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()
    configure_logging("error", "console")

    async def go(url: str) -> Report:
        backlog = await backlog_scenario(url, args) if "backlog" in args.scenarios else BacklogRun()
        split = await split_scenario(url, args) if "split" in args.scenarios else SplitRun()
        return Report(
            small=args.small,
            large=args.small * args.ratio,
            workers=args.workers,
            us_per_token=args.us_per_token,
            machine=f"{cpu_name()}; {machine_load()}",
            command="python -m loadtest.fairness "
            + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v),
            **dataclasses.asdict(backlog),
            **dataclasses.asdict(split),
        )

    report = run_on_redis(args.redis_url, go)
    print_report(report, render(report), args.json)


if __name__ == "__main__":
    main()
