"""Tenants: who a chunk is embedded for, what share of the fleet it gets, what it may hold.

One owner for the tenant policy the producer, the gateway, the workers and ``status`` share,
built from the settings (``Settings.tenant_policy``):

- ``EMBEDFLEET_TENANT_MAP``: which tenant a job or an API key's owner belongs to, as
  ``<job glob>=<tenant>`` and ``owner:<owner>=<tenant>`` rules, the first that matches wins
  (``docs-*=search,backfill-*=batch,owner:3f2a9c01=rag``); an explicit tenant wins over them;
  work that none names is the default tenant's (``EMBEDFLEET_DEFAULT_TENANT``);
- ``EMBEDFLEET_TENANT_WEIGHTS``: each tenant's weight (``search=3,batch=1``; others 1), what the
  workers' weighted round robin reads by (workers/fair.py);
- ``EMBEDFLEET_TENANT_MAX_BACKLOG``: entries a tenant may have waiting (over all partitions)
  before its producers wait and the gateway answers 429;
- ``EMBEDFLEET_TENANT_TOKEN_RATE``: tokens per second the workers read for a tenant at most,
  over the whole lane.

On the wire the default tenant is the absence of the ``tenant`` field: its chunks go to the plain
ingest stream, as any producer that knows nothing of tenants writes them.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field

from embedfleet.shared.keys import TENANT_PATTERN

OWNER_RULE = "owner:"


class TenantSettingError(ValueError):
    """A tenant setting that does not parse; the message says which part and why."""


def check_tenant(name: str, where: str) -> str:
    if not TENANT_PATTERN.fullmatch(name):
        raise TenantSettingError(
            f"{where}: {name!r} is not a tenant name (letters, digits, '.', '_', '-', starting "
            "with a letter or digit, at most 64)"
        )
    return name


def _pairs(value: str, where: str) -> list[tuple[str, str]]:
    pairs = []
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, equals, setting = item.partition("=")
        if not equals or not name.strip() or not setting.strip():
            raise TenantSettingError(f"{where}: {item!r} is not <name>=<value>")
        pairs.append((name.strip(), setting.strip()))
    return pairs


def parse_numbers(value: str, where: str, *, positive: bool = True) -> dict[str, float]:
    """``a=3,b=1.5`` → {"a": 3.0, "b": 1.5}: every name a tenant, every value a number > 0."""
    numbers: dict[str, float] = {}
    for name, number in _pairs(value, where):
        check_tenant(name, where)
        try:
            parsed = float(number)
        except ValueError:
            raise TenantSettingError(f"{where}: {number!r} (for {name}) is not a number") from None
        if positive and not parsed > 0:
            raise TenantSettingError(f"{where}: {name}'s value must be above 0, got {number}")
        numbers[name] = parsed
    return numbers


def parse_map(value: str, where: str) -> tuple[tuple[str, str], ...]:
    """``docs-*=search,owner:3f2a=rag`` → the rules in order (pattern, tenant)."""
    return tuple((pattern, check_tenant(tenant, where)) for pattern, tenant in _pairs(value, where))


@dataclass(frozen=True)
class TenantPolicy:
    default: str = "default"
    rules: tuple[tuple[str, str], ...] = ()
    weights: Mapping[str, float] = field(default_factory=dict)
    max_backlog: Mapping[str, int] = field(default_factory=dict)
    token_rate: Mapping[str, float] = field(default_factory=dict)

    def resolve(
        self, tenant: str | None = None, *, job: str | None = None, owner: str | None = None
    ) -> str:
        """The tenant's name: ``tenant`` when given, else the first rule that matches the
        owner (``owner:<owner>``) or the job (a glob), else the default tenant."""
        if tenant is not None:
            return check_tenant(tenant, "tenant")
        for pattern, name in self.rules:
            if pattern.startswith(OWNER_RULE):
                if owner is not None and pattern[len(OWNER_RULE) :] == owner:
                    return name
            elif job is not None and fnmatch.fnmatchcase(job, pattern):
                return name
        return self.default

    def wire(self, name: str) -> str | None:
        """What a chunk carries in its ``tenant`` field: None for the default tenant."""
        return None if name == self.default else name

    def named(self, wire: str | None) -> str:
        """The tenant's name from a chunk's field or a stream's tenant (None: the default)."""
        return wire or self.default

    def weight(self, name: str) -> float:
        return self.weights.get(name, 1.0)

    def backlog_limit(self, name: str) -> int | None:
        return self.max_backlog.get(name)

    def backlog_share(self, name: str, index: int, partitions: int) -> int | None:
        """What the tenant's stream in partition ``index`` of ``partitions`` may hold: its
        EMBEDFLEET_TENANT_MAX_BACKLOG split over the partitions (the remainder to the first),
        at least 1; None without a limit. The enqueue script holds each partition to its share
        where it adds entries: on a cluster no script sees every partition (each its own
        slot), and shares that sum to the limit hold it over all of them, under concurrency."""
        limit = self.backlog_limit(name)
        if limit is None:
            return None
        share = limit // partitions + (1 if index < limit % partitions else 0)
        return max(share, 1)

    def rate(self, name: str) -> float | None:
        return self.token_rate.get(name)
