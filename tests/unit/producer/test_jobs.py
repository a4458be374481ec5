"""Waiting for a job (producer/jobs.py): its progress read until it is finished, each read
shown to the caller, and a deadline that names what is done."""

from __future__ import annotations

import pytest

from embedfleet.producer.jobs import JobTimeoutError, wait_for
from embedfleet.shared.jobs import JobProgress


async def test_reads_until_finished_and_shows_each_read() -> None:
    reads = iter([JobProgress("j", 4, 1, 0), JobProgress("j", 4, 3, 0), JobProgress("j", 4, 3, 1)])
    seen: list[int] = []

    async def read(deadline: float | None) -> JobProgress:
        return next(reads)

    done = await wait_for(
        "j", read, timeout=None, interval=0.01, on_progress=lambda p: seen.append(p.done)
    )
    assert (done.done, done.dead, done.finished) == (3, 1, True)
    assert seen == [1, 3, 3]


async def test_past_the_timeout_the_error_names_the_progress() -> None:
    async def read(deadline: float | None) -> JobProgress:
        assert deadline is not None  # the read is bounded by the wait's own deadline
        return JobProgress("j", 10, 2, 1)

    with pytest.raises(JobTimeoutError, match=r"2 done, 1 dead of 10\. Are workers running"):
        await wait_for("j", read, timeout=0, interval=0.01, on_progress=None)
