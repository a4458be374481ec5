"""Tenant settings: fair share, limits and accounting (shared/tenants.py, docs/FAIRNESS.md)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, ValidationInfo, field_validator

from embedfleet.shared.settings.section import Section
from embedfleet.shared.tenants import TenantPolicy, check_tenant, parse_map, parse_numbers


class TenantSettings(Section):
    """Which tenant work belongs to, each tenant's share, and its limits, as text; parsed
    (checked at load) into ``tenant_policy``."""

    title: ClassVar[str] = "Tenants: fair share and limits"

    default_tenant: str = "default"
    """The tenant of work that names none (no `tenant` field, no `EMBEDFLEET_TENANT_MAP` rule
    matches): its chunks go to the plain ingest stream `{ns}:ingest`."""
    tenant_map: str = ""
    """Which tenant a job or an API key belongs to: `<job glob>=<tenant>` and
    `owner:<owner>=<tenant>` rules, comma-separated, the first match wins, e.g.
    `docs-*=search,owner:3f2a9c01d4e5b6a7=rag` (an owner is the hash `embedfleet serve` logs for
    an API key). A tenant named by the producer (`--tenant`) wins over the rules."""
    tenant_weights: str = ""
    """Each tenant's share of the fleet: `search=3,batch=1` (others 1). Workers read every
    tenant with a backlog in proportion to its weight, whatever the others hold."""
    tenant_max_backlog: str = ""
    """Entries a tenant may have waiting over all partitions: `batch=100000` (each partition at
    most its share), checked entry by entry where they are added. Past it its producers wait for
    room (up to `EMBEDFLEET_TENANT_BACKLOG_WAIT_S`, then `TenantBacklogFullError`) and the
    gateway answers 429. Unnamed tenants: no limit (but `EMBEDFLEET_BACKLOG_HIGH_WATER`)."""
    tenant_backlog_wait_s: float = Field(default=300.0, ge=0)
    """How long a producer waits for room under its tenant's `EMBEDFLEET_TENANT_MAX_BACKLOG`
    (again after each entry added) before it raises `TenantBacklogFullError`."""
    tenant_token_rate: str = ""
    """Tokens per second the workers read for a tenant at most, over the whole lane and the
    whole fleet: `batch=50000` (a token bucket in `{ns}:tenantrate:<tenant>` holding 4 s of the
    rate, which every worker reserves its reads from; a tenant alone included, however many
    workers read it). Unnamed tenants: no limit."""

    @field_validator("default_tenant")
    @classmethod
    def _tenant_name(cls, value: str) -> str:
        return check_tenant(value, "the default tenant")

    @field_validator("tenant_weights", "tenant_max_backlog", "tenant_token_rate")
    @classmethod
    def _tenant_numbers(cls, value: str, info: ValidationInfo) -> str:
        parse_numbers(value, str(info.field_name))
        return value

    @field_validator("tenant_map")
    @classmethod
    def _tenant_rules(cls, value: str) -> str:
        parse_map(value, "tenant_map")
        return value

    @property
    def tenant_policy(self) -> TenantPolicy:
        """The tenant settings parsed (shared/tenants.py); parsed on each call (a settings
        copy with other values must not keep these), so callers keep what they need."""
        return TenantPolicy(
            default=self.default_tenant,
            rules=parse_map(self.tenant_map, "tenant_map"),
            weights=parse_numbers(self.tenant_weights, "tenant_weights"),
            max_backlog={
                name: int(limit)
                for name, limit in parse_numbers(
                    self.tenant_max_backlog, "tenant_max_backlog"
                ).items()
            },
            token_rate=parse_numbers(self.tenant_token_rate, "tenant_token_rate"),
        )
