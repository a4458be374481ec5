"""workers/memory.py: the trim timer (the first call, then at most every interval) and the trim
itself on this Linux/glibc machine."""

from __future__ import annotations

import sys

import pytest

from embedfleet.workers.memory import TrimTimer, release_free_memory


def test_a_trim_is_due_at_first_then_once_per_interval() -> None:
    timer = TrimTimer(interval=5.0)
    assert timer.due(now=100.0), "the first window is trimmed"
    assert not timer.due(now=104.9)
    assert timer.due(now=105.0)
    assert not timer.due(now=106.0), "the interval counts from the last trim, not the first"
    assert timer.due(now=110.0)


def test_a_zero_interval_trims_every_window() -> None:
    timer = TrimTimer(interval=0.0)
    assert all(timer.due(now=1.0) for _ in range(3))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_glibc_gives_freed_memory_back() -> None:
    assert release_free_memory() is True
