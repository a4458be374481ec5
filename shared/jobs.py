"""A job's counters: the one reading of ``{ns}:job:<id>`` for the client, the CLI and status.

Each partition holds its own counters hash for the chunks routed to it (``enqueued`` by the
enqueue script, ``done`` by the workers' acknowledgement script, ``dead`` by dead-lettering and
replay); a job's progress is their sum.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# Not a counter: the enqueue sets it (EMBEDFLEET_JOB_IDS_FINISHED_TTL_S), and the workers'
# acknowledgement script gives the job's id record this TTL once the job has finished.
IDS_TTL_AFTER_DONE_FIELD = "ids_ttl_after_done_s"


@dataclass(frozen=True)
class JobProgress:
    job: str
    enqueued: int
    done: int
    dead: int
    # the vector cache's counts (shared/vector_cache.py): chunks written from a stored vector,
    # chunks looked up and embedded, and the tokens the hits did not compute
    cache_hits: int = 0
    cache_misses: int = 0
    tokens_saved: int = 0

    @property
    def finished(self) -> bool:
        return self.enqueued > 0 and self.done + self.dead >= self.enqueued

    @property
    def remaining(self) -> int:
        return max(0, self.enqueued - self.done - self.dead)

    @classmethod
    def summed(cls, job: str, partitions: Iterable[Mapping[bytes, bytes]]) -> JobProgress:
        """The job's progress from each partition's counters hash (HGETALL replies)."""
        values: dict[str, int] = {}
        for counters in partitions:
            for key, value in counters.items():
                name = key.decode() if isinstance(key, bytes) else key
                if name == IDS_TTL_AFTER_DONE_FIELD:
                    continue
                values[name] = values.get(name, 0) + int(value)
        counted = ("enqueued", "done", "dead", "cache_hits", "cache_misses", "tokens_saved")
        return cls(job, *(values.get(name, 0) for name in counted))
