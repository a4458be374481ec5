"""workers/token_rate.py, the worker's side without Redis: a window's entries charged to their
tenants (the cache's hits at no tokens), nothing when no tenant is rated, and the idle wait
bounded by a held tenant's refill (the bucket against a real Redis:
tests/integration/workers/test_token_rate.py)."""

from __future__ import annotations

import pytest

from embedfleet.shared.keys import Keys
from embedfleet.shared.tenants import TenantPolicy
from embedfleet.sinks import Delivery
from embedfleet.workers.token_rate import TenantRates

KEYS = Keys()


def entry(tenant: str | None, stream: str = KEYS.ingest) -> Delivery:
    return Delivery(stream, "1-0", None, tenant=tenant)


def test_a_windows_entries_are_charged_to_their_tenants_and_cache_hits_cost_none() -> None:
    rates = TenantRates(TenantPolicy(token_rate={"a": 100.0}), KEYS)
    embedded = [entry("a"), entry("a"), entry("b"), entry(None, KEYS.ingest_for("a"))]
    rates.charge_window(embedded, [10, 30, 500, 20], [entry("a")])
    # a's three embedded entries (the last by its stream) and its hit: 60 tokens over four
    # entries; b has no rate
    assert rates.per_entry("a") == pytest.approx(60 / 4)
    assert rates.per_entry("b") is None


def test_no_rated_tenant_charges_nothing_and_reads_no_lengths() -> None:
    rates = TenantRates(TenantPolicy(), KEYS)

    def lengths():  # the window's token counts: not even read
        raise AssertionError("read")
        yield 0

    rates.charge_window([entry("a")], lengths(), [])
    assert rates.per_entry("a") is None


def test_the_idle_wait_ends_when_a_held_tenants_bucket_refills_for_a_read() -> None:
    rates = TenantRates(TenantPolicy(token_rate={"a": 100.0}), KEYS)
    assert rates.idle_wait(2000) == (2000, 2000 / 1000 + 5)  # none held: the block and a margin
    # the bucket's reply (the script's {entries, reserved, left}): no entry, 10 tokens in
    # debt; a read wants a quarter second of a's rate (25 tokens)
    assert rates.grants([(0, b"0", b"-10")]) == {"a": 0}
    assert rates.holding == {"a"}
    assert rates.idle_wait(2000) == (350, 0.35)
    assert rates.idle_wait(100) == (100, 0.1)  # never longer than asked
