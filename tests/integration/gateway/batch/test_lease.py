"""The Batch API's leases (embedfleet/gateway/batch/lease.py) on a real Redis server: one
replica's step holds a batch at a time, and a step whose lease became another's writes
nothing."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from embedfleet.gateway.batch.lease import BatchLeases, LeaseLost
from embedfleet.shared.settings import Settings

LEASE_MS = 60_000  # longer than the test: no renewal runs meanwhile


async def test_one_replica_holds_a_batch_at_a_time(
    settings: Settings, client: aioredis.Redis
) -> None:
    first, second = (BatchLeases(client, settings.keys, LEASE_MS) for _ in range(2))
    async with first.held("b1") as held:
        assert held
        async with second.held("b1") as other:
            assert not other  # another replica's step waits its turn
        await first.save("b1", {"status": "in_progress"})
        await first.check("b1")
    assert await client.hget(settings.keys.batch("b1"), "status") == b"in_progress"
    async with second.held("b1") as held:
        assert held  # released on the first one's exit
    with pytest.raises(LeaseLost):
        second.lease("b1")  # no step of it runs now


async def test_a_lost_lease_writes_nothing(settings: Settings, client: aioredis.Redis) -> None:
    leases = BatchLeases(client, settings.keys, LEASE_MS)
    async with leases.held("b2") as held:
        assert held
        # the lease expired and another replica took it
        await client.set(settings.keys.batch_lease("b2"), "another:token")
        with pytest.raises(LeaseLost):
            await leases.save("b2", {"status": "completed"})
        with pytest.raises(LeaseLost):
            await leases.check("b2")
    assert await client.hget(settings.keys.batch("b2"), "status") is None
    assert await client.get(settings.keys.batch_lease("b2")) == b"another:token"
