"""Fair share between tenants: how many entries a read takes from each tenant's streams.

Weighted deficit round robin (Shreedhar and Varghese), one round per read. Each round every
active tenant (one with a backlog, not held back by its token rate) earns a quantum of
``count * weight / sum of the active weights`` entries of credit, and is asked for the whole
entries its credit covers; what it is given is taken off its credit, so fractions carry over and
over many rounds each tenant gets exactly its weight's share, however small (no tenant is ever
starved: a weight of 0.01 still earns one entry every few rounds). A tenant that runs out of
entries loses its credit (an idle tenant does not save up a burst), and what it could not use
is handed, free, to the others that still have entries, by weight: the read stays full
(work-conserving) while a light tenant gets everything it has.

Entries, not tokens, are the unit: what a read takes is known by count only. Chunks of one
corpus are much alike in length; a tenant whose texts are ten times longer gets ten times the
tokens per entry (its accounting says so).

Within a tenant, its take is split over the partitions this worker reads in proportion to the
tenant's backlog in each (at least one each: ``backlog_shares``), so a tenant's partitions drain
together and a small one is never starved by a big one.

Every worker runs its own scheduler; since every worker's reads are in proportion, so is the
fleet's. Pure logic, no Redis: workers/consumer.py feeds it the backlogs it measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


def backlog_shares(count: int, lengths: Mapping[str, int]) -> dict[str, int]:
    """How many entries to ask each stream for: ``count`` split in proportion to the backlogs
    (at least one each, so a small partition is never starved by a big one)."""
    total = sum(lengths.values())
    return {
        stream: max(1, math.ceil(count * length / total))
        for stream, length in lengths.items()
        if length > 0
    }


@dataclass
class FairShare:
    """The deficit round robin's state: each tenant's credit, in entries."""

    weight: Callable[[str], float]
    credit: dict[str, float] = field(default_factory=dict)
    # the part of each tenant's latest ask that was spare, given free (not charged)
    free: dict[str, int] = field(default_factory=dict)
    # the tenants whose latest ask was their whole backlog: once read, they have run out
    emptied: set[str] = field(default_factory=set)

    def plan(
        self, count: int, backlogs: Mapping[str, int], held: frozenset[str] = frozenset()
    ) -> dict[str, int]:
        """Entries to ask each tenant for in a read of about ``count``: tenant -> entries.
        ``backlogs``: each tenant's entries waiting; ``held``: tenants not to read this round
        (over their token rate)."""
        active = {t: n for t, n in backlogs.items() if n > 0 and t not in held}
        for tenant in [t for t in self.credit if t not in active]:
            del self.credit[tenant]  # an idle tenant saves up no burst
        if not active or count <= 0:
            return {}
        weights = {t: max(self.weight(t), 0.0) for t in active}
        total = sum(weights.values())
        if total <= 0:  # every active weight 0: share equally rather than read nothing
            weights = dict.fromkeys(active, 1.0)
            total = float(len(active))
        asks: dict[str, int] = {}
        for tenant in active:
            self.credit[tenant] = self.credit.get(tenant, 0.0) + count * weights[tenant] / total
            asks[tenant] = min(active[tenant], math.floor(self.credit[tenant]))
        # what light tenants could not use goes to those with entries left, by weight, free
        spare = sum(math.floor(self.credit[t]) - asks[t] for t in active)
        while spare > 0:
            hungry = {t: weights[t] for t in active if asks[t] < active[t] and weights[t] > 0}
            if not hungry:
                break
            hungry_total = sum(hungry.values())
            given = 0
            for tenant, weight in sorted(hungry.items(), key=lambda item: -item[1]):
                extra = min(
                    active[tenant] - asks[tenant],
                    max(1, math.floor(spare * weight / hungry_total)),
                    spare - given,
                )
                asks[tenant] += extra
                given += extra
                if given >= spare:
                    break
            spare -= given
            if given == 0:
                break
        self.free = {t: max(0, asks[t] - math.floor(self.credit[t])) for t in active}
        self.emptied = {t for t in active if asks[t] >= active[t]}
        return {t: n for t, n in asks.items() if n > 0}

    def settle(self, asked: Mapping[str, int], received: Mapping[str, int]) -> None:
        """Charge each tenant what a read gave it (the free part of its ask excepted); a
        tenant given less than it was asked for, or all it had, has run out: its credit goes."""
        for tenant, ask in asked.items():
            got = received.get(tenant, 0)
            if got < ask or tenant in self.emptied:
                self.credit.pop(tenant, None)
                continue
            charged = max(0, got - self.free.get(tenant, 0))
            if tenant in self.credit:
                self.credit[tenant] -= charged

    def split(
        self, asks: Mapping[str, int], backlogs: Mapping[str, Mapping[str, int]]
    ) -> dict[str, int]:
        """Each tenant's ask split over its streams (stream -> entries) by their backlogs."""
        shares: dict[str, int] = {}
        for tenant, ask in asks.items():
            shares.update(backlog_shares(ask, backlogs.get(tenant, {})))
        return shares
