"""Chaos: three worker processes, one of them SIGKILLed at random moments and restarted.

Afterwards every id has a result (duplicates allowed in the stream, one per id in the export),
nothing is pending, and nothing is dead but what was sent bad. Marked ``chaos``: `make
test-quick` skips it, CI runs it.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import signal
import time

import pytest
import redis.asyncio as aioredis
from embedfleet.producer import Producer
from embedfleet.producer.chunker import builtin_corpus
from embedfleet.shared.protocol import PAYLOAD_FIELD, Chunk
from embedfleet.shared.settings import Settings

from tests.conftest import start_worker_process

pytestmark = pytest.mark.chaos
CHUNKS = 3000
KILLS = 6
BAD = [b"\xc1 junk", b"\x81\xa1v\x07", b"\x83\xa1v\x01\xa2id\xa1x\xa4text\xa0"]


def corpus() -> list[Chunk]:
    texts = [chunk.text for chunk in builtin_corpus(max_chars=300)]
    return [Chunk(id=f"c{i}", text=text) for i, text in zip(range(CHUNKS), itertools.cycle(texts))]


async def test_random_sigkills_lose_nothing(settings: Settings, client: aioredis.Redis) -> None:
    rng = random.Random(20261129)
    env = {
        "EMBEDFLEET_RECLAIM_IDLE_MS": "3000",
        "EMBEDFLEET_THREADS": "1",  # three processes share two cores
        "EMBEDFLEET_READ_COUNT": "128",
    }
    names = ["chaos-0", "chaos-1", "chaos-2"]
    workers = {name: start_worker_process(settings, name, **env) for name in names}
    kills = 0
    chunks = corpus()
    started = time.monotonic()
    try:
        async with Producer(settings, client) as producer:
            await producer.enqueue(chunks, job="chaos")
            for bad in BAD:
                await client.xadd(settings.keys.ingest, {PAYLOAD_FIELD: bad})
            # kill while work is under way, not while the processes are still loading the model
            while (await producer.progress("chaos")).done < 100:
                await asyncio.sleep(0.2)
            while kills < KILLS:
                await asyncio.sleep(rng.uniform(1.0, 4.0))
                victim = rng.choice(names)
                workers[victim].send_signal(signal.SIGKILL)
                await asyncio.to_thread(workers[victim].wait, 30)
                kills += 1
                done = (await producer.progress("chaos")).done
                print(f"kill {kills}: {victim} at {time.monotonic() - started:.1f}s, done={done}")
                # restarted under a new name: the old consumer's entries must be reclaimed
                workers[victim] = start_worker_process(settings, f"{victim}-r{kills}", **env)
            progress = await producer.wait_for_job("chaos", timeout=600)
            results = [r async for r in producer.results(job="chaos")]
            deadline = time.monotonic() + 60
            while (pending := await client.xpending(settings.keys.ingest, settings.group))[
                "pending"
            ] and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            dead = await client.xrange(settings.keys.dead)
    finally:
        for process in workers.values():
            process.send_signal(signal.SIGTERM)
        for process in workers.values():
            process.wait(timeout=60)
    ids = [r.id for r in results]
    expected = {c.id for c in chunks}
    missing = expected - set(ids)
    duplicates = len(ids) - len(set(ids))
    print(
        f"chaos: kills={kills} chunks={CHUNKS} results={len(ids)} duplicates={duplicates} "
        f"missing={len(missing)} dead={len(dead)} seconds={time.monotonic() - started:.0f}"
    )
    assert kills >= 5
    assert not missing
    assert set(ids) == expected
    assert pending["pending"] == 0
    assert len(dead) == len(BAD)
    assert progress.done >= CHUNKS
