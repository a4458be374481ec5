"""workers/reclaim.py's in-flight set: the entries a worker computes, per stream, and those its
sink holds, which the reclaimer renews the leases of; the reclaim period (the claims against
Redis: tests/end_to_end/test_reliability.py)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from embedfleet.shared.settings import Settings
from embedfleet.workers.dead_letter_writer import DeadLetters
from embedfleet.workers.events import WorkerEvents
from embedfleet.workers.reclaim import InFlight, Reclaimer


@dataclass(frozen=True)
class Ref:
    stream: str
    entry_id: str


class Shard:
    """A sink holding written but unacknowledged entries (as a Parquet shard does)."""

    def __init__(self, held: list[Ref]) -> None:
        self.held = held

    def holding(self) -> Iterable[Ref]:
        return self.held

    def holds(self, stream: str, entry_id: str) -> bool:
        return Ref(stream, entry_id) in self.held


def test_entries_are_held_per_stream_until_released() -> None:
    in_flight = InFlight()
    in_flight.hold([Ref("a", "1-0"), Ref("a", "2-0"), Ref("b", "1-0")])
    in_flight.add("b", ["3-0"])
    assert len(in_flight) == 4
    assert in_flight.holds("a", "2-0") and not in_flight.holds("b", "2-0")
    in_flight.release([Ref("a", "1-0"), Ref("b", "1-0"), Ref("c", "9-0")])
    assert len(in_flight) == 2
    assert {s: sorted(ids) for s, ids in in_flight.snapshot().items()} == {
        "a": ["2-0"],
        "b": ["3-0"],
    }
    in_flight.release([Ref("a", "2-0")])
    assert "a" not in in_flight.snapshot(), "a stream with nothing held is left out"


def test_the_sinks_entries_are_renewed_but_not_counted_as_computed() -> None:
    in_flight = InFlight(Shard([Ref("a", "5-0"), Ref("b", "6-0")]))
    in_flight.hold([Ref("a", "1-0")])
    assert len(in_flight) == 1
    assert in_flight.holds("b", "6-0")
    assert {s: sorted(ids) for s, ids in in_flight.snapshot().items()} == {
        "a": ["1-0", "5-0"],
        "b": ["6-0"],
    }


def test_the_period_is_a_third_of_the_idle_limit_at_least_a_tenth_of_a_second() -> None:
    def period(idle_ms: int) -> float:
        settings = Settings(reclaim_idle_ms=idle_ms)
        dead = DeadLetters(None, settings.keys, WorkerEvents(), 60, 1024)  # type: ignore[arg-type]
        return Reclaimer(settings, None, InFlight(), dead, WorkerEvents(), read_count=8).period_s  # type: ignore[arg-type]

    assert period(30_000) == 10.0
    assert period(100) == 0.1, "the smallest limit, 100 ms"
