"""End to end through a real Redis server: parity with sentence-transformers, two workers."""

from __future__ import annotations

import signal

import numpy as np
import pytest
import redis.asyncio as aioredis

from embedfleet.producer import Producer
from embedfleet.producer.chunker import builtin_corpus
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.settings import Settings
from embedfleet.workers.model.precision import cosines as row_cosines
from tests.conftest import WorkerLauncher, reference_model, until

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = pytest.mark.slow

LONG_TEXT = " ".join(f"word{i} and some filler text" for i in range(600))  # ~3,000 tokens


def corpus(count: int) -> list[Chunk]:
    return list(builtin_corpus(count))


async def test_fleet_matches_sentence_transformers(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, encoder
) -> None:

    chunks = [*corpus(300), Chunk(id="long", text=LONG_TEXT, meta={"kind": "long"})]
    async with Producer(settings, client) as producer, workers.run(settings):
        await producer.enqueue(chunks, job="parity")
        progress = await producer.wait_for_job("parity", timeout=300)
        results = {r.id: r async for r in producer.results(job="parity")}
    assert progress.done == len(chunks) and progress.dead == 0
    assert set(results) == {c.id for c in chunks}

    reference = reference_model().encode([c.text for c in chunks], batch_size=32)
    ours = np.stack([results[c.id].vector.astype(np.float32) for c in chunks])
    cosines = row_cosines(reference, ours)
    print(f"parity over {len(chunks)} texts: min cosine {cosines.min():.6f}")
    assert cosines.min() >= 0.999
    assert results["long"].truncated and results["long"].meta == {"kind": "long"}
    assert not any(results[c.id].truncated for c in chunks[:-1] if len(c.text) < 500)
    assert all(r.dim == 384 and r.model == "all-MiniLM-L6-v2" for r in results.values())


async def test_two_worker_processes_every_id_exactly_once(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis
) -> None:
    chunks = corpus(600)
    # what is asserted is delivery (each id once, both consumers), not the forward path: the
    # eager model, without the frozen copy and the int8 race each start would build and time
    # (the CPU seconds CI's slowest class spends on them; the paths have tests of their own)
    processes = [
        workers.process(
            f"worker-{i}", settings, EMBEDFLEET_READ_COUNT="64", EMBEDFLEET_FROZEN_QUERIES="false"
        )
        for i in range(2)
    ]
    try:
        async with Producer(settings, client) as producer:
            await producer.enqueue(chunks, job="two")
            progress = await producer.wait_for_job("two", timeout=300)
            ids = [r.id async for r in producer.results(job="two")]
            consumers = await client.xinfo_consumers(settings.keys.ingest, settings.group)
            pending = await client.xpending(settings.keys.ingest, settings.group)
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        codes = [process.wait(timeout=60) for process in processes]
        logs = [process.log() for process in processes]
    assert (progress.done, progress.dead) == (600, 0)  # exact: the Lua ack counts each once
    assert sorted(ids) == sorted(c.id for c in chunks)  # each exactly once
    assert pending["pending"] == 0
    busy = {c["name"].decode() for c in consumers}
    assert busy == {"worker-0", "worker-1"}, "both workers should have taken part"
    assert codes == [0, 0], logs
    assert all('"worker stopped"' in log for log in logs)
    assert await client.xlen(settings.keys.ingest) == 0  # acknowledged entries are deleted


async def test_bad_entries_are_dead_lettered_and_the_worker_goes_on(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, encoder
) -> None:
    from embedfleet.shared.protocol import PAYLOAD_FIELD, encode_chunk

    async with workers.run(settings):
        await client.xadd(settings.keys.ingest, {PAYLOAD_FIELD: b"\xc1 not msgpack"})
        await client.xadd(settings.keys.ingest, {"text": "no m field"})
        await client.xadd(settings.keys.ingest, {PAYLOAD_FIELD: encode_chunk(Chunk("ok", "fine"))})

        async def all_answered() -> bool:
            return (
                await client.xlen(settings.keys.results) == 1
                and await client.xlen(settings.keys.dead) == 2
            )

        await until(all_answered)
    dead = await client.xrange(settings.keys.dead)
    reasons = sorted((fields[b"reason"].decode(), fields[b"detail"].decode()) for _, fields in dead)
    assert reasons[0][0] == "no_payload" and reasons[0][1].startswith("entry has no 'm' field")
    assert reasons[1][0] == "not_msgpack" and reasons[1][1].startswith("not msgpack")
    assert await client.xlen(settings.keys.results) == 1
    pending = await client.xpending(settings.keys.ingest, settings.group)
    assert pending["pending"] == 0


@pytest.mark.parametrize("truncate", [False])
async def test_overlong_text_dead_lettered_when_truncation_is_off(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, encoder, truncate: bool
) -> None:
    strict = settings.model_copy(update={"truncate": truncate})
    async with Producer(strict, client) as producer, workers.run(strict):
        await producer.enqueue([Chunk("long", LONG_TEXT), Chunk("short", "hello")], job="t")
        progress = await producer.wait_for_job("t", timeout=60)
    assert (progress.done, progress.dead) == (1, 1)
    ((_, fields),) = await client.xrange(strict.keys.dead)
    assert fields[b"id"] == b"long" and b"EMBEDFLEET_TRUNCATE=false" in fields[b"detail"]
    assert fields[b"reason"] == b"too_long"
