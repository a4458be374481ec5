"""Partition keys, routing and the partitioned reader, on one real Redis server (the cluster
itself: tests/end_to_end/test_cluster.py)."""

from __future__ import annotations

import asyncio
import time
import zlib

import pytest
import redis.asyncio as aioredis

from embedfleet.producer import Producer
from embedfleet.shared.keys import (
    CLUSTER_SLOTS,
    Keys,
    PartitionedKeyError,
    crc16,
    key_slot,
    partition_of,
    slot_range,
)
from embedfleet.shared.protocol import PAYLOAD_FIELD, Chunk, encode_chunk
from embedfleet.shared.redis_url import split_cluster_url
from embedfleet.shared.settings import Settings, SettingsError, load_settings
from embedfleet.workers.consumer import StreamConsumer, backlog_shares
from tests.conftest import WorkerLauncher, until_blocked


def test_one_partition_is_the_single_node_layout_byte_for_byte() -> None:
    keys = Keys()
    assert (keys.ingest, keys.query, keys.results, keys.dead) == (
        "embedfleet:ingest",
        "embedfleet:query",
        "embedfleet:results",
        "embedfleet:dead",
    )
    assert (keys.job("j"), keys.job_ids("j"), keys.reply("r"), keys.jobs_index) == (
        "embedfleet:job:j",
        "embedfleet:jobids:j",
        "embedfleet:reply:r",
        "embedfleet:jobs",
    )
    assert keys.partitions_keys == (keys,) and keys.priority_streams == keys
    assert keys.partition_for("any id") == keys


def test_a_model_lane_has_its_own_keys_partitioned_like_the_namespace() -> None:
    keys = Keys(partitions=2)
    lane = keys.for_model("BAAI/bge-m3")
    assert lane.partition(0).ingest == "embedfleet:m:BAAI/bge-m3:{p0of2.0}:ingest"
    assert lane.priority_streams.query == "embedfleet:m:BAAI/bge-m3:{q}:query"
    assert (lane.model, lane.workers_alive) == (
        "embedfleet:m:BAAI/bge-m3:model",
        "embedfleet:m:BAAI/bge-m3:workers",
    )
    # fleet-wide keys stay the namespace's: the lane registry and the Batch API's records
    assert lane.models == keys.models == "embedfleet:models"
    assert lane.batches == keys.batches
    assert key_slot(lane.partition(1).ingest) == key_slot(keys.partition(1).ingest)
    assert (
        Keys().for_model(None) == Keys() and Keys().for_model("x").ingest == "embedfleet:m:x:ingest"
    )
    assert Settings(model_lane="code").keys.ingest == "embedfleet:m:code:ingest"
    for bad in ("a:b", "{tag}", "", "-x", "x" * 129):
        with pytest.raises(ValueError, match=r"model lane|letters, digits"):
            Settings(model_lane=bad) if bad else Keys(model_lane=bad)


def test_slots_are_computed_as_redis_does() -> None:
    assert crc16(b"123456789") == 0x31C3  # the CRC16-XMODEM check value Redis documents
    assert key_slot("foo") == 12182  # CLUSTER KEYSLOT foo
    assert key_slot("{user1000}.following") == key_slot("{user1000}.followers")
    assert key_slot("foo{}{bar}") == crc16(b"foo{}{bar}") % CLUSTER_SLOTS  # empty tag: whole key


@pytest.mark.parametrize("count", [2, 3, 6, 16, 64])
def test_partition_tags_land_in_their_share_of_the_slots(count: int) -> None:
    keys = Keys(partitions=count)
    for partition in keys.partitions_keys:
        first, end = slot_range(partition.index, count)
        slots = {key_slot(k) for k in (partition.ingest, partition.results, partition.job("x"))}
        assert len(slots) == 1, "a partition's keys share one slot"
        assert first <= slots.pop() < end
    assert len({p.ingest for p in keys.partitions_keys}) == count


def test_routing_is_crc32_of_the_id() -> None:
    ids = [f"doc-{i}" for i in range(600)]
    assert [partition_of(i, 6) for i in ids] == [zlib.crc32(i.encode()) % 6 for i in ids]
    counts = [sum(partition_of(i, 6) == p for i in ids) for p in range(6)]
    assert min(counts) > 60, f"ids spread over the partitions: {counts}"
    keys = Keys(partitions=6)
    assert keys.partition_for("doc-1") == keys.partition(partition_of("doc-1", 6))


def test_the_fleet_keys_of_a_partitioned_deployment_refuse_per_partition_names() -> None:
    keys = Keys(partitions=4)
    with pytest.raises(PartitionedKeyError, match=r"keys\.partition"):
        _ = keys.ingest
    assert keys.priority_streams.query == "embedfleet:{q}:query"
    assert key_slot(keys.priority_streams.reply("abc")) == key_slot(keys.priority_streams.query)
    assert keys.owner_of(keys.partition(3).ingest) == keys.partition(3)
    assert keys.model == "embedfleet:model"  # fleet-wide keys stay where they were


def test_settings_for_partitions() -> None:
    settings = Settings(partitions=6, partition_set="0, 2-3")
    assert settings.read_partitions == [0, 2, 3]
    assert Settings(partitions=3).read_partitions == [0, 1, 2]
    with pytest.raises(SettingsError, match="must not hold a hash tag"):
        load_settings(partitions=2, namespace="{emb}")
    with pytest.raises(SettingsError, match=r"EMBEDFLEET_PARTITION_SET: partition 5 does not"):
        load_settings(partitions=2, partition_set="5")
    assert Settings(redis_url="rediss+cluster://h:1/0").cluster
    assert split_cluster_url("redis+cluster://u:p@h:7000/0") == ("redis://u:p@h:7000/0", True)
    assert split_cluster_url("redis://h:1/0", cluster=False) == ("redis://h:1/0", False)


def test_backlog_shares_follow_the_backlogs() -> None:
    shares = backlog_shares(1000, {"a": 3000, "b": 1000, "c": 0})
    assert shares == {"a": 750, "b": 250}, "an empty partition is not asked"
    assert backlog_shares(1000, {"a": 1_000_000, "b": 1}) == {"a": 1000, "b": 1}, "never starved"
    assert backlog_shares(64, {}) == {}


@pytest.fixture
def partitioned(settings: Settings) -> Settings:
    return settings.model_copy(update={"partitions": 3})


async def test_an_idle_reader_wakes_for_any_partition(
    partitioned: Settings, client: aioredis.Redis
) -> None:
    keys = partitioned.keys
    consumer = StreamConsumer(client, keys, "idle")
    await consumer.setup()
    for index in (2, 0):  # the last partition, then the first
        reading = asyncio.create_task(consumer.read_ingest(count=10, block_ms=2000))
        # the server says when a read is blocked on every partition: the wake-up is timed from then
        await until_blocked(client, "xreadgroup", count=keys.partitions)
        sent_at = time.monotonic()
        payload = encode_chunk(Chunk(f"wake-{index}", "hello"))
        await client.xadd(keys.partition(index).ingest, {PAYLOAD_FIELD: payload})
        entries = await asyncio.wait_for(reading, 5)
        waited = time.monotonic() - sent_at
        assert [e.stream for e in entries] == [keys.partition(index).ingest]
        assert waited < 1.0, f"woke {waited:.2f}s after the entry arrived"
    leftover = await consumer.finish_waiting()  # the reads still blocked end empty
    assert leftover == []


async def test_partitions_on_one_server_end_to_end(
    workers: WorkerLauncher, partitioned: Settings, client: aioredis.Redis, encoder
) -> None:
    chunks = [Chunk(f"id-{i}", f"text number {i}") for i in range(60)]
    async with Producer(partitioned, client) as producer:
        await producer.enqueue(chunks, job="p")
        await producer.enqueue(chunks[:10], job="p")  # re-sent: added and counted once
        bad = partitioned.keys.partition(1).ingest
        await client.xadd(bad, {PAYLOAD_FIELD: b"\xc1 not msgpack"})
        async with workers.run(partitioned, client=client):
            progress = await producer.wait_for_job("p", timeout=120)
            for _ in range(100):
                if await client.xlen(partitioned.keys.partition(1).dead) == 1:
                    break
                await asyncio.sleep(0.1)
        ids = sorted([r.id async for r in producer.results(job="p")])
    assert (progress.enqueued, progress.done, progress.dead) == (60, 60, 0)
    assert ids == sorted(c.id for c in chunks)
    for partition in partitioned.keys.partitions_keys:
        results = {r[1][PAYLOAD_FIELD] for r in await client.xrange(partition.results)}
        assert results, f"partition {partition.index} got work"
        assert await client.xlen(partition.ingest) == 0
        pending = await client.xpending(partition.ingest, partitioned.group)
        assert pending["pending"] == 0
    ((_, dead),) = await client.xrange(partitioned.keys.partition(1).dead)
    assert dead[b"reason"] == b"not_msgpack" and dead[b"detail"].startswith(b"not msgpack")
