"""workers/parts.py's threads: two open windows where a second CPU can run one's Python beside
the other's Rust, one on a single CPU (issue 53, docs/BENCHMARKS.md stop 65)."""

from __future__ import annotations

import pytest

from embedfleet.workers import parts
from embedfleet.workers.parts import Threads


@pytest.mark.parametrize(("cpus", "openers"), [(1, 1), (2, 2), (16, 2)])
def test_windows_are_opened_on_two_threads_only_where_there_are_two_cpus(
    monkeypatch: pytest.MonkeyPatch, cpus: int, openers: int
) -> None:
    monkeypatch.setattr(parts, "usable_cpus", lambda: cpus)
    threads = Threads()
    try:
        assert threads.tokenizer._max_workers == openers
        # the windows' batch tokenizer calls: one at a time, each on every core
        assert threads.encode._max_workers == 1
    finally:
        threads.shutdown()
