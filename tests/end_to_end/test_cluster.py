"""Partitions on a real Redis Cluster: 3 masters + 3 replicas of Debian's redis-server.

One cluster and one fleet of 3 worker processes serve the whole module (each test its own job),
so the module costs one cluster start and one model load per worker. The failover test runs
last: it leaves the cluster with one master fewer replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis

from embedfleet.producer import Producer
from embedfleet.producer.chunker import builtin_corpus
from embedfleet.server import free_port, isolated_settings
from embedfleet.shared.keys import key_slot
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.redis_conn import TRANSIENT_FAULTS, connect_settings
from embedfleet.shared.settings import Settings
from embedfleet.shared.streams import find_group
from embedfleet.workers.model.precision import cosines as row_cosines
from loadtest.local_cluster import LocalCluster
from tests import forks
from tests.conftest import reference_model, require_slow_tier, worker_env

pytestmark = pytest.mark.cluster
PARTITIONS = 6
WORKERS = 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(masters=3, replicas_per_master=1) as running:
        yield running


@pytest.fixture(scope="module")
def cluster_settings(cluster: LocalCluster) -> Settings:
    namespace = f"c{uuid.uuid4().hex[:8]}"
    return isolated_settings(
        cluster.url, namespace, partitions=PARTITIONS, min_replicas=1, block_ms=200
    )


@pytest.fixture(scope="module")
def fleet(
    cluster_settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[forks.Process]]:
    """3 `embedfleet worker` processes reading all 6 partitions through the cluster client."""
    extra = {
        "EMBEDFLEET_PARTITIONS": str(PARTITIONS),
        "EMBEDFLEET_READ_COUNT": "64",
        "EMBEDFLEET_THREADS": "1",
        "EMBEDFLEET_FROZEN_QUERIES": "false",
        # a result write lost with a dead master comes back this soon
        "EMBEDFLEET_RECLAIM_IDLE_MS": "3000",
    }
    health_ports = [free_port() for _ in range(WORKERS)]
    log_dir = tmp_path_factory.mktemp("cluster-workers")
    log_files = [(log_dir / f"cw{i}.log").open("wb") for i in range(WORKERS)]
    require_slow_tier("`embedfleet worker` processes")
    processes = [
        forks.popen(
            ["worker"],
            env=worker_env(
                cluster_settings,
                EMBEDFLEET_CONSUMER=f"cw{i}",
                EMBEDFLEET_HEALTH_PORT=str(health_ports[i]),
                **extra,
            ),
            stdout=subprocess.DEVNULL,
            stderr=log_file,
        )
        for i, log_file in enumerate(log_files)
    ]
    print(f"worker logs in {log_dir}")
    _wait_until_ready(health_ports, processes)
    yield processes
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    codes = [process.wait(timeout=90) for process in processes]
    for log_file in log_files:
        log_file.close()
    assert codes == [0] * WORKERS, (log_dir / "cw0.log").read_text()[-3000:]


def _wait_until_ready(ports: list[int], processes: list[forks.Process]) -> None:
    """Until every worker's /readyz says it can embed (model loaded, cluster answering)."""
    deadline = time.monotonic() + 600  # three model loads on a small, busy CPU
    waiting = set(ports)
    while waiting and time.monotonic() < deadline:
        assert all(p.poll() is None for p in processes), "a worker exited at start"
        for port in list(waiting):
            url = f"http://127.0.0.1:{port}/readyz"
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as reply:
                if reply.status == 200:
                    waiting.discard(port)
        time.sleep(0.2)
    assert not waiting, f"workers on health ports {sorted(waiting)} never became ready"


@pytest.fixture
async def cluster_client(cluster_settings: Settings) -> AsyncIterator[aioredis.Redis]:
    client = connect_settings(cluster_settings)
    yield client
    await client.aclose()


def _chunks(job: str, count: int) -> list[Chunk]:
    return [Chunk(f"{job}-{c.id}", c.text, meta=c.meta) for c in builtin_corpus(count)]


async def _drained(client: aioredis.Redis, settings: Settings) -> tuple[int, int]:
    """(lag, pending) summed over the partitions' groups, through faults."""
    lag = pending = 0
    for partition in settings.keys.partitions_keys:
        state = find_group(await client.xinfo_groups(partition.ingest), settings.group)
        assert state is not None
        lag += state.lag or 0
        pending += state.pending
    return lag, pending


async def _wait_all_done(
    producer: Producer, client: aioredis.Redis, settings: Settings, job: str, timeout: float
) -> None:
    """Until the job's counters are complete and no partition has anything left to deliver or
    acknowledge; Redis faults (a failover in progress) are waited out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(*TRANSIENT_FAULTS):
            progress = await producer.progress(job)
            if progress.finished and await _drained(client, settings) == (0, 0):
                return
        await asyncio.sleep(0.2)
    raise AssertionError(f"job {job} not drained in {timeout}s: {progress}")


async def _result_ids(producer: Producer, job: str) -> list[str]:
    return [result.id async for result in producer.results(job=job)]


def test_partitions_spread_over_every_master(
    cluster: LocalCluster, cluster_settings: Settings
) -> None:
    client = cluster.client()
    holders: dict[int, int] = {}
    for partition in cluster_settings.keys.partitions_keys:
        keys = [partition.ingest, partition.results, partition.dead, partition.job("j")]
        slots = {int(client.execute_command("CLUSTER", "KEYSLOT", key)) for key in keys}
        assert slots == {key_slot(partition.ingest)}, "a partition's keys share one slot"
        holders[partition.index] = cluster.master_of(slots.pop()).port
    lane = cluster_settings.keys.priority_streams
    assert client.execute_command("CLUSTER", "KEYSLOT", lane.reply("r")) == key_slot(lane.query)
    assert key_slot(lane.interactive) == key_slot(lane.query)
    keys = cluster_settings.keys
    batch_keys = [
        keys.batch("b"),
        keys.batches,
        keys.batches_active,
        keys.batch_lease("b"),
        keys.owner_batches("o"),
        keys.owner_batches_active("o"),
    ]
    assert len({key_slot(key) for key in batch_keys}) == 1, "a batch's MULTI stays in one slot"
    assert set(holders.values()) == {m.port for m in cluster.masters()}
    assert sorted(list(holders.values()).count(port) for port in set(holders.values())) == [2, 2, 2]


async def test_six_partitions_three_workers_every_id_once_with_parity(
    cluster: LocalCluster,
    cluster_settings: Settings,
    fleet: list[forks.Process],
    cluster_client: aioredis.Redis,
) -> None:
    # Which worker takes which entries is a race the test must not depend on: one worker may
    # well take all of them in one read (and an idle worker reads only the partitions that
    # have a backlog, so it joins a partition's group only then).
    chunks = _chunks("parity", 180)
    async with Producer(cluster_settings, cluster_client) as producer:
        await producer.enqueue(chunks, job="parity", batch_size=50)
        await _wait_all_done(producer, cluster_client, cluster_settings, "parity", timeout=240)
        results = {r.id: r async for r in producer.results(job="parity")}
        ids = await _result_ids(producer, "parity")
        progress = await producer.progress("parity")
    assert sorted(ids) == sorted(c.id for c in chunks), "every id back exactly once"
    assert (progress.enqueued, progress.done, progress.dead) == (180, 180, 0)

    # every partition got work (the chunks' ids spread over all of them)
    for partition in cluster_settings.keys.partitions_keys:
        assert await cluster_client.xlen(partition.results) > 0

    reference = reference_model().encode([c.text for c in chunks], batch_size=64)
    ours = np.stack([results[c.id].vector.astype(np.float32) for c in chunks])
    cosines = row_cosines(reference, ours)
    print(f"cluster parity over {len(chunks)} texts: min cosine {cosines.min():.6f}")
    assert cosines.min() >= 0.999


def test_the_gateway_and_the_batch_api_on_the_cluster_every_custom_id_once(
    cluster_settings: Settings,
    fleet: list[forks.Process],
    tmp_path: Path,
) -> None:
    """`embedfleet serve` on the 6 partitions of the cluster: small requests (query stream),
    large ones (interactive stream) and a Batch API batch (its inputs routed to every partition
    by the client's enqueue path, collected from every partition's reply list)."""
    import openai
    from sentence_transformers import SentenceTransformer

    from embedfleet.workers.model.encoder import resolve_model_path
    from tests.gateway_support import running_gateway

    settings = cluster_settings.model_copy(
        update={"files_dir": str(tmp_path / "files"), "gateway_lane_max_inputs": 4}
    )
    texts = [chunk.text[:200] for chunk in builtin_corpus(240)]
    reference = SentenceTransformer(str(resolve_model_path(settings.model)), device="cpu")
    expected = reference.encode(texts, batch_size=64)
    lines = [
        json.dumps(
            {
                "custom_id": f"req-{n}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "all-MiniLM-L6-v2", "input": text},
            }
        )
        for n, text in enumerate(texts[:200])
    ]
    source = tmp_path / "batch.jsonl"
    source.write_text("\n".join(lines) + "\n")
    with running_gateway(settings) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        small = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts[200:203])
        large = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts[200:240])
        uploaded = client.files.create(file=source.open("rb"), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        deadline = time.monotonic() + 400
        while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
            assert time.monotonic() < deadline, f"batch still {batch.status}"
            time.sleep(0.5)
        output = client.files.content(batch.output_file_id).text.splitlines()
    for response, first in ((small, 200), (large, 200)):
        got = np.array([item.embedding for item in response.data])
        assert min_cosine(got, expected[first : first + len(got)]) >= 0.999
    assert batch.status == "completed" and batch.request_counts.completed == 200
    records = [json.loads(line) for line in output]
    custom_ids = [record["custom_id"] for record in records]
    assert sorted(custom_ids) == sorted(f"req-{n}" for n in range(200))
    assert len(set(custom_ids)) == len(custom_ids) == 200, "every custom_id exactly once"
    by_id = {record["custom_id"]: record for record in records}
    got = np.array(
        [by_id[f"req-{n}"]["response"]["body"]["data"][0]["embedding"] for n in range(200)]
    )
    assert min_cosine(got, expected[:200]) >= 0.999


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


async def _enqueue_in_batches(producer: Producer, chunks: list[Chunk], job: str) -> int:
    """Enqueue a little at a time, so the run is still enqueueing when the cluster changes."""
    sent = 0
    for start in range(0, len(chunks), 25):
        sent += await producer.enqueue(chunks[start : start + 25], job=job, batch_size=25)
        await asyncio.sleep(0.02)
    return sent


RunThrough = Callable[[str, Callable[[], None]], Awaitable[None]]


@pytest.fixture
def run_through(
    cluster_settings: Settings,
    cluster_client: aioredis.Redis,
    fleet: list[forks.Process],
) -> RunThrough:
    """``await run_through(job, disturb)``: enqueue 450 chunks while the fleet embeds them;
    ``disturb()`` runs (on a thread) once both are in flight: some results are written and the
    last two thirds are being enqueued. Then: 0 missing, 0 pending, and no worker died."""

    async def run(job: str, disturb: Callable[[], None]) -> None:
        count = 450
        chunks = _chunks(job, count)
        first, rest = chunks[: count // 3], chunks[count // 3 :]
        async with Producer(cluster_settings, cluster_client) as producer:
            await producer.enqueue(first, job=job, batch_size=50)
            while (await producer.progress(job)).done < 20:
                await asyncio.sleep(0.05)
            assert (await producer.progress(job)).done < len(first), "embedding is still in flight"
            # the rest is enqueued in small batches while the cluster changes under it
            disturbing = asyncio.create_task(asyncio.to_thread(disturb))
            await _enqueue_in_batches(producer, rest, job)
            await disturbing
            await _wait_all_done(producer, cluster_client, cluster_settings, job, timeout=120)
            ids = set(await _result_ids(producer, job))
            lag, pending = await _drained(cluster_client, cluster_settings)
        missing = {c.id for c in chunks} - ids
        assert not missing, f"{len(missing)} ids missing"
        assert (lag, pending) == (0, 0)
        assert all(process.poll() is None for process in fleet), "no worker died"

    return run


async def test_slot_migration_mid_run_loses_nothing(
    cluster: LocalCluster, cluster_settings: Settings, run_through: RunThrough
) -> None:
    slot = key_slot(cluster_settings.keys.partition(0).ingest)
    source = cluster.master_of(slot)
    target = next(m for m in cluster.masters() if m.port != source.port)

    def migrate() -> None:
        cluster.reshard(slot, target.port)

    await run_through("reshard", migrate)
    assert cluster.master_of(slot).port == target.port, "the partition's slot moved"


async def test_master_killed_mid_run_loses_nothing(
    cluster: LocalCluster, cluster_settings: Settings, run_through: RunThrough
) -> None:
    # the master holding partition 1 dies without a word (SIGKILL) while enqueue and embedding
    # are both in flight; EMBEDFLEET_MIN_REPLICAS=1 makes every confirmed batch be on its replica
    slot = key_slot(cluster_settings.keys.partition(1).ingest)
    victim = cluster.master_of(slot)
    cluster.remember_masters()
    promoted: list[int] = []

    def kill_master() -> None:
        cluster.kill(victim.port)
        promoted.append(cluster.wait_failover(victim.port))
        # the dead machine comes back (as a replica of the promoted one): until it has synced,
        # the promoted master has no replica and enqueues to it wait, unconfirmed, and re-send
        cluster.revive(victim.port)
        cluster.wait_healthy()

    await run_through("failover", kill_master)
    assert cluster.master_of(slot).port == promoted[0] != victim.port
    assert victim.port in {r.port for r in cluster.replicas_of(cluster.master_of(slot))}


async def test_status_agrees_with_xinfo_groups_on_every_partition(
    cluster: LocalCluster, cluster_settings: Settings
) -> None:
    # a namespace of its own, without workers: some entries read and not acknowledged (pending),
    # the rest undelivered (lag), so every column has something to agree on
    settings = cluster_settings.model_copy(
        update={"namespace": f"s{uuid.uuid4().hex[:8]}", "min_replicas": 0}
    )
    client = connect_settings(settings)
    try:
        async with Producer(settings, client) as producer:
            await producer.enqueue(_chunks("status", 120), job="status")
        for partition in settings.keys.partitions_keys[::2]:
            await client.xreadgroup(settings.group, "reader", {partition.ingest: ">"}, count=5)
        env = {
            "EMBEDFLEET_REDIS_URL": settings.effective_redis_url,
            "EMBEDFLEET_NAMESPACE": settings.namespace,
            "EMBEDFLEET_PARTITIONS": str(PARTITIONS),
        }
        shown = await asyncio.to_thread(
            forks.run, ["status", "--json", "--sample", "0"], env={**os.environ, **env}
        )
        assert shown.returncode == 0, shown.stderr.decode(errors="replace")
        data = json.loads(shown.stdout)
        rows = {row["partition"]: row for row in data["partitions"]}
        assert sorted(rows) == list(range(PARTITIONS))
        total_lag = total_pending = 0
        for partition in settings.keys.partitions_keys:
            row = rows[partition.index]
            group = find_group(await client.xinfo_groups(partition.ingest), settings.group)
            assert group is not None
            assert row["key"] == partition.ingest
            assert (row["lag"], row["pending"], row["consumers"]) == (
                group.lag,
                group.pending,
                group.consumers,
            )
            assert row["entries_read"] == group.entries_read
            assert row["last_delivered_id"] == group.last_delivered_id
            assert row["length"] == await client.xlen(partition.ingest)
            assert row["node"] == f"127.0.0.1:{cluster.master_of(row['slot']).port}"
            total_lag += group.lag or 0
            total_pending += group.pending
        assert total_pending == 15 and total_lag == 120 - 15
        assert data["streams"]["ingest"]["lag"] == total_lag
        assert data["streams"]["ingest"]["pending"] == total_pending
        assert data["jobs"] == [
            {
                "job": "status",
                "enqueued": 120,
                "done": 0,
                "dead": 0,
                "remaining": 120,
                "cache_hits": 0,
                "cache_misses": 0,
                "tokens_saved": 0,
            }
        ]
    finally:
        await client.aclose()
