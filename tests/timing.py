"""Where the suite's time goes, per module: wall seconds against CPU seconds (this process and
the children it reaped: worker and gateway processes, servers started per module). A module
whose CPU is far below its wall waits on I/O or on timers, and can run beside another one
(pytest-xdist); one near 2x its wall already fills both cores.

Opt-in: ``pytest -p tests.timing`` writes ``build/test-timing[-gwN].json`` (the folder from
EMBEDFLEET_TEST_TIMING_DIR, default build/); ``python -m tests.timing`` prints the table.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path

import pytest

from tests import forks
from tests.paths import REPO_ROOT

_totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    forked = forks.reaped_cpu_seconds()  # commands forked by tests/forks.py: not our children
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + forked


def _folder() -> Path:
    return Path(os.environ.get("EMBEDFLEET_TEST_TIMING_DIR", REPO_ROOT / "build"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    wall, cpu = time.perf_counter(), _cpu_seconds()
    yield
    total = _totals[item.nodeid.split("::", 1)[0]]
    total[0] += time.perf_counter() - wall
    total[1] += _cpu_seconds() - cpu
    total[2] += 1


def pytest_sessionfinish(session: pytest.Session) -> None:
    # one file per process: an xdist worker's, or a lane's run beside the rest (Makefile)
    lane = os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get("EMBEDFLEET_TEST_TIMING_LANE")
    path = _folder() / (f"test-timing-{lane}.json" if lane else "test-timing.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({name: list(t) for name, t in _totals.items()}, indent=1))


def main() -> None:
    merged: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for path in sorted(_folder().glob("test-timing*.json")):
        # summed, not replaced: a module with tests in both tiers (test_tenant_pace.py's serial
        # test beside its parallel ones) has a row in two files
        for name, figures in json.loads(path.read_text()).items():
            merged[name] = [kept + more for kept, more in zip(merged[name], figures, strict=True)]
    rows = sorted(merged.items(), key=lambda row: -row[1][0])
    print(f"{'wall s':>8} {'cpu s':>8} {'cpu/wall':>8} {'tests':>5}  module")
    for name, (wall, cpu, count) in rows:
        print(f"{wall:8.1f} {cpu:8.1f} {cpu / max(wall, 1e-9):8.2f} {count:5d}  {name}")
    wall_sum = sum(row[1][0] for row in rows)
    cpu_sum = sum(row[1][1] for row in rows)
    print(f"{wall_sum:8.1f} {cpu_sum:8.1f}  all ({len(rows)} modules)", file=sys.stdout)


if __name__ == "__main__":
    main()
