"""Backpressure on enqueueing: the backlog as the producer reads it, and the waits for room.

Two bounds hold an enqueue call back: the fleet's high-water mark (EMBEDFLEET_BACKLOG_HIGH_WATER,
each partition's streams bounded on its own node: waited out, however long) and a tenant's
EMBEDFLEET_TENANT_MAX_BACKLOG (each partition its share: waited for at most the call's
``backlog_wait_s``, else EMBEDFLEET_TENANT_BACKLOG_WAIT_S, then ``TenantBacklogFullError``).
The enqueue script decides entry by entry (producer/enqueue.py); these waits only decide when
sending again is worth a round trip.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from embedfleet.producer.enqueue import Enqueued
from embedfleet.producer.lane import ProducerLane
from embedfleet.shared.backlog import PartitionBacklog, backlog_command, tenant_backlog
from embedfleet.shared.keys import Keys
from embedfleet.shared.logging import get_logger
from embedfleet.shared.protocol import Chunk

log = get_logger("embedfleet.producer")
# How often a wait for room reads the backlog again
RECHECK_S = 0.5


class TenantBacklogFullError(RuntimeError):
    """A tenant's backlog stayed at its EMBEDFLEET_TENANT_MAX_BACKLOG for
    EMBEDFLEET_TENANT_BACKLOG_WAIT_S (or the call's ``backlog_wait_s``): ``added`` (an
    ``Enqueued``) is what the enqueue call added before it gave up, and the message says how
    many; its other chunks were not added. Enqueueing them all again under the same job adds
    only those (the job skips the others). ``handled``: how many of the call's chunks, from
    its first, were dealt with (added, or in their job already); sending the rest from there
    loses nothing (a chunk after it may have been added too: sent again, its job skips it)."""

    def __init__(self, full: str, added: Enqueued | None = None, handled: int = 0) -> None:
        super().__init__(full)
        self.full = full  # who holds what, and how long the call waited
        self.added = added if added is not None else Enqueued()
        self.handled = handled

    def __str__(self) -> str:
        return (
            f"{self.full}; this call added {int(self.added)} of its chunks, the others were "
            "not added: enqueue them again once there is room (a job skips the chunks it "
            "already has)"
        )


@dataclass(frozen=True)
class TenantRoom:
    """A tenant's entries over all partitions (``held``) against its
    EMBEDFLEET_TENANT_MAX_BACKLOG (``limit``; None: no limit): the one comparison of a tenant's
    backlog, for the producer's waits and the gateway's 429 and Batch API slices alike."""

    held: int
    limit: int | None

    @property
    def left(self) -> int | None:
        """Entries the tenant may still add; None: no limit."""
        return None if self.limit is None else max(self.limit - self.held, 0)

    @property
    def full(self) -> bool:
        return self.left == 0


def _waited(wait_s: float) -> str:
    """How long a call waited for room, for TenantBacklogFullError's message."""
    if not wait_s:
        return "(the call does not wait for room)"
    return f"after waiting {wait_s:g}s (EMBEDFLEET_TENANT_BACKLOG_WAIT_S)"


class BacklogWaits:
    """The backlog of a producer's lane, and the waits for room before a batch is sent."""

    def __init__(self, lane: ProducerLane) -> None:
        self.lane = lane

    async def backlog(self) -> int:
        """The bulk backlog as the high-water mark (EMBEDFLEET_BACKLOG_HIGH_WATER) reads it:
        the fullest partition's ingest streams, every tenant's (each partition is bounded on
        its own node)."""
        return await self.fullest(list(self.lane.keys.partitions_keys))

    async def partition_backlogs(
        self, partitions: Sequence[Keys] | None = None
    ) -> list[PartitionBacklog]:
        """Each partition's ingest streams' lengths, the total and every tenant's
        (shared/backlog.py): one script call per partition, pipelined."""
        lane = self.lane
        chosen = list(lane.keys.partitions_keys if partitions is None else partitions)

        async def lengths() -> list[Any]:
            pipe = lane.client.pipeline(transaction=False)
            for partition in chosen:
                pipe.execute_command(*backlog_command(partition))
            return await pipe.execute()

        replies = await lane.retry.call("read the backlog", lengths)
        return [PartitionBacklog.parse(reply) for reply in replies]

    async def tenant_backlog(self, tenant: str | None = None) -> int:
        """A tenant's entries waiting or in flight over all partitions (its name, or None for
        the producer's own tenant, else the default)."""
        tenants = self.lane.tenants
        name = tenants.resolve(tenant if tenant is not None else self.lane.tenant)
        return tenant_backlog(await self.partition_backlogs(), tenants.wire(name))

    def room(self, name: str, backlogs: Sequence[PartitionBacklog]) -> TenantRoom:
        """Tenant ``name``'s room over all partitions, from ``backlogs`` (every partition's)."""
        tenants = self.lane.tenants
        limit = tenants.backlog_limit(name)
        return TenantRoom(tenant_backlog(backlogs, tenants.wire(name)), limit)

    async def room_for(
        self, tenant: str | None = None, backlogs: Sequence[PartitionBacklog] | None = None
    ) -> TenantRoom:
        """A tenant's room (its name, or None for the producer's own tenant, else the default),
        from ``backlogs`` where the caller read them; read here otherwise, unless the tenant
        has no limit (then nothing is read: ``held`` 0)."""
        tenants = self.lane.tenants
        name = tenants.resolve(tenant if tenant is not None else self.lane.tenant)
        if backlogs is None:
            if tenants.backlog_limit(name) is None:
                return TenantRoom(0, None)
            backlogs = await self.partition_backlogs()
        return self.room(name, backlogs)

    async def fullest(self, partitions: list[Keys]) -> int:
        """The fullest of these partitions (all its tenants' streams together)."""
        return max(b.total for b in await self.partition_backlogs(partitions))

    async def wait_for_room(self, partitions: Iterable[Keys], tenants: set[str | None]) -> None:
        """Backpressure: hold enqueueing while a partition this batch goes to holds more than
        the high-water mark (each partition's streams, every tenant's, are bounded on its own
        node). A tenant of the batch (``tenants``) at its EMBEDFLEET_TENANT_MAX_BACKLOG is
        waited for before, for as long as the call waits (``wait_for_tenants``)."""
        mark = self.lane.settings.backlog_high_water
        chosen = list(partitions)
        waited_since: float | None = None
        while (backlog := await self.fullest(chosen)) >= mark:
            if waited_since is None:
                waited_since = time.monotonic()
                log.warning(
                    "backlog over the high-water mark: waiting for workers",
                    backlog=backlog,
                    high_water=mark,
                    setting="EMBEDFLEET_BACKLOG_HIGH_WATER",
                )
            await asyncio.sleep(RECHECK_S)
        if waited_since is not None:
            log.info(
                "backlog below the mark again", waited_s=round(time.monotonic() - waited_since, 1)
            )

    async def wait_for_tenants(self, tenants: set[str | None], wait_s: float) -> None:
        """Wait while a tenant with EMBEDFLEET_TENANT_MAX_BACKLOG is at it, for at most
        ``wait_s`` (the call's, else EMBEDFLEET_TENANT_BACKLOG_WAIT_S); then
        TenantBacklogFullError."""
        policy = self.lane.tenants
        limited = [
            name for name in map(policy.named, tenants) if policy.backlog_limit(name) is not None
        ]
        if not limited:
            return
        give_up_at = time.monotonic() + wait_s
        warned = False
        while True:
            backlogs = await self.partition_backlogs()
            full = {name: room for name in limited if (room := self.room(name, backlogs)).full}
            if not full:
                return
            if time.monotonic() >= give_up_at:
                raise TenantBacklogFullError(
                    "tenant backlog full: "
                    + ", ".join(f"{t} holds {r.held} of {r.limit}" for t, r in full.items())
                    + " entries (EMBEDFLEET_TENANT_MAX_BACKLOG) "
                    + _waited(wait_s)
                )
            if not warned:
                warned = True
                log.warning(
                    "tenant backlog at its limit: waiting for workers",
                    tenants=sorted(full),
                    setting="EMBEDFLEET_TENANT_MAX_BACKLOG",
                )
            await asyncio.sleep(RECHECK_S)

    def share(self, partition: Keys, tenant: str | None) -> int | None:
        """What ``tenant``'s stream (on the wire: None the default) may hold in ``partition``
        (shared/tenants.py); None: no limit."""
        return self.lane.tenants.backlog_share(
            self.lane.tenants.named(tenant), max(partition.index, 0), self.lane.keys.partitions
        )

    async def wait_for_share(
        self, waiting: dict[Keys, list[Chunk]], give_up_at: float, wait_s: float
    ) -> None:
        """Until a stream the ``waiting`` chunks go to has room under its tenant's share (the
        script then decides, entry by entry); past ``give_up_at`` (``wait_s`` after the last
        entry added), TenantBacklogFullError."""
        wanted = {(p, c.tenant) for p, chunks in waiting.items() for c in chunks}
        chosen = list(waiting)
        warned = False
        while True:
            backlogs = dict(zip(chosen, await self.partition_backlogs(chosen), strict=True))
            full: list[str] = []
            for partition, tenant in sorted(wanted, key=lambda w: (w[0].index, w[1] or "")):
                share = self.share(partition, tenant)
                held = backlogs[partition].tenants.get(tenant, 0)
                if share is None or held < share:
                    return
                full.append(self._said_full(partition, tenant, held, share))
            if time.monotonic() >= give_up_at:
                raise TenantBacklogFullError(
                    "tenant backlog full: "
                    + ", ".join(full)
                    + " (EMBEDFLEET_TENANT_MAX_BACKLOG) "
                    + _waited(wait_s)
                )
            if not warned:
                warned = True
                log.warning(
                    "tenant backlog at its limit: waiting for room",
                    full=full,
                    setting="EMBEDFLEET_TENANT_MAX_BACKLOG",
                )
            await asyncio.sleep(RECHECK_S)

    def _said_full(self, partition: Keys, tenant: str | None, held: int, share: int) -> str:
        name = self.lane.tenants.named(tenant)
        keys = self.lane.keys
        if not keys.partitioned:
            return f"{name} holds {held} of {share} entries"
        limit = self.lane.tenants.backlog_limit(name)
        return (
            f"{name} holds {held} of its {share} in partition {partition.index} (its limit "
            f"{limit} split over {keys.partitions} partitions)"
        )
