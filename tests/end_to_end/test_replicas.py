"""`embedfleet worker --replicas N`: N worker processes under one parent, one consumer group."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from pydantic import ValidationError

from embedfleet.producer.chunker import builtin_corpus
from embedfleet.producer.client import Producer
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.settings import Settings
from embedfleet.workers.replicas import (
    CUDA_CONTEXT_BYTES,
    allocator_fraction,
    gpu_memory_share,
    plan_replicas,
    replica_environment,
)
from loadtest.replicas import free_ports, wait_ready
from tests.conftest import require_slow_tier, worker_env
from tests.end_to_end.test_ops import scrape

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = pytest.mark.slow


def test_plan_shares_the_threads_and_names_each_replica() -> None:
    settings = Settings(consumer="pod-7", threads=8, health_port=9400)
    plans = plan_replicas(settings, 4, on_cuda=False)
    assert [p.consumer for p in plans] == ["pod-7-r0", "pod-7-r1", "pod-7-r2", "pod-7-r3"]
    assert {p.threads for p in plans} == {2}
    assert [p.health_port for p in plans] == [9400, 9401, 9402, 9403]
    assert {p.threads for p in plan_replicas(settings, 3, on_cuda=True)} == {1}, "1 each on CUDA"
    assert {p.threads for p in plan_replicas(settings, 16, on_cuda=False)} == {1}, "never 0"
    assert {p.health_port for p in plan_replicas(Settings(), 2, on_cuda=False)} == {0}
    env = replica_environment(plans[1], {"EMBEDFLEET_MODEL": "/m"})
    assert env["EMBEDFLEET_REPLICAS"] == "1", "a replica does not start replicas of its own"
    assert (env["EMBEDFLEET_CONSUMER"], env["EMBEDFLEET_THREADS"]) == ("pod-7-r1", "2")
    assert env["EMBEDFLEET_MODEL"] == "/m"


def test_each_replica_on_a_gpu_gets_its_share_of_the_memory() -> None:
    assert gpu_memory_share(-1, 4) == 0.25, "auto: 1/replicas"
    assert gpu_memory_share(-1, 1) == 0.0, "auto for a single worker: no cap"
    assert gpu_memory_share(0, 8) == 0.0, "0: no cap, however many replicas"
    assert gpu_memory_share(0.1, 4) == 0.1, "an explicit share is each replica's"
    h200 = 141 * 10**9
    assert allocator_fraction(0.25, h200) == pytest.approx(0.25 - CUDA_CONTEXT_BYTES / h200)
    assert allocator_fraction(1 / 32, h200) == pytest.approx(0.03125 - 0.0076, abs=1e-4)
    assert allocator_fraction(0.0, h200) is None and allocator_fraction(1.0, h200) is None
    with pytest.raises(ValueError, match="fewer replicas"):
        allocator_fraction(1 / 32, 16 * 2**30)  # 0.5 GiB each on a 16 GiB card

    settings = Settings(consumer="gpu", threads=16)
    plans = plan_replicas(settings, 4, on_cuda=True)
    assert {(p.threads, p.gpu_memory_share) for p in plans} == {(1, 0.25)}
    env = replica_environment(plans[2], {})
    assert (env["EMBEDFLEET_THREADS"], env["EMBEDFLEET_GPU_MEMORY_FRACTION"]) == ("1", "0.25")
    # what the replica reads back: its share, though it runs with REPLICAS=1
    child = Settings(gpu_memory_fraction=float(env["EMBEDFLEET_GPU_MEMORY_FRACTION"]))
    assert gpu_memory_share(child.gpu_memory_fraction, child.replicas) == 0.25
    explicit = Settings(consumer="gpu", gpu_memory_fraction=0.2)
    assert {p.gpu_memory_share for p in plan_replicas(explicit, 4, on_cuda=True)} == {0.2}
    assert {p.gpu_memory_share for p in plan_replicas(settings, 4, on_cuda=False)} == {0.0}
    for bad in (-0.5, 1.5, -2):
        with pytest.raises(ValidationError):
            Settings(gpu_memory_fraction=bad)


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in path.read_text().split()] if path.exists() else []


async def _ready(parent: subprocess.Popen[bytes], port: int) -> None:
    """Both replicas' /readyz answer 200; fails at once, with the worker's last words, if it
    exits first."""
    try:
        await wait_ready([port, port + 1], process=parent)
    except RuntimeError as exited:
        _, stderr = parent.communicate(timeout=60)
        raise AssertionError(f"{exited}: {stderr.decode()[-2000:]}") from None


def _start(settings: Settings, consumer: str, port: int, **extra: str) -> subprocess.Popen[bytes]:
    require_slow_tier("an `embedfleet worker --replicas 2` process")
    return subprocess.Popen(
        [sys.executable, "-m", "embedfleet.cli", "worker", "--replicas", "2"],
        env=worker_env(
            settings, EMBEDFLEET_CONSUMER=consumer, EMBEDFLEET_HEALTH_PORT=str(port), **extra
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


async def test_replicas_embed_together_and_drain_on_sigterm(
    settings: Settings,
) -> None:
    port = free_ports(2)
    parent = _start(settings, "rep", port, EMBEDFLEET_READ_COUNT="8")
    try:
        await _ready(parent, port)
        assert len(_children(parent.pid)) == 2
        chunks = list(builtin_corpus(120))
        async with Producer(settings) as producer:
            await producer.enqueue(chunks, job="replicas")
            progress = await producer.wait_for_job("replicas", timeout=300)
            results = {r.id: r async for r in producer.results(job="replicas")}
        assert progress.done == 120 and progress.dead == 0
        assert set(results) == {c.id for c in chunks}
        assert all(np.isfinite(r.vector.astype(np.float32)).all() for r in results.values())
        # together: each replica embeds some of the work, each text once. /readyz comes before
        # a replica's first bulk read (its lane still settles the forward path and seeds the
        # cost model), so on a slow CPU one replica can take a whole first job; a later job,
        # with both reading, is shared (a CI run on Zen 3 read [0, 120] after the first)
        total = 120
        async with aiohttp.ClientSession() as session:
            for extra in range(4):
                embedded = [
                    (await scrape(session, p))("embedfleet_texts_embedded_total")
                    for p in (port, port + 1)
                ]
                if min(embedded) > 0:
                    break
                more = [Chunk(id=f"more{extra}-{c.id}", text=c.text) for c in chunks]
                async with Producer(settings) as producer:
                    await producer.enqueue(more, job=f"more{extra}")
                    done = await producer.wait_for_job(f"more{extra}", timeout=300)
                assert done.done == len(more) and done.dead == 0
                total += len(more)
        assert sum(embedded) == total and min(embedded) > 0, embedded
        parent.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.to_thread(parent.communicate, timeout=120)
        assert parent.returncode == 0, stderr.decode()[-2000:]
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


async def test_a_replica_that_dies_takes_the_worker_down(
    settings: Settings,
) -> None:
    port = free_ports(2)
    parent = _start(settings, "die", port)
    try:
        await _ready(parent, port)
        victim, survivor = _children(parent.pid)
        os.kill(victim, signal.SIGKILL)
        _, stderr = await asyncio.to_thread(parent.communicate, timeout=120)
        assert parent.returncode != 0, "a partial worker must exit non-zero for its supervisor"
        assert not Path(f"/proc/{survivor}").exists(), "the other replica was drained too"
        assert b"a replica exited on its own" in stderr
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
