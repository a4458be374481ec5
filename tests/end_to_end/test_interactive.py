"""Requests someone waits on: scale from zero through the gateway (requests are enqueued and
wait; a worker starts once their entries are on the streams KEDA counts; they succeed at
parity), and the interactive stream's entries of a caller who has gone are skipped."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import numpy as np
import openai
import pytest
import redis.asyncio as aioredis

from embedfleet.producer.client import Producer
from embedfleet.server import ServerProcess, isolated_settings
from embedfleet.shared.protocol import PAYLOAD_FIELD, Chunk, encode_chunk
from embedfleet.shared.redis_conn import connect, ensure_groups
from embedfleet.shared.settings import Settings
from embedfleet.shared.streams import find_group
from tests.conftest import WorkerLauncher, reference_model, shared_encoder, until
from tests.gateway_support import min_cosine, running_gateway

# not serial: its bounds are timeouts, none a time under test (test-full's parallel tier)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
SMALL = ["How do I open a file in Python?", "Redis streams make a durable queue."]
LARGE = [f"an input of a large request, number {n}, about embeddings" for n in range(24)]


async def test_requests_wait_for_a_worker_that_starts_after_they_are_enqueued(
    redis_server: ServerProcess, tmp_path: Path
) -> None:

    settings = isolated_settings(
        redis_server.url,
        f"zero{uuid.uuid4().hex[:8]}",
        files_dir=str(tmp_path / "files"),
        gateway_lane_max_inputs=4,
        gateway_timeout_s=600,  # a model load on a small shared CPU, with room to spare
        block_ms=200,
    )
    lane = settings.keys.priority_streams
    redis = connect(settings.effective_redis_url)
    launcher = WorkerLauncher(settings, shared_encoder, tmp_path)
    try:
        with running_gateway(settings) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            small = asyncio.create_task(
                client.embeddings.create(model="all-MiniLM-L6-v2", input=SMALL)
            )
            large = asyncio.create_task(
                client.embeddings.create(model="all-MiniLM-L6-v2", input=LARGE)
            )

            async def both_enqueued() -> bool:
                lengths = (await redis.xlen(lane.query), await redis.xlen(lane.interactive))
                return lengths == (len(SMALL), len(LARGE))

            await until(both_enqueued, timeout=60)
            # what KEDA's redis-streams trigger reads: the group's lag on each stream
            for stream, count in ((lane.query, len(SMALL)), (lane.interactive, len(LARGE))):
                group = find_group(await redis.xinfo_groups(stream), settings.group)
                assert group is not None and group.lag == count
            assert not small.done() and not large.done(), "they wait; no 503"
            worker = launcher.process("zero-worker", EMBEDFLEET_FROZEN_QUERIES="false")
            small_response, large_response = await asyncio.wait_for(
                asyncio.gather(small, large), timeout=600
            )
            assert worker.poll() is None
    finally:
        launcher.stop_all()
        await redis.aclose()
    reference = reference_model()
    for response, texts in ((small_response, SMALL), (large_response, LARGE)):
        assert [item.index for item in response.data] == list(range(len(texts)))
        got = np.array([item.embedding for item in response.data])
        assert min_cosine(got, reference.encode(texts)) >= 0.999


async def test_a_worker_skips_interactive_entries_whose_caller_has_gone(
    settings: Settings, client: aioredis.Redis, workers: WorkerLauncher
) -> None:
    lane = settings.keys.priority_streams
    await ensure_groups(client, settings.keys)
    past = int(time.time() * 1000) - 1000  # its caller timed out a second ago
    gone = Chunk("gone:0", "nobody waits for this", reply="gone", deadline_ms=past)
    await client.xadd(lane.interactive, {PAYLOAD_FIELD: encode_chunk(gone)})
    async with workers.run(settings), Producer(settings, client) as producer:
        # read after the expired entry (a stream delivers in order), answered after it
        vectors = await producer.embed_texts(["someone waits for this"], timeout=120)
        assert vectors.shape == (1, 384)
        group = find_group(await client.xinfo_groups(lane.interactive), settings.group)
        assert group is not None and group.pending == 0 and group.lag == 0
    assert await client.xlen(lane.interactive) == 0, "acknowledged and deleted"
    assert not await client.exists(lane.reply("gone")), "not embedded, nothing left to expire"
