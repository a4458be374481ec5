"""workers/blocking_reads.py: the idle wait's reads kept until they return, one per name;
collected when done, a failure raised only when nothing else came, finished on drain and
cancelled on abort (with XREADGROUP: tests/integration/workers/test_fair.py)."""

from __future__ import annotations

import asyncio

import pytest

from embedfleet.workers.blocking_reads import BlockingReads


async def test_a_read_is_started_once_per_name_and_collected_when_it_returns() -> None:
    reads: BlockingReads[str] = BlockingReads()
    release = asyncio.Event()
    started: list[str] = []

    async def blocked(name: str) -> list[str]:
        started.append(name)
        await release.wait()
        return [f"{name}-entry"]

    reads.start("p0", lambda: blocked("p0"))
    reads.start("p0", lambda: blocked("again"))  # still waiting: not started twice
    reads.start("interactive", lambda: blocked("interactive"))
    await asyncio.sleep(0)  # the tasks run to their wait
    assert started == ["p0", "interactive"]
    assert reads.blocked("p0") and reads.collect() == []
    release.set()
    await reads.first(timeout=5)
    await asyncio.gather(*reads._tasks.values())
    assert reads.collect(only="interactive") == ["interactive-entry"]
    assert reads.collect() == ["p0-entry"] and not reads


async def test_a_failed_read_is_raised_only_when_no_other_read_brought_entries() -> None:
    async def fails() -> list[str]:
        raise ConnectionError("gone")

    async def brings() -> list[str]:
        return ["e"]

    reads: BlockingReads[str] = BlockingReads()
    reads.start("a", fails)
    reads.start("b", brings)
    assert await reads.finish() == ["e"]  # what came is kept, the failure swallowed
    reads.start("a", fails)
    await asyncio.sleep(0)
    with pytest.raises(ConnectionError):
        reads.collect()


async def test_abandon_cancels_the_reads_still_waiting() -> None:
    reads: BlockingReads[str] = BlockingReads()
    never = asyncio.Event()

    async def blocked() -> list[str]:
        await never.wait()
        return []

    reads.start("p0", blocked)
    await asyncio.sleep(0)
    task = reads._tasks["p0"]
    reads.abandon()
    assert not reads
    with pytest.raises(asyncio.CancelledError):
        await task
