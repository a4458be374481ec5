"""A tenant's backlog limit (EMBEDFLEET_TENANT_MAX_BACKLOG) held per entry, under concurrency
(issue 40, point 4), and `enqueue` counting what it added (issue 40, the "enqueued 4" point).

Against a real redis-server. The fleet is played by a drain that deletes entries as workers do
once they acknowledge them (XDEL), in one Lua call that also returns the stream's length just
before: a stream only shrinks at a drain, so the largest of those lengths (and the length at
the end) is the exact peak of the backlog, not a sample that could miss one. The drain runs
whenever a stream is at its limit (or the producers are done), so the producers do meet the
limit and have to wait for room.

Scaled as in the issue: limit 100, one `enqueue` of 1,000 chunks; 20 concurrent producers
(asyncio tasks, each with its own connection) of 50 chunks each.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from embedfleet.producer import Producer
from embedfleet.producer.client import TenantBacklogFullError
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.settings import Settings
from tests.conftest import cli_env, start_cli, until

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def quick_rechecks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-process producers look for room every 20 ms instead of every 0.5 s: what these
    tests assert is the limit, never the pace, and at 0.5 s the module waited 40 of its 47 s."""
    from embedfleet.producer import backlog_waits

    monkeypatch.setattr(backlog_waits, "RECHECK_S", 0.02)


LIMIT = 100
TENANT = "small"

# The drain: the stream's length, then the first ARGV[1] entries deleted, atomically.
DRAIN_SCRIPT = """
local held = redis.call('XLEN', KEYS[1])
local ids = {}
for _, entry in ipairs(redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', ARGV[1])) do
  ids[#ids + 1] = entry[1]
end
if #ids > 0 then redis.call('XDEL', KEYS[1], unpack(ids)) end
return {held, #ids}
"""


def chunks(prefix: str, count: int) -> list[Chunk]:
    return [Chunk(id=f"{prefix}{i}", text=f"a short text to embed {i}") for i in range(count)]


def limited(settings: Settings, wait_s: float = 120.0, **more: object) -> Settings:
    return settings.model_copy(
        update={
            "tenant_max_backlog": f"{TENANT}={LIMIT}",
            "tenant_backlog_wait_s": wait_s,
            **more,
        }
    )


class Drain:
    """Plays the fleet on the tenant's streams: whenever one holds ``at`` entries or more (or
    the producers are done), takes ``step`` entries off each; records each stream's peak."""

    def __init__(self, client: aioredis.Redis, streams: Sequence[str], at: int, step: int):
        self.client, self.streams, self.at, self.step = client, list(streams), at, step
        self.peaks = dict.fromkeys(self.streams, 0)
        self.drained = 0

    async def _take(self) -> int:
        taken = 0
        for stream in self.streams:
            held, deleted = await self.client.eval(DRAIN_SCRIPT, 1, stream, self.step)
            self.peaks[stream] = max(self.peaks[stream], int(held))
            taken += int(deleted)
        self.drained += taken
        return taken

    async def run(self, producing: asyncio.Future[Any]) -> None:
        async def full_or_done() -> bool:
            if producing.done():
                return True
            lengths = [await self.client.xlen(stream) for stream in self.streams]
            return max(lengths) >= self.at

        while not producing.done():
            await until(full_or_done, timeout=120)
            if not producing.done():
                await self._take()
        while await self._take():  # what is left once the producers are done
            pass

    @property
    def peak_total(self) -> int:
        """An upper bound of the tenant's backlog at any time (the sum of each stream's peak)."""
        return sum(self.peaks.values())


async def test_one_enqueue_of_1000_never_holds_more_than_the_limit(
    settings: Settings, client: aioredis.Redis
) -> None:
    """Before the fix the limit was checked once per batch: one `enqueue` of 1,000 added all
    1,000 at once (peak 1,000). Now the rest waits for room entry by entry, and is added as
    the fleet drains: all 1,000 added once, the backlog never over 100."""
    settings = limited(settings)
    stream = settings.keys.ingest_for(TENANT)
    drain = Drain(client, [stream], at=LIMIT, step=50)
    async with Producer(settings, tenant=TENANT) as producer:
        enqueue = asyncio.ensure_future(producer.enqueue(chunks("c", 1000), job="big"))
        await asyncio.gather(enqueue, drain.run(enqueue))
        added = enqueue.result()
        progress = await producer.progress("big")
    print(f"one enqueue of 1000 at limit {LIMIT}: peak backlog {drain.peak_total}")
    assert drain.peak_total <= LIMIT
    assert (int(added), added.present) == (1000, 0)
    assert drain.drained == 1000 and progress.enqueued == 1000, "every chunk added, once"


async def test_20_concurrent_producers_never_hold_more_than_the_limit(
    settings: Settings, client: aioredis.Redis
) -> None:
    """20 producers (tasks, a connection each) of 50 chunks: before the fix each checked the
    backlog, found room, then added its whole batch (the issue saw 200; here up to 1,000)."""
    settings = limited(settings)
    stream = settings.keys.ingest_for(TENANT)
    drain = Drain(client, [stream], at=LIMIT, step=50)

    async def produce(index: int) -> int:
        async with Producer(settings, tenant=TENANT) as producer:
            return int(await producer.enqueue(chunks(f"p{index}-", 50), job=f"job{index}"))

    producing = asyncio.ensure_future(asyncio.gather(*(produce(i) for i in range(20))))
    await asyncio.gather(producing, drain.run(producing))
    print(f"20 producers x 50 at limit {LIMIT}: peak backlog {drain.peak_total}")
    assert drain.peak_total <= LIMIT
    assert sum(producing.result()) == 1000 and drain.drained == 1000


async def test_partitions_hold_the_limit_over_all_of_them(
    settings: Settings, client: aioredis.Redis
) -> None:
    """With 4 partitions (4 slots on a cluster: no script sees them all) each holds its share
    of the limit, checked atomically where its entries are added, so the total never exceeds
    the limit either (20 producers of 50)."""
    peaks = await _partitioned_run(limited(settings, partitions=4), client)
    print(f"4 partitions, 20 producers x 50 at limit {LIMIT}: peaks {peaks}")


async def _partitioned_run(settings: Settings, client: aioredis.Redis) -> list[int]:
    """20 producers of 50 chunks, half of them in jobs, half without (the script holds the
    limit for both), against the drain; each partition's peak (their sum at most the limit)."""
    streams = [p.ingest_for(TENANT) for p in settings.keys.partitions_keys]
    drain = Drain(client, streams, at=LIMIT // settings.partitions, step=10)

    async def produce(index: int) -> int:
        job = f"job{index}" if index % 2 else None
        async with Producer(settings, tenant=TENANT) as producer:
            return int(await producer.enqueue(chunks(f"p{index}-", 50), job=job))

    producing = asyncio.ensure_future(asyncio.gather(*(produce(i) for i in range(20))))
    await asyncio.gather(producing, drain.run(producing))
    assert drain.peak_total <= LIMIT, list(drain.peaks.values())
    assert sum(producing.result()) == 1000 and drain.drained == 1000
    return list(drain.peaks.values())


@pytest.mark.cluster
async def test_on_a_cluster_the_partitions_hold_the_limit_over_all_of_them() -> None:
    """The same on a 3-master + 3-replica Redis Cluster, 6 partitions (6 slots, spread over the
    masters), every batch confirmed by a replica (EMBEDFLEET_MIN_REPLICAS=1): the script's keys
    stay in their partition's slot, and the shares hold the limit. No workers (the drain)."""
    from embedfleet.server import isolated_settings
    from embedfleet.shared.redis_conn import connect_settings
    from loadtest.local_cluster import LocalCluster

    with LocalCluster(masters=3, replicas_per_master=1) as cluster:
        settings = limited(isolated_settings(cluster.url, partitions=6, min_replicas=1))
        client = connect_settings(settings)
        try:
            peaks = await _partitioned_run(settings, client)
        finally:
            await client.aclose()
    print(f"cluster, 6 partitions, 20 producers x 50 at limit {LIMIT}: peaks {peaks}")


async def test_a_full_tenant_gives_up_naming_what_was_added(
    settings: Settings, client: aioredis.Redis
) -> None:
    """No fleet: the first 100 are added, the call waits EMBEDFLEET_TENANT_BACKLOG_WAIT_S for
    room for the 101st, then raises TenantBacklogFullError saying how many it added; the job
    counts exactly those (before the fix: 1,000 added, no error)."""
    settings = limited(settings, wait_s=1.0)
    stream = settings.keys.ingest_for(TENANT)
    async with Producer(settings, tenant=TENANT) as producer:
        with pytest.raises(TenantBacklogFullError) as raised:
            await producer.enqueue(chunks("c", 1000), job="big")
        progress = await producer.progress("big")
    held = await client.xlen(stream)
    print(f"one enqueue of 1000 at limit {LIMIT}, no fleet: {held} in the stream")
    assert held == LIMIT and progress.enqueued == LIMIT
    assert raised.value.added == LIMIT
    assert "added 100 of its chunks" in str(raised.value)
    assert "small holds 100 of 100" in str(raised.value)


# --- what `enqueue` says it added -----------------------------------------------------------


async def test_a_repeated_id_is_counted_as_present_not_added(
    settings: Settings, client: aioredis.Redis
) -> None:
    """The same id twice in one call (in one batch, and across two batches): one entry each,
    and the call says so (before: the repeat counted as added by this call, 4 for 3)."""
    async with Producer(settings) as producer:
        one_batch = await producer.enqueue(chunks("a", 3) + chunks("a", 1), job="j1")
        two_batches = await producer.enqueue(
            chunks("b", 3) + chunks("b", 1), job="j2", batch_size=2
        )
        progress = [await producer.progress(job) for job in ("j1", "j2")]
    assert await client.xlen(settings.keys.ingest) == 6
    assert [p.enqueued for p in progress] == [3, 3]
    assert (int(one_batch), one_batch.present) == (3, 1)
    assert (int(two_batches), two_batches.present) == (3, 1)


async def test_the_cli_prints_what_was_added(
    settings: Settings, client: aioredis.Redis, tmp_path: Path
) -> None:
    """`embedfleet enqueue` of 4 lines, one id twice with the same text: 3 entries; it printed
    "enqueued 4"."""
    lines = [{"id": f"d{i}", "text": f"text {i}"} for i in (0, 1, 2, 0)]
    source = tmp_path / "chunks.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    process = await start_cli(cli_env(settings), "enqueue", str(source), "--job", "dup")
    out, err = await process.communicate()
    print(out.decode().strip())
    assert process.returncode == 0, err.decode()
    assert await client.xlen(settings.keys.ingest) == 3
    assert "enqueued 3 of 4 chunks" in out.decode()
    assert "1 chunks were already in job 'dup'" in err.decode()

    process = await start_cli(cli_env(settings), "enqueue", str(source), "--job", "dup", "--json")
    out, _ = await process.communicate()
    report = json.loads(out.decode().strip().splitlines()[-1])
    assert (report["enqueued"], report["already_present"]) == (0, 4)


# --- the script's contract for other clients, and the shares ---------------------------------


async def test_the_script_still_takes_the_layout_without_a_limit(
    settings: Settings, client: aioredis.Redis
) -> None:
    """A client in another language that sends the ARGV of before the limit (no ARGV[4]) is
    served as before: every chunk added, no limit (docs/PROTOCOL.md)."""
    from embedfleet.producer.enqueue import ENQUEUE_SCRIPT, payload_digest

    keys = settings.keys
    args: list[str | bytes | int] = [60, b"12345678", 0]
    for i in range(3):
        args += [f"x{i}", payload_digest(b"p%d" % i), b"p%d" % i]
    reply = await client.eval(
        ENQUEUE_SCRIPT, 3, keys.ingest, keys.job("old"), keys.job_ids("old"), *args
    )
    assert reply == [3, 0, 3]
    assert await client.xlen(keys.ingest) == 3


def test_the_shares_of_a_limit_sum_to_it() -> None:
    from embedfleet.shared.tenants import TenantPolicy

    policy = TenantPolicy(max_backlog={"t": 100, "tiny": 2})
    assert [policy.backlog_share("t", i, 3) for i in range(3)] == [34, 33, 33]
    assert policy.backlog_share("t", 0, 1) == 100
    assert [policy.backlog_share("tiny", i, 4) for i in range(4)] == [1, 1, 1, 1]  # at least 1
    assert policy.backlog_share("other", 0, 4) is None


async def test_the_cli_at_a_full_tenant_says_how_many_it_added(
    settings: Settings, client: aioredis.Redis, tmp_path: Path
) -> None:
    """`embedfleet enqueue --tenant small` of 150 lines, no fleet: 100 added, then, after
    EMBEDFLEET_TENANT_BACKLOG_WAIT_S, exit 1 with the error's message naming how many were
    added (before: all 150 added, exit 0)."""
    source = tmp_path / "chunks.jsonl"
    source.write_text(
        "".join(json.dumps({"id": f"c{i}", "text": f"t {i}"}) + "\n" for i in range(150))
    )
    env = cli_env(
        settings,
        EMBEDFLEET_TENANT_MAX_BACKLOG=f"{TENANT}={LIMIT}",
        EMBEDFLEET_TENANT_BACKLOG_WAIT_S="0.5",
    )
    process = await start_cli(env, "enqueue", str(source), "--job", "j", "--tenant", TENANT)
    _, err = await process.communicate()
    held = await client.xlen(settings.keys.ingest_for(TENANT))
    print(f"cli enqueue of 150 at limit {LIMIT}: exit {process.returncode}, {held} in the stream")
    assert held == LIMIT
    assert process.returncode == 1 and "Traceback" not in err.decode()
    assert "this call added 100 of its chunks" in err.decode()
