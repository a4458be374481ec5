"""A partition's backlog with every tenant's stream counted, read by one script
(shared/scripts/backlog.lua): the producers' high-water mark and tenant limits, the gateway's
429, and the fleet reader (`embedfleet status`, the workers' gauges) all read it this way."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from embedfleet.shared import scripts
from embedfleet.shared.keys import TENANT_STREAM_INFIX, Keys
from embedfleet.shared.redis_conn import as_str

BACKLOG_SCRIPT = scripts.load("backlog")


def backlog_command(partition: Keys) -> tuple[str | int, ...]:
    """The script call for one partition's key set (EVAL: routed by its keys' slot)."""
    return (
        "EVAL",
        BACKLOG_SCRIPT,
        2,
        partition.tenants,
        partition.ingest,
        partition.prefix + TENANT_STREAM_INFIX,
    )


@dataclass(frozen=True)
class PartitionBacklog:
    """XLEN of a partition's ingest streams: the total and each tenant's (None: the default)."""

    total: int = 0
    tenants: dict[str | None, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, reply: Sequence[Any]) -> PartitionBacklog:
        total, *pairs = reply
        tenants = {
            (as_str(name) or None): int(length)
            for name, length in zip(pairs[::2], pairs[1::2], strict=True)
        }
        return cls(int(total), tenants)


def tenant_backlog(backlogs: Sequence[PartitionBacklog], tenant: str | None) -> int:
    """A tenant's entries over all partitions (``tenant`` as on the wire: None the default)."""
    return sum(b.tenants.get(tenant, 0) for b in backlogs)
