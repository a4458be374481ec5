"""How often a producer reads a job's counters while it waits for the job to finish.

A fixed interval is a trade: short, and every waiting producer sends that many reads a second
to Redis (and, where producer and worker share a host, wakes beside the worker's model threads
as often, which slows its forward passes: docs/BENCHMARKS.md, "Polling beside the worker");
long, and the end of a job is seen up to one interval late. The pacer polls at
the long interval while the job's end is far and comes closer as it nears, from the rate seen
so far, so that the end is seen within a few milliseconds with a handful of reads.
"""

from __future__ import annotations

from dataclasses import dataclass

# The shortest wait between two reads: near the end of a job its end is seen this late at most.
SHORTEST_POLL_S = 0.01


@dataclass
class PollPacer:
    """The wait before the next read of a job's counters.

    ``longest`` while nothing has finished since the first read (no rate to go by) or the job's
    estimated time left is long; then half the estimated time left, never under ``shortest``.
    Call :meth:`delay` after each read with that read's counters.
    """

    longest: float
    shortest: float = SHORTEST_POLL_S
    _first: tuple[float, int] | None = None  # (time, finished) at the first read

    def delay(self, now: float, finished: int, enqueued: int) -> float:
        """``finished`` = done + dead of ``enqueued`` at time ``now`` (monotonic seconds)."""
        shortest = min(self.shortest, self.longest)
        if self._first is None:
            self._first = (now, finished)
            return self.longest
        since, finished_then = self._first
        if finished <= finished_then or now <= since:
            return self.longest
        rate = (finished - finished_then) / (now - since)
        time_left = max(0, enqueued - finished) / rate
        return min(self.longest, max(shortest, time_left / 2))
