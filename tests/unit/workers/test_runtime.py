"""workers/runtime.py's process set-up: once the model is loaded, the heap is frozen out of the
garbage collector and the collector runs at the worker's thresholds (issue 53)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from embedfleet.shared.settings.batching import AUTO_BATCHING
from embedfleet.workers.runtime import COLLECTOR_THRESHOLDS, freeze_loaded_heap


@pytest.fixture
def collector_restored() -> Iterator[None]:
    thresholds = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


@pytest.mark.usefixtures("collector_restored")
def test_the_loaded_heap_is_frozen_and_the_collector_runs_at_the_workers_thresholds() -> None:
    loaded = [[index] for index in range(1000)]  # what the process holds once loaded
    freeze_loaded_heap()
    assert gc.get_freeze_count() >= len(loaded)
    assert gc.get_threshold() == COLLECTOR_THRESHOLDS
    # the largest read window's objects (several per entry) stay below the youngest
    # generation's threshold: a window is not promoted while it is opened and written
    largest_window = max(batching.read_count for batching in AUTO_BATCHING.values())
    assert COLLECTOR_THRESHOLDS[0] >= 10 * largest_window
