"""Reading the state of the streams and the consumer group, as `redis-cli XINFO` shows it.

The worker's metrics (lag and pending gauges) and `embedfleet status` read the same numbers the
same way, so a dashboard and the command line never disagree.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from embedfleet.shared.keys import Keys


@dataclass(frozen=True)
class GroupState:
    """One consumer group of one stream, from ``XINFO GROUPS``.

    ``lag`` (Redis >= 7) counts entries not yet delivered to any consumer; it is None when Redis
    cannot compute it (XINFO then says nil, and KEDA reads that as 0). ``entries_read`` counts
    entries ever delivered to the group; ``entries_read - pending`` is how many the group has
    finished (acknowledged), which `embedfleet status` samples to measure throughput.
    """

    name: str
    consumers: int
    pending: int
    last_delivered_id: str
    entries_read: int | None
    lag: int | None

    @property
    def acknowledged(self) -> int | None:
        """Entries delivered and acknowledged (embedded or dead-lettered), when Redis counts."""
        if self.entries_read is None:
            # Redis says nil until the group's first delivery; then nothing is finished yet.
            return 0 if self.last_delivered_id == "0-0" else None
        return self.entries_read - self.pending


@dataclass(frozen=True)
class ConsumerState:
    """One consumer of a group, from ``XINFO CONSUMERS``.

    ``idle_ms``: since its last read attempt. ``inactive_ms`` (Redis >= 7.2, else None): since its
    last successful read or claim; a consumer that keeps polling an empty stream has a small
    ``idle_ms`` and a growing ``inactive_ms``.
    """

    name: str
    pending: int
    idle_ms: int
    inactive_ms: int | None


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def find_group(groups: Sequence[Mapping[str, Any]], group: str) -> GroupState | None:
    """Our group in a parsed ``XINFO GROUPS`` reply (redis-py's list of dicts), or None."""
    for info in groups:
        if text(info["name"]) != group:
            continue
        return GroupState(
            name=group,
            consumers=int(info.get("consumers", 0)),
            pending=int(info.get("pending", 0)),
            last_delivered_id=text(info.get("last-delivered-id", b"0-0")),
            entries_read=_optional_int(info.get("entries-read")),
            lag=_optional_int(info.get("lag")),
        )
    return None


def parse_consumers(consumers: Sequence[Mapping[str, Any]]) -> list[ConsumerState]:
    """A parsed ``XINFO CONSUMERS`` reply, sorted by name."""
    parsed = [
        ConsumerState(
            name=text(info["name"]),
            pending=int(info.get("pending", 0)),
            idle_ms=int(info.get("idle", 0)),
            inactive_ms=_optional_int(info.get("inactive")),
        )
        for info in consumers
    ]
    return sorted(parsed, key=lambda consumer: consumer.name)


def is_missing_key(error: BaseException) -> bool:
    """XINFO on a stream that does not exist yet (no producer or worker has created it)."""
    return "no such key" in str(error).lower()


async def live_workers(client: Any, keys: Keys, idle_limit_ms: int) -> int:
    """Workers whose heartbeat (workers/heartbeat.py) is at most ``idle_limit_ms`` old."""
    since = int(time.time() * 1000) - idle_limit_ms
    return int(await client.zcount(keys.workers_alive, since, "+inf"))
