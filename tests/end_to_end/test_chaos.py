"""Chaos: three worker processes, one of them SIGKILLed at random moments and restarted.

Afterwards every id has a result (duplicates allowed in the stream, one per id in the export),
nothing is pending, and nothing is dead but what was sent bad. Marked ``chaos``: `make
test` skips it, `make test-full` and CI run it.
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
from tests.conftest import WorkerLauncher

pytestmark = [pytest.mark.chaos, pytest.mark.serial]  # serial: its assertions hold times (Makefile)
CHUNKS = 3000
KILLS = 6
BAD = [b"\xc1 junk", b"\x81\xa1v\x07", b"\x83\xa1v\x01\xa2id\xa1x\xa4text\xa0"]


def corpus() -> list[Chunk]:
    texts = [chunk.text for chunk in builtin_corpus(max_chars=300)]
    return [Chunk(id=f"c{i}", text=text) for i, text in zip(range(CHUNKS), itertools.cycle(texts))]


async def test_random_sigkills_lose_nothing(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis
) -> None:
    rng = random.Random(20261129)
    env = {
        "EMBEDFLEET_RECLAIM_IDLE_MS": "3000",
        "EMBEDFLEET_THREADS": "1",  # three processes share two cores
        "EMBEDFLEET_READ_COUNT": "128",
    }
    names = ["chaos-0", "chaos-1", "chaos-2"]
    processes = {name: workers.process(name, settings, **env) for name in names}
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
                processes[victim].send_signal(signal.SIGKILL)
                await asyncio.to_thread(processes[victim].wait, 30)
                kills += 1
                done = (await producer.progress("chaos")).done
                print(f"kill {kills}: {victim} at {time.monotonic() - started:.1f}s, done={done}")
                # restarted under a new name: the old consumer's entries must be reclaimed
                processes[victim] = workers.process(f"{victim}-r{kills}", settings, **env)
            progress = await producer.wait_for_job("chaos", timeout=600)
            results = [r async for r in producer.results(job="chaos")]
            deadline = time.monotonic() + 60
            while (pending := await client.xpending(settings.keys.ingest, settings.group))[
                "pending"
            ] and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            dead = await client.xrange(settings.keys.dead)
    finally:
        for process in processes.values():
            process.send_signal(signal.SIGTERM)
        for process in processes.values():
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
    # exact: the Lua acknowledgement counts and writes each entry once, however many workers
    # finished it (a killed worker's entries are redone by another)
    assert duplicates == 0 and len(ids) == CHUNKS
    assert (progress.done, progress.dead) == (CHUNKS, 0)
