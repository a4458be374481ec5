"""EMBEDFLEET_TENANT_TOKEN_RATE held over the whole fleet: each rated tenant's token bucket in
Redis (shared/scripts/token_rate.lua, ``Keys.tenant_rate``), which every worker reserves its
reads from.

The unit a read knows is entries, the unit of the rate tokens: a worker asks the bucket for
entries at the tokens per entry it has seen of the tenant (one entry before it has seen any),
and settles with its next call what those entries cost once tokenized (``charge``), less what
it reserved. The bucket may go into debt (an estimate short, an entry longer than the rest), and
the rate repays it before the tenant is read again, so the fleet holds the rate however many
workers read the tenant. Before (issue 54, fault 3) each worker read what per-second counters
had left and counted what it read afterwards: N workers read up to N times the rate.

The calls ride the round trips a read makes anyway: the take in the one that measures the
backlogs, the give-back of entries granted but not asked for (the fair share gave the tenant
fewer) in the one that reads. No round trip of its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, cast

from redis.asyncio.client import Pipeline

from embedfleet.shared import scripts
from embedfleet.shared.keys import Keys
from embedfleet.shared.tenants import TenantPolicy

TOKEN_RATE_SCRIPT = scripts.load("token_rate")  # shared/scripts/token_rate.lua
# The bucket holds this many seconds of the rate: a worker alone whose windows take up to this
# long still reads the tenant at its rate (what accrued while it computed).
RATE_BURST_S = 4.0
# A tenant new to the bucket, or idle a while (its bucket expired), starts with this many
# seconds of its rate: a short burst, not the whole bucket.
RATE_START_S = 1.0
# A tenant held (its bucket spent) is read again once its bucket holds this long of its rate,
# or one entry if that costs more: reads of several entries rather than a round trip for each
# entry the rate lets through.
RATE_READ_S = 0.25


class EntryOfTenant(Protocol):
    """An entry read, as far as its tenant goes (a sink's ``Delivery``)."""

    @property
    def stream(self) -> str: ...

    @property
    def tenant(self) -> str | None: ...


@dataclass(frozen=True)
class Grant:
    """The bucket's answer to one take: the entries a read may ask for, the tokens reserved for
    them, and the tokens left after (negative: a debt)."""

    entries: int
    reserved: float
    left: float
    per_entry: float


class TenantRates:
    """One worker's side of the rated tenants' buckets."""

    def __init__(self, policy: TenantPolicy, keys: Keys) -> None:
        self.policy = policy
        self.keys = keys
        self.rated = list(policy.token_rate)
        # tokens of the entries read per rated tenant since the latest take (``charge``)
        self._charges: dict[str, int] = {}
        # tokens and entries charged per rated tenant so far: its tokens per entry
        self._charged: dict[str, tuple[int, int]] = {}
        # tokens reserved per tenant by the latest take, less what was given back since
        self._reserved: dict[str, float] = {}
        # the latest take's grants, less what was given back since
        self._grants: dict[str, Grant] = {}
        # the rated tenants the latest take left out (their buckets spent): the reader's idle
        # wait names none of their streams and ends when the first has refilled for a read
        self.holding: frozenset[str] = frozenset()

    def charge(self, tenant: str, tokens: int) -> None:
        """Tokens of an entry read for ``tenant``, settled with the next take (0: an entry that
        costs none, the vector cache's hit: it lowers the tenant's tokens per entry, so a read
        of such entries is not held to one entry a round). A tenant without a rate: nothing."""
        if self.policy.rate(tenant) is None:
            return
        if tokens > 0:
            self._charges[tenant] = self._charges.get(tenant, 0) + tokens
        total, entries = self._charged.get(tenant, (0, 0))
        self._charged[tenant] = (total + max(tokens, 0), entries + 1)

    def tenant_of_entry(self, entry: EntryOfTenant) -> str:
        """The tenant an entry read is counted for: its chunk's, else its stream's."""
        return self.policy.named(entry.tenant or self.keys.tenant_of(entry.stream))

    def charge_window(
        self,
        embedded: Sequence[EntryOfTenant],
        lengths: Iterable[int],
        free: Iterable[EntryOfTenant],
    ) -> None:
        """A window read: the entries it embeds with their ``lengths`` in tokens, and those it
        answers ``free`` (the vector cache's hits: read, but no model tokens). Nothing when no
        tenant has a rate (the reader's usual case: no call per entry then)."""
        if not self.rated:
            return
        for entry, tokens in zip(embedded, lengths, strict=True):
            self.charge(self.tenant_of_entry(entry), tokens)
        for entry in free:
            self.charge(self.tenant_of_entry(entry), 0)

    def per_entry(self, tenant: str) -> float | None:
        """The tokens an entry of ``tenant`` has cost so far on average; None before any."""
        total, entries = self._charged.get(tenant, (0, 0))
        return total / entries if entries else None

    def queue_takes(self, pipe: Pipeline, count: int) -> None:
        """Ask each rated tenant's bucket for up to ``count`` entries, settling what the
        entries read since the latest take cost (``grants`` reads the replies)."""
        for tenant in self.rated:
            per_entry = self.per_entry(tenant)
            settle = self._charges.get(tenant, 0) - self._reserved.get(tenant, 0.0)
            wanted = 1 if per_entry is None else count  # one entry until its cost is known
            self._queue(pipe, tenant, settle, per_entry or 0.0, wanted)

    def grants(self, replies: Sequence[object]) -> dict[str, int]:
        """The takes' replies (in ``queue_takes``' order) → the entries each rated tenant may
        be asked for; what they settled is forgotten, what they reserved is held."""
        for tenant, reply in zip(self.rated, replies, strict=True):
            # the script's {entries, reserved, left}: an integer and two numbers as text
            granted, reserved, left = cast("tuple[int, bytes, bytes]", reply)
            grant = Grant(int(granted), float(reserved), float(left), self.per_entry(tenant) or 0.0)
            self._grants[tenant] = grant
            self._charges.pop(tenant, None)
            self._reserved[tenant] = grant.reserved
        caps = {tenant: self._grants[tenant].entries for tenant in self.rated}
        self.holding = self.held(caps)
        return caps

    def queue_returns(self, pipe: Pipeline, asked: Mapping[str, int]) -> None:
        """Give back the entries granted that the read does not ask for (the fair share gave
        the tenant fewer, or its backlog is shorter): the fleet's other readers may have them
        now, not after this worker's next read."""
        for tenant, grant in list(self._grants.items()):
            unused = grant.entries - asked.get(tenant, 0)
            if unused <= 0 or not grant.per_entry:
                continue
            returned = unused * grant.per_entry
            self._reserved[tenant] -= returned
            self._grants[tenant] = replace(
                grant,
                entries=grant.entries - unused,
                reserved=grant.reserved - returned,
                left=grant.left + returned,
            )
            self._queue(pipe, tenant, -returned, grant.per_entry, 0)

    def held(self, grants: Mapping[str, int]) -> frozenset[str]:
        """The rated tenants granted no entry: left out of this round and of the idle wait."""
        return frozenset(tenant for tenant, entries in grants.items() if entries <= 0)

    def wait_s(self, held: frozenset[str]) -> float:
        """How long until the first ``held`` tenant's bucket holds RATE_READ_S of its rate (or
        one entry, at most the whole bucket), at the latest take's balance."""
        waits = []
        for tenant in held:
            rate = self.policy.rate(tenant) or 0.0
            grant = self._grants.get(tenant)
            if grant is None or rate <= 0:
                continue
            wanted = min(max(grant.per_entry, rate * RATE_READ_S), rate * RATE_BURST_S)
            waits.append(max(0.0, (wanted - grant.left) / rate))
        return min(waits, default=0.0)

    def idle_wait(self, block_ms: int) -> tuple[int, float]:
        """How long the reader's idle wait may block (ms) and wait (s), given ``block_ms``: a
        tenant held to its token rate is read again once its bucket has refilled for a read, so
        the wait ends by then, whatever the reads still waiting from an earlier wait block for.
        Else the reads end by themselves after ``block_ms``, and the margin covers the round
        trip."""
        if not self.holding:
            return block_ms, block_ms / 1000 + 5
        block_ms = min(block_ms, max(1, math.ceil(self.wait_s(self.holding) * 1000)))
        return block_ms, block_ms / 1000

    def _queue(
        self, pipe: Pipeline, tenant: str, settle: float, per_entry: float, wanted: int
    ) -> None:
        rate = self.policy.rate(tenant) or 0.0
        pipe.eval(
            TOKEN_RATE_SCRIPT,
            1,
            self.keys.tenant_rate(tenant),
            repr(rate),
            repr(rate * RATE_BURST_S),
            repr(rate * RATE_START_S),
            repr(settle),
            repr(per_entry),
            wanted,
        )
