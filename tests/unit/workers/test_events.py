"""workers/events.py: every hook is forwarded (a hook added to WorkerEvents included), and the
stats a run reports count what the events said before passing them on."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from embedfleet.shared.vector_cache import CacheCounts
from embedfleet.workers.events import ForwardingEvents, StatsEvents, WorkerEvents, WorkerStats

HOOKS = sorted(name for name in vars(WorkerEvents) if not name.startswith("_"))


class Recorder(WorkerEvents):
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __getattribute__(self, name: str) -> Any:
        if name in HOOKS:
            return lambda **arguments: self.calls.append((name, arguments))
        return super().__getattribute__(name)


def test_every_hook_is_a_no_op_taking_keywords() -> None:
    assert len(HOOKS) >= 15
    assert WorkerEvents().outage(system="redis", active=True) is None


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_forwarded_with_its_arguments(hook: str) -> None:
    listener = Recorder()
    getattr(ForwardingEvents(listener), hook)(a=1, b="two")
    assert listener.calls == [(hook, {"a": 1, "b": "two"})]
    assert getattr(ForwardingEvents, hook).__doc__ == getattr(WorkerEvents, hook).__doc__


def test_stats_count_what_the_events_say_and_pass_them_on() -> None:
    listener = Recorder()
    stats = WorkerStats()
    events = StatsEvents(stats, listener)
    events.batch_encoded(texts=4, real_tokens=30, padded_tokens=40, seconds=0.5)
    events.results_written(texts=4, seconds=0.01)
    events.vector_cache_checked(hits=2, misses=4, tokens_saved=12)
    events.dead_lettered(count=1, reason="invalid")
    assert (stats.batches, stats.embedded, stats.texts, stats.dead_letters) == (1, 4, 4, 1)
    assert stats.cache == CacheCounts(hits=2, misses=4, tokens_saved=12)
    assert stats.padding_waste == pytest.approx(0.25)
    assert 0.0 < stats.model_busy_fraction <= 1.0
    names = [name for name, _ in listener.calls]
    assert names == [
        "batch_encoded",
        "model_busy",
        "results_written",
        "vector_cache_checked",
        "dead_lettered",
    ]


def test_a_copy_of_the_stats_keeps_its_cache_counts() -> None:
    """What loadtest/reingest.py and the re-ingest test subtract from: a copy taken before."""
    stats = WorkerStats()
    events = StatsEvents(stats, Recorder())
    events.vector_cache_checked(hits=1, misses=1, tokens_saved=5)
    before = dataclasses.replace(stats)
    events.vector_cache_checked(hits=2, misses=0, tokens_saved=9)
    assert before.cache == CacheCounts(1, 1, 5) and stats.cache == CacheCounts(3, 1, 14)


def test_no_tokens_is_no_padding_waste() -> None:
    assert WorkerStats().padding_waste == 0.0
