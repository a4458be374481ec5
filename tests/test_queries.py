"""The priority lane: queries answered ahead of bulk work, through reply keys."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import redis.asyncio as aioredis
from embedfleet.producer import Producer, QueryTimeoutError
from embedfleet.producer.chunker import builtin_corpus
from embedfleet.shared.protocol import PAYLOAD_FIELD, Chunk, encode_chunk
from embedfleet.shared.settings import Settings

from tests.conftest import running_worker


async def test_query_matches_the_model(settings: Settings, client: aioredis.Redis, encoder) -> None:
    async with Producer(settings, client) as producer, running_worker(settings, encoder, client):
        vector = await producer.embed_query("how do I open a file?", timeout=30)
        many = await producer.embed_queries(
            ["first question", "second, longer question"], timeout=30
        )
    expected = encoder.embed_texts(
        ["how do I open a file?", "first question", "second, longer question"]
    )
    assert vector.shape == (384,) and many.shape == (2, 384)
    assert float(vector @ expected[0]) > 0.999
    assert float(many[0] @ expected[1]) > 0.999 and float(many[1] @ expected[2]) > 0.999
    assert await client.xlen(settings.keys.query) == 0  # answered entries are deleted
    assert not [key async for key in client.scan_iter(f"{settings.namespace}:reply:*")]


async def test_timeout_raises_and_leaves_nothing_behind(
    settings: Settings, client: aioredis.Redis
) -> None:
    async with Producer(settings, client) as producer:  # no worker running
        with pytest.raises(QueryTimeoutError, match="XINFO GROUPS"):
            await producer.embed_query("anyone there?", timeout=0.3)
    assert await client.xlen(settings.keys.query) == 0
    assert not [key async for key in client.scan_iter(f"{settings.namespace}:reply:*")]


async def test_a_timeout_that_is_not_positive_is_refused_before_enqueueing(
    settings: Settings, client: aioredis.Redis
) -> None:
    async with Producer(settings, client) as producer:
        for timeout in (0, -1.0):
            with pytest.raises(ValueError, match="positive"):
                await producer.embed_query("anyone there?", timeout=timeout)
    assert await client.xlen(settings.keys.query) == 0


async def test_query_overtakes_a_bulk_backlog(
    settings: Settings, client: aioredis.Redis, encoder
) -> None:
    chunks = list(builtin_corpus(600))
    async with Producer(settings, client) as producer, running_worker(settings, encoder, client):
        await producer.enqueue(chunks, job="bulk")
        await asyncio.sleep(0.5)  # the worker is now deep in bulk batches
        vector = await producer.embed_query("priority please", timeout=30)
        progress = await producer.progress("bulk")
        await producer.wait_for_job("bulk", timeout=300)
    assert vector.shape == (384,)
    assert progress.done < len(chunks), "the query should not have waited for the backlog"


async def test_expired_query_is_skipped_not_answered(
    settings: Settings, client: aioredis.Redis, encoder
) -> None:
    stale = Chunk(id="old:0", text="too late", reply="old", deadline_ms=1)
    await client.xadd(settings.keys.query, {PAYLOAD_FIELD: encode_chunk(stale)})
    async with Producer(settings, client) as producer, running_worker(settings, encoder, client):
        await producer.embed_query("fresh", timeout=30)  # served after the stale one
    assert not await client.exists(settings.keys.reply("old"))
    assert await client.xlen(settings.keys.query) == 0


async def test_query_only_worker_leaves_bulk_alone(
    settings: Settings, client: aioredis.Redis, encoder
) -> None:
    query_only = settings.model_copy(update={"query_only": True})
    async with (
        Producer(query_only, client) as producer,
        running_worker(query_only, encoder, client),
    ):
        await producer.enqueue([Chunk("bulk-1", "bulk text")], job="b")
        vector = await producer.embed_query("query text", timeout=30)
        await asyncio.sleep(0.3)
        progress = await producer.progress("b")
    assert vector.shape == (384,) and np.isfinite(vector).all()
    assert progress.done == 0 and await client.xlen(query_only.keys.ingest) == 1
