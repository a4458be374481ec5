"""The Parquet sink against a real S3-compatible server and a local folder.

``moto_server`` (moto's server mode, a real HTTP S3 API: conftest's ``s3_endpoint``) runs on a
free loopback port for the module; the bucket is made with pyarrow's own S3 client. Real Redis,
the real model. The rows are read back with ``pyarrow.dataset`` and LanceDB, not through the
code under test, and compared with sentence-transformers. A worker SIGKILLed while its next
shard is buffering loses nothing and leaves no partial file; the reader keeps one row per id.
"""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from embedfleet.producer import Producer
from embedfleet.producer.chunker import builtin_corpus
from embedfleet.server import isolated_settings
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.redis_conn import connect
from embedfleet.shared.settings import Settings
from embedfleet.sinks import build_sink, open_backend, parse_sink_url
from embedfleet.sinks.parquet import MANIFESTS, ParquetSink
from tests import forks
from tests.conftest import (
    BUCKET,
    WorkerLauncher,
    cli_env,
    reference_model,
    shared_encoder,
    start_cli,
)
from tests.sink_fleet_support import sink_fleet

# thousands of chunks through the real model on a shared CI core take minutes
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def s3_filesystem(endpoint: str) -> Any:
    import pyarrow.fs as pafs

    return pafs.S3FileSystem(endpoint_override=endpoint.removeprefix("http://"), scheme="http")


def read_dataset(path: str, filesystem: Any = None) -> Any:
    """The folder as a user's tool reads it: ``pyarrow.dataset`` on the directory, as it is."""
    import pyarrow.dataset as ds

    return ds.dataset(path, filesystem=filesystem, format="parquet").to_table()


def _cosines(ours: np.ndarray, reference: np.ndarray) -> np.ndarray:
    return (ours * reference).sum(1) / (
        np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1)
    )


def assert_parity(table: Any, chunks: list[Chunk]) -> None:
    """Every chunk's row holds sentence-transformers' vector (cosine ≥ 0.999) and its text."""
    by_id = {row["id"]: row for row in table.select(["id", "vector", "text"]).to_pylist()}
    assert set(by_id) == {chunk.id for chunk in chunks}
    reference = reference_model().encode([chunk.text for chunk in chunks])
    ours = np.array([by_id[chunk.id]["vector"] for chunk in chunks], np.float32)
    cosines = _cosines(ours, reference)
    assert cosines.min() >= 0.999, f"worst cosine {cosines.min():.5f}"
    assert all(by_id[chunk.id]["text"] == chunk.text for chunk in chunks)


def parquet_settings(redis_url: str, sink: str, **overrides: Any) -> Settings:
    """The run's last shard is cut by time: 2 s, not the default 20, keeps the tests short."""
    return isolated_settings(redis_url, sink=sink, **({"parquet_shard_max_s": 2.0} | overrides))


# --- a fleet run into Parquet -------------------------------------------------------------------
async def _run(
    settings: Settings,
    chunks: list[Chunk],
    job: str,
    tmp_path: Path,
    then: Callable[[], Awaitable[None]] | None = None,
) -> tuple[ParquetSink, int]:
    """``chunks`` embedded by an in-process worker into ``settings``' Parquet sink, then
    ``then()`` while the worker still serves; returns the sink and the entries still pending
    once the job is done."""
    async with sink_fleet(settings, tmp_path) as fleet:
        sink = fleet.sink
        assert isinstance(sink, ParquetSink)
        async with fleet.run() as (producer, _):
            await producer.enqueue(chunks, job=job)
            progress = await producer.wait_for_job(job, timeout=600)
            assert progress.done == len(chunks)
            if then is not None:
                await then()
        pending = (await fleet.client.xpending(settings.keys.ingest, settings.group))["pending"]
    return sink, pending


async def test_a_run_lands_on_s3_as_a_dataset_pyarrow_reads_back(
    redis_server, s3_endpoint: str, tmp_path: Path
) -> None:
    # 400 chunks in shards of 100: four cut by rows, every row checked (the whole corpus took
    # three minutes of CI on a slow 2-core CPU, 1,000 in shards of 250 a minute: neither shows
    # more)
    chunks = list(builtin_corpus(400))
    prefix = f"{BUCKET}/run-{uuid.uuid4().hex[:8]}"
    settings = parquet_settings(
        redis_server.url,
        f"s3://{prefix}",
        s3_endpoint_url=s3_endpoint,
        parquet_shard_rows=100,
    )
    sink, pending = await _run(settings, chunks, "s3run", tmp_path)
    assert pending == 0
    assert sink.shards_written >= 4  # cut by rows (100), the last perhaps by the drain or timer
    s3 = s3_filesystem(s3_endpoint)
    table = read_dataset(prefix, s3)
    ids = Counter(table.column("id").to_pylist())
    assert len(ids) == len(chunks) and set(ids.values()) == {1}  # every id exactly once
    assert_parity(table, chunks)
    assert set(table.column("job").to_pylist()) == {"s3run"}
    metas = {row["id"]: json.loads(row["meta"]) for row in table.select(["id", "meta"]).to_pylist()}
    assert metas[chunks[0].id] == chunks[0].meta
    # the manifests account for every row, and each names a shard that is there
    import pyarrow.fs as pafs

    listing = s3.get_file_info(pafs.FileSelector(prefix, recursive=True))
    files = {info.path.removeprefix(prefix + "/") for info in listing if info.is_file}
    manifests = [
        json.loads(s3.open_input_stream(f"{prefix}/{f}").read())
        for f in files
        if f.startswith(MANIFESTS)
    ]
    assert sum(m["rows"] for m in manifests) == len(chunks)
    assert {m["file"] for m in manifests} == {f for f in files if f.endswith(".parquet")}
    assert {(m["dim"], m["dtype"]) for m in manifests} == {(384, "float16")}


async def test_a_worker_killed_mid_shard_loses_nothing_and_leaves_no_partial_file(
    redis_server, s3_endpoint: str, tmp_path: Path
) -> None:
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    chunks = list(builtin_corpus(600))
    prefix = f"{BUCKET}/kill-{uuid.uuid4().hex[:8]}"
    # shards of 150 rows or 1.5 s, whichever first; entries idle 4 s are reclaimed
    common: dict[str, Any] = {
        "s3_endpoint_url": s3_endpoint,
        "parquet_shard_rows": 150,
        "parquet_shard_max_s": 1.5,
        "reclaim_idle_ms": 4000,
    }
    settings = parquet_settings(redis_server.url, f"s3://{prefix}", **common)
    launcher = WorkerLauncher(settings, shared_encoder, tmp_path)
    env = {
        "EMBEDFLEET_SINK": settings.sink,
        "EMBEDFLEET_S3_ENDPOINT_URL": s3_endpoint,
        "EMBEDFLEET_PARQUET_SHARD_ROWS": "150",
        "EMBEDFLEET_PARQUET_SHARD_MAX_S": "1.5",
        "EMBEDFLEET_RECLAIM_IDLE_MS": "4000",
        # the eager model: what is asserted is what a kill loses, not a forward path, so its
        # start builds and times no frozen or int8 copy (CI's CPU seconds)
        "EMBEDFLEET_FROZEN_QUERIES": "false",
    }
    s3 = s3_filesystem(s3_endpoint)
    client = connect(settings.effective_redis_url)
    try:
        async with Producer(settings, client) as producer:
            await producer.enqueue(chunks, job="kill")
            doomed = launcher.process("doomed", settings, **env)
            try:
                # the first shard is stored (its manifest is there) and the next is filling
                await _until_manifest(s3, prefix, doomed)
                await _until_logged(doomed, "parquet shard started", times=2)
                doomed.send_signal(signal.SIGKILL)
                doomed.wait(30)
            finally:
                doomed.stop()
            held = await client.xpending_range(
                settings.keys.ingest, settings.group, "-", "+", 10_000, consumername="doomed"
            )
            summary = await client.xpending(settings.keys.ingest, settings.group)
            assert held, f"the killed worker held no entries: {summary}; {doomed.log()[-3000:]}"
            # another worker claims what the dead one held, once idle, and finishes the job
            survivor = settings.model_copy(update={"consumer": "survivor"})
            sink = build_sink(survivor, client)
            async with launcher.run(survivor, sink=sink, client=client):
                progress = await producer.wait_for_job("kill", timeout=600)
            assert progress.done == len(chunks)
        assert (await client.xpending(settings.keys.ingest, settings.group))["pending"] == 0
    finally:
        await client.aclose()
    # no partial file: everything under the prefix is a readable shard or a manifest
    listing = s3.get_file_info(pafs.FileSelector(prefix, recursive=True))
    files = [info.path for info in listing if info.is_file]
    shards = [path for path in files if path.endswith(".parquet")]
    assert all(
        path.endswith(".parquet") or (f"/{MANIFESTS}/" in path and path.endswith(".json"))
        for path in files
    ), files
    assert all(pq.read_metadata(path, filesystem=s3).num_rows > 0 for path in shards)
    # nothing lost: every id is in the dataset; the reader keeps exactly one row per id
    table = read_dataset(prefix, s3)
    assert set(table.column("id").to_pylist()) == {chunk.id for chunk in chunks}
    with open_backend(parse_sink_url(settings.sink, s3_endpoint_url=s3_endpoint)) as backend:
        exported = backend.export_rows()
    assert sorted(row.id for row in exported) == sorted(chunk.id for chunk in chunks)
    # entries held only in the dead worker's buffer were embedded by the survivor
    assert any("survivor" in path for path in shards)


async def _until_manifest(s3: Any, prefix: str, worker: Any, timeout: float = 300) -> None:
    """Until a manifest is stored under ``prefix`` (the store's state, polled)."""
    import pyarrow.fs as pafs

    async with asyncio.timeout(timeout):
        while True:
            selector = pafs.FileSelector(f"{prefix}/{MANIFESTS}", allow_not_found=True)
            if any(info.is_file for info in s3.get_file_info(selector)):
                return
            if worker.poll() is not None:
                raise AssertionError(f"worker exited: {worker.log()}")
            await asyncio.sleep(0.05)


async def _until_logged(worker: Any, event: str, times: int, timeout: float = 120) -> None:
    """Until the worker's JSON log holds ``event`` ``times`` times (its log is its events)."""
    async with asyncio.timeout(timeout):
        while sum(f'"{event}"' in line for line in worker.log().splitlines()) < times:
            if worker.poll() is not None:
                raise AssertionError(f"worker exited: {worker.log()}")
            await asyncio.sleep(0.05)


async def test_a_run_lands_in_a_local_folder_and_the_cli_reads_it(
    redis_server, tmp_path: Path
) -> None:
    chunks = list(builtin_corpus(300))
    root = tmp_path / "run"
    settings = parquet_settings(redis_server.url, f"parquet://{root}", parquet_shard_rows=100)
    env = cli_env(settings, EMBEDFLEET_SINK=settings.sink)
    texts = Counter(chunk.text for chunk in chunks)
    wanted = next(chunk for chunk in chunks if texts[chunk.text] == 1 and len(chunk.text) > 80)

    async def search() -> None:
        # `embedfleet search` reads the same setting; a running worker embeds the query
        process = await start_cli(env, "search", wanted.text, "--k", "3", "--json")
        stdout, stderr = await asyncio.wait_for(process.communicate(), 300)
        assert process.returncode == 0, stderr.decode()
        hits = [json.loads(line) for line in stdout.decode().splitlines()]
        assert hits[0]["id"] == wanted.id and hits[0]["text"] == wanted.text
        assert hits[0]["score"] > 0.99

    sink, pending = await _run(settings, chunks, "local", tmp_path, then=search)
    assert pending == 0 and sink.shards_written >= 3
    table = read_dataset(str(root))
    ids = Counter(table.column("id").to_pylist())
    assert len(ids) == len(chunks) and set(ids.values()) == {1}
    assert_parity(table, chunks)
    assert not [p for p in root.iterdir() if p.name.endswith(".tmp")]
    # the docs' one line: the folder, as it is, into a LanceDB table
    import lancedb

    lance = lancedb.connect(str(tmp_path / "lance"))
    loaded = lance.create_table("embeddings", read_dataset(str(root)))
    assert loaded.count_rows() == len(chunks)
    # `embedfleet results` reads the same setting
    out = tmp_path / "out.npz"
    done = forks.run(["results", "--out", str(out), "--json"], env=env, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["vectors"] == len(chunks)
    exported = np.load(out)
    by_id = {row["id"]: row["vector"] for row in table.select(["id", "vector"]).to_pylist()}
    first = str(exported["ids"][0])
    assert np.allclose(exported["vectors"][0], np.asarray(by_id[first], np.float16))
