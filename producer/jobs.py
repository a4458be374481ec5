"""A job's progress: its counters read over the partitions, and the wait for its end.

Each partition counts its own chunks of a job (``Keys.job``: enqueued, done, dead); a job is
finished once every chunk enqueued is done or dead. ``wait_for`` reads the counters paced by
the job's rate (producer/polling.py), so the end is seen promptly without polling fast all along.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from embedfleet.producer.lane import ProducerLane
from embedfleet.producer.polling import PollPacer
from embedfleet.shared.jobs import JobProgress
from embedfleet.shared.retry import RedisUnavailableError

# a job's progress, read before the deadline given (a time.monotonic() value), if any
ReadProgress = Callable[[float | None], Awaitable[JobProgress]]


class JobTimeoutError(TimeoutError):
    """wait_for_job gave up; the job is still running and its entries are still queued."""


async def read_progress(
    lane: ProducerLane, job: str, *, deadline: float | None = None
) -> JobProgress:
    """The job's counters on ``lane``, summed over the partitions (each counts its own chunks)."""

    async def read() -> list[Any]:
        pipe = lane.client.pipeline(transaction=False)
        for partition in lane.keys.partitions_keys:
            pipe.hgetall(partition.job(job))
        return await pipe.execute()

    counters = await lane.retry.call(f"read job {job!r}'s progress", read, deadline=deadline)
    return JobProgress.summed(job, counters)


async def wait_for(
    job: str,
    read: ReadProgress,
    *,
    timeout: float | None,
    interval: float,
    on_progress: Callable[[JobProgress], None] | None,
) -> JobProgress:
    """Read ``job``'s progress (``read``) until it is finished; JobTimeoutError past
    ``timeout``.

    ``interval`` is the longest wait between two reads of the job's counters; as the job
    nears its end (by its rate so far) the reads come sooner, down to 10 ms, so that the
    end is seen promptly without polling fast all along (producer/polling.py)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pacer = PollPacer(longest=interval)
    while True:
        try:
            progress = await read(deadline)
        except RedisUnavailableError as error:
            if deadline is None or time.monotonic() < deadline:
                raise  # EMBEDFLEET_REDIS_RETRY_S passed first
            raise JobTimeoutError(f"job {job!r} not finished after {timeout}s: {error}") from error
        if on_progress is not None:
            on_progress(progress)
        if progress.finished:
            return progress
        if deadline is not None and time.monotonic() > deadline:
            raise JobTimeoutError(
                f"job {job!r} not finished after {timeout}s: {progress.done} done, "
                f"{progress.dead} dead of {progress.enqueued}. Are workers running? "
                "Check with: embedfleet status"
            )
        await asyncio.sleep(
            pacer.delay(time.monotonic(), progress.done + progress.dead, progress.enqueued)
        )
