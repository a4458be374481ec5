"""Sparklines for `embedfleet status --watch`: throughput and backlog over the last minutes.

Built from the ``--json`` report of each refresh (``entries_read - pending`` per input stream is
what the fleet has finished; ``backlog`` is lag + pending), so they show the same numbers the
rest of the view does, in one line of terminal characters each.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TREND_WINDOW_S = 300.0  # the last 5 minutes
TREND_COLUMNS = 60  # 5 s per column over 5 minutes
BLOCKS = "▁▂▃▄▅▆▇█"
ASCII_LEVELS = "_.-:=+*#"  # where the terminal cannot print block elements


def levels_for(encoding: str | None) -> str:
    try:
        BLOCKS.encode(encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return ASCII_LEVELS
    return BLOCKS


def sparkline(values: Sequence[float | None], levels: str = BLOCKS) -> str:
    """One character per value, from the lowest level (0) to the highest (the maximum);
    a blank where there is no value (before watching began, or a failed read)."""
    known = [v for v in values if v is not None and math.isfinite(v)]
    top = max(known, default=0.0)
    out = []
    for value in values:
        if value is None or not math.isfinite(value):
            out.append(" ")
        elif top <= 0:
            out.append(levels[0])
        else:
            index = round(max(0.0, value) / top * (len(levels) - 1))
            out.append(levels[index])
    return "".join(out)


@dataclass(frozen=True)
class _Sample:
    at: float  # time.monotonic()
    finished: int | None  # entries finished so far, both input streams
    backlog: int | None


def finished_entries(data: Mapping[str, Any]) -> int | None:
    """Entries finished since the groups were created, from a ``status --json`` report."""
    total = 0
    for name in ("ingest", "query"):
        stream = data["streams"][name]
        if not stream.get("group_exists"):
            continue
        if stream.get("entries_read") is None:
            # nil until the group's first delivery (nothing finished yet), or a Redis that
            # does not count (shared.streams.GroupState.acknowledged reads it the same way)
            if stream.get("last_delivered_id") == "0-0":
                continue
            return None
        total += stream["entries_read"] - stream["pending"]
    return total


class Trend:
    """The reports of the last ``window_s`` seconds, drawn as ``columns`` time buckets."""

    def __init__(self, window_s: float = TREND_WINDOW_S, columns: int = TREND_COLUMNS) -> None:
        self.window_s = window_s
        self.columns = columns
        self._samples: deque[_Sample] = deque()

    def add(self, at: float, data: Mapping[str, Any]) -> None:
        self._samples.append(_Sample(at, finished_entries(data), data.get("backlog")))
        # keep one sample older than the window: the first column's rate needs a start
        while len(self._samples) > 2 and self._samples[1].at <= at - self.window_s:
            self._samples.popleft()

    def series(self, now: float) -> tuple[list[float | None], list[float | None]]:
        """(entries/s, backlog) per column, oldest first; None where no sample fell."""
        width = self.window_s / self.columns
        rates: list[float | None] = [None] * self.columns
        backlogs: list[float | None] = [None] * self.columns
        previous: _Sample | None = None
        for sample in self._samples:
            column = self.columns - 1 - math.floor((now - sample.at) / width)
            if 0 <= column < self.columns:
                if sample.backlog is not None:
                    backlogs[column] = float(sample.backlog)
                rate = _rate(previous, sample)
                if rate is not None:  # the last rate measured within the column
                    rates[column] = rate
            previous = sample
        return rates, backlogs

    def lines(self, now: float, levels: str | None = None) -> list[str]:
        levels = levels or levels_for(sys.stdout.encoding)
        rates, backlogs = self.series(now)
        minutes = f"{self.window_s / 60:g} min"
        return [
            f"last {minutes:<7}entries/s {sparkline(rates, levels)} {_summary(rates, '/s')}",
            f"{'':<12}backlog   {sparkline(backlogs, levels)} {_summary(backlogs, '')}",
        ]


def _rate(before: _Sample | None, after: _Sample) -> float | None:
    if before is None or before.finished is None or after.finished is None:
        return None
    elapsed = after.at - before.at
    if elapsed <= 0 or after.finished < before.finished:  # a group created again: unknown
        return None
    return (after.finished - before.finished) / elapsed


def _summary(values: Sequence[float | None], unit: str) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "(measuring)"
    return f"now {known[-1]:,.0f}{unit}, peak {max(known):,.0f}{unit}"
