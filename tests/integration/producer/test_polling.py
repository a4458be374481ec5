"""A waiting producer's reads of a job's counters: sparse while the end is far, prompt near it
(producer/polling.py)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from embedfleet.producer import Producer
from embedfleet.producer.polling import PollPacer
from embedfleet.shared.jobs import JobProgress
from embedfleet.shared.settings import Settings


def test_no_rate_yet_waits_the_longest() -> None:
    pacer = PollPacer(longest=0.25)
    assert pacer.delay(now=10.0, finished=0, enqueued=100) == 0.25  # first read
    assert pacer.delay(now=10.5, finished=0, enqueued=100) == 0.25  # nothing finished since


@pytest.mark.parametrize(
    ("finished", "expected"),
    [
        (10, 0.25),  # 10/s, 90 left: 9 s away, the longest wait
        (96, 4 / 96 / 2),  # 96/s, 4 left: ~42 ms away, half of it
        (99, 0.01),  # 99/s, 1 left: ~10 ms away, never under the shortest
    ],
)
def test_the_wait_shrinks_with_the_time_left(finished: int, expected: float) -> None:
    pacer = PollPacer(longest=0.25, shortest=0.01)
    pacer.delay(now=0.0, finished=0, enqueued=100)
    assert pacer.delay(now=1.0, finished=finished, enqueued=100) == pytest.approx(expected)


def test_a_short_longest_is_kept() -> None:
    pacer = PollPacer(longest=0.005, shortest=0.01)
    pacer.delay(now=0.0, finished=0, enqueued=100)
    assert pacer.delay(now=1.0, finished=99, enqueued=100) == 0.005


async def test_wait_for_job_reads_sparsely_and_sees_the_end(
    settings: Settings, client: aioredis.Redis
) -> None:
    """A job finishing over ~1.2 s (counters moved in Redis as a worker's acknowledgements
    would): at a fixed 10 ms the wait would read ~120 times; paced, a handful, and it returns
    with the job finished."""
    counters = settings.keys.partitions_keys[0].job("paced")
    await client.hset(counters, mapping={"enqueued": 120, "done": 0, "dead": 0})
    reads: list[JobProgress] = []

    async def acknowledge() -> None:
        for _ in range(12):
            await asyncio.sleep(0.1)  # the pace of a simulated worker, not a synchronisation
            await client.hincrby(counters, "done", 10)

    async with Producer(settings, client) as producer:
        worker = asyncio.create_task(acknowledge())
        progress = await producer.wait_for_job(
            "paced", interval=0.25, timeout=60, on_progress=reads.append
        )
        await worker
    assert progress.finished and progress.done == 120
    assert 2 <= len(reads) <= 25, [r.done for r in reads]
    assert [r.done for r in reads] == sorted(r.done for r in reads)
