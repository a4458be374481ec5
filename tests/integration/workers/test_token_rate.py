"""EMBEDFLEET_TENANT_TOKEN_RATE's token bucket (shared/scripts/token_rate.lua through
workers/token_rate.py) against a real Redis: several workers' ``TenantRates`` share one bucket
per tenant, so what they are granted together is the rate, not the rate per worker (issue 54,
fault 3). The fleet-wide rate measured with worker processes: tests/integration/producer/
test_tenant_pace.py."""

from __future__ import annotations

import redis.asyncio as aioredis

from embedfleet.shared.settings import Settings
from embedfleet.shared.tenants import TenantPolicy
from embedfleet.workers.token_rate import RATE_BURST_S, RATE_START_S, TenantRates

RATE = 100.0  # tokens per second
CAPACITY = RATE * RATE_BURST_S  # 400 tokens
START = RATE * RATE_START_S  # what a new bucket holds: 100 tokens


def worker(settings: Settings) -> TenantRates:
    """One worker's side of the buckets: tenant ``a`` rated, ``b`` not."""
    return TenantRates(TenantPolicy(token_rate={"a": RATE}), settings.keys)


async def take(client: aioredis.Redis, rates: TenantRates, count: int = 1_000) -> int:
    """One round's take (what a read's first round trip sends): the entries granted ``a``."""
    pipe = client.pipeline(transaction=False)
    rates.queue_takes(pipe, count)
    return rates.grants(await pipe.execute())["a"]


async def give_back(client: aioredis.Redis, rates: TenantRates, asked: int) -> None:
    pipe = client.pipeline(transaction=False)
    rates.queue_returns(pipe, {"a": asked})
    if len(pipe):
        await pipe.execute()


def learn(rates: TenantRates, tokens_per_entry: int, entries: int = 1) -> None:
    """The worker tokenized ``entries`` of a's, each of ``tokens_per_entry`` tokens."""
    for _ in range(entries):
        rates.charge("a", tokens_per_entry)


async def test_workers_share_one_bucket_per_tenant(
    settings: Settings, client: aioredis.Redis
) -> None:
    """Two workers each read one entry of a's (its cost unknown yet), which cost 10 tokens:
    the first is granted what the new bucket holds after that (9 entries), the second nothing,
    held until the bucket refills; before, each worker read what per-second counters left, so
    N workers read N times the rate."""
    first, second = worker(settings), worker(settings)
    for rates in (first, second):
        assert await take(client, rates) == 1, "one entry before its cost is known"
        learn(rates, 10)  # ...which cost 10 tokens, settled with the next take
    assert await take(client, first) == 9  # (100 - 10) // 10
    assert await take(client, second) == 0  # its own entry's 10 tokens: a debt of 10
    assert second.held({"a": 0}) == {"a"}
    # held until the bucket holds a quarter second of the rate (25 tokens): ~0.35 s
    assert 0.3 <= second.wait_s(frozenset({"a"})) <= 0.36
    assert await client.ttl(settings.keys.tenant_rate("a")) > 0, "kept until full again"


async def test_a_read_that_cost_more_than_reserved_leaves_a_debt(
    settings: Settings, client: aioredis.Redis
) -> None:
    """Reserved at 10 tokens an entry, a's 9 entries cost 20 each: the 90 tokens beyond are a
    debt the rate repays before any worker reads a again (with a quarter second's read: 1.15 s
    at 100/s)."""
    first, second = worker(settings), worker(settings)
    learn(first, 10)
    assert await take(client, first) == 9
    learn(first, 20, entries=9)  # its per-entry estimate is now 190 / 10
    assert await take(client, first) == 0
    assert await take(client, second) == 0
    wait = first.wait_s(frozenset({"a"}))
    assert 1.1 <= wait <= 1.2, f"the debt of 90 tokens and 25 at 100/s, not {wait:.2f} s"


async def test_entries_granted_and_not_asked_for_go_back_to_the_others(
    settings: Settings, client: aioredis.Redis
) -> None:
    """The fair share asked a for 3 of the 9 entries granted: the other 6 go back with the
    read's round trip, and another worker is granted them at once (less its own entry's 10
    tokens, settled with its take)."""
    first, second = worker(settings), worker(settings)
    learn(first, 10)
    learn(second, 10)
    assert await take(client, first) == 9
    await give_back(client, first, asked=3)
    assert await take(client, second) == 5
    # what was read settles with the next take: the 3 entries cost what was reserved
    learn(first, 10, entries=3)
    assert await take(client, first) == 0


async def test_an_entry_over_the_whole_bucket_is_read_once_it_is_full(
    settings: Settings, client: aioredis.Redis
) -> None:
    """a's entries cost 1,000 tokens, more than the bucket's 400: the first read (its cost
    unknown) leaves a debt of 900, which holds a until the bucket is full (13 s at 100/s); then
    one entry is granted (the tenant progresses), never two."""
    rates = worker(settings)
    assert await take(client, rates) == 1
    learn(rates, 1_000)
    assert await take(client, rates) == 0
    assert 12.9 <= rates.wait_s(frozenset({"a"})) <= 13.1
    seconds, microseconds = await client.time()  # as 13 s later: the bucket full
    now_us = seconds * 1_000_000 + microseconds
    await client.hset(settings.keys.tenant_rate("a"), mapping={"tokens": CAPACITY, "at_us": now_us})
    assert await take(client, rates) == 1
    learn(rates, 1_000)  # read: its tokens settled with the next take
    assert await take(client, rates) == 0


async def test_entries_that_cost_nothing_are_granted_a_whole_read(
    settings: Settings, client: aioredis.Redis
) -> None:
    """Vector cache hits cost no model tokens: a's read is bounded by its share, not its rate;
    a tenant without a rate is never counted."""
    rates = worker(settings)
    learn(rates, 0, entries=5)
    assert await take(client, rates, count=700) == 700
    rates.charge("b", 10**6)
    assert rates.per_entry("b") is None


async def test_the_script_takes_fractional_tokens(
    settings: Settings, client: aioredis.Redis
) -> None:
    """Tokens per entry and what is given back are fractions (averages): the script reads them
    as Python writes floats. a's entries cost 3.5 tokens."""
    rates = worker(settings)
    learn(rates, 3)
    learn(rates, 4)
    assert await take(client, rates) == 26  # (100 - 7) // 3.5, 2 tokens left
    await give_back(client, rates, asked=24)  # 2 entries of 3.5 back: 9 left
    for _ in range(12):  # the 24 read, at 3.5 tokens each: what was reserved
        learn(rates, 3)
        learn(rates, 4)
    assert await take(client, rates) == 2
