"""The query stage: queries answered ahead of bulk work, through reply keys."""

from __future__ import annotations

import numpy as np
import pytest
import redis.asyncio as aioredis

from embedfleet.producer import Producer, QueryTimeoutError
from embedfleet.producer.chunker import builtin_corpus
from embedfleet.shared.protocol import PAYLOAD_FIELD, Chunk, encode_chunk
from embedfleet.shared.settings import Settings
from tests.conftest import Recorder, WorkerLauncher

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = [pytest.mark.slow, pytest.mark.serial]  # serial: its assertions hold times (Makefile)


async def test_query_matches_the_model(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, encoder
) -> None:
    async with Producer(settings, client) as producer, workers.run(settings):
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
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, encoder
) -> None:
    """A query is answered between transformer layers while a bulk batch is mid-forward."""
    chunks = list(builtin_corpus(600))
    async with (
        Producer(settings, client) as producer,
        workers.run(settings) as worker,
    ):
        recorder: Recorder = worker.listener
        await producer.enqueue(chunks, job="bulk")
        vectors = []
        # Sent while a bulk batch is on the model thread. Between two batches the model is idle
        # for a moment and a query is then served directly, not between layers: so a few
        # tries, each started inside a forward pass, until one was answered mid-forward.
        for _ in range(10):
            await recorder.wait_for(lambda r: r.in_forward, "a bulk batch in its forward pass")
            vectors.append(await producer.embed_query("priority please", timeout=30))
            if any(recorder.answered_mid_forward):
                break
        progress = await producer.progress("bulk")
        await producer.wait_for_job("bulk", timeout=300)
    assert any(recorder.answered_mid_forward), recorder.answered_mid_forward
    assert all(vector.shape == (384,) for vector in vectors)
    assert progress.done < len(chunks), "the query should not have waited for the backlog"


async def test_expired_query_is_skipped_not_answered(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, encoder
) -> None:
    stale = Chunk(id="old:0", text="too late", reply="old", deadline_ms=1)
    await client.xadd(settings.keys.query, {PAYLOAD_FIELD: encode_chunk(stale)})
    async with Producer(settings, client) as producer, workers.run(settings):
        await producer.embed_query("fresh", timeout=30)  # served after the stale one
    assert not await client.exists(settings.keys.reply("old"))
    assert await client.xlen(settings.keys.query) == 0


async def test_query_only_worker_leaves_bulk_alone(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, encoder
) -> None:
    query_only = settings.model_copy(update={"query_only": True})
    async with (
        Producer(query_only, client) as producer,
        workers.run(query_only) as worker,
    ):
        await producer.enqueue([Chunk("bulk-1", "bulk text")], job="b")
        vector = await producer.embed_query("query text", timeout=30)
        # the query answered proves the worker has read since the bulk entry was added
        progress = await producer.progress("b")
        recorder: Recorder = worker.listener
    assert vector.shape == (384,) and np.isfinite(vector).all()
    assert progress.done == 0 and await client.xlen(query_only.keys.ingest) == 1
    assert recorder.read[query_only.keys.ingest] == 0 and recorder.batches_started == 0
    (group,) = await client.xinfo_groups(query_only.keys.ingest)
    assert group["entries-read"] in (0, None) and group["pending"] == 0  # never even read
