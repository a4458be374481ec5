"""Enqueue-and-count is idempotent per chunk id within a job (producer/enqueue.py)."""

from __future__ import annotations

import redis.asyncio as aioredis

from embedfleet.producer import Producer
from embedfleet.shared.protocol import PAYLOAD_FIELD, Chunk, decode_chunk
from embedfleet.shared.settings import Settings


def chunks(count: int, job: str | None = "j", text: str = "text") -> list[Chunk]:
    return [Chunk(id=f"c{i}", text=f"{text} {i}", job=job) for i in range(count)]


async def entry_ids(client: aioredis.Redis, settings: Settings) -> list[str]:
    entries = await client.xrange(settings.keys.ingest)
    return [decode_chunk(fields[PAYLOAD_FIELD]).id for _, fields in entries]


async def test_a_re_sent_batch_is_added_and_counted_once(
    settings: Settings, client: aioredis.Redis
) -> None:
    async with Producer(settings, client) as producer:
        assert await producer.enqueue(chunks(30), job="j", batch_size=7) == 30
        # the same chunks again, cut into other batches, and one id twice within one batch
        again = [*chunks(30), Chunk(id="c3", text="text 3", job="j")]
        await producer.enqueue(again, job="j", batch_size=11)
        progress = await producer.progress("j")
    assert progress.enqueued == 30
    assert sorted(await entry_ids(client, settings)) == sorted(f"c{i}" for i in range(30))
    assert await client.smembers(settings.keys.jobs_index) == {b"j"}
    ttl = await client.ttl(settings.keys.job_ids("j"))
    assert 0 < ttl <= settings.job_ids_ttl_s


async def test_a_changed_text_is_enqueued_again_and_counted(
    settings: Settings, client: aioredis.Redis
) -> None:
    async with Producer(settings, client) as producer:
        await producer.enqueue(chunks(5), job="j")
        await producer.enqueue([Chunk(id="c2", text="a new text", job="j")])
        progress = await producer.progress("j")
    ids = await entry_ids(client, settings)
    assert progress.enqueued == 6 and sorted(ids) == ["c0", "c1", "c2", "c2", "c3", "c4"]


async def test_the_same_id_in_another_job_is_its_own_chunk(
    settings: Settings, client: aioredis.Redis
) -> None:
    async with Producer(settings, client) as producer:
        await producer.enqueue(chunks(4), job="a")
        await producer.enqueue(chunks(4), job="b")
        # a batch that mixes jobs, and chunks with no job (no counter: plain XADD)
        mixed = [Chunk("x", "x", "a"), Chunk("c0", "text 0", "b"), Chunk("free", "t")]
        await producer.enqueue(mixed)
        a, b = await producer.progress("a"), await producer.progress("b")
    assert (a.enqueued, b.enqueued) == (5, 4)
    assert len(await entry_ids(client, settings)) == 10


async def test_id_record_can_be_kept_for_ever(settings: Settings, client: aioredis.Redis) -> None:
    forever = settings.model_copy(update={"job_ids_ttl_s": 0})
    async with Producer(forever, client) as producer:
        await producer.enqueue(chunks(3), job="j")
    assert await client.ttl(settings.keys.job_ids("j")) == -1
