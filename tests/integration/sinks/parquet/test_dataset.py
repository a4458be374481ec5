"""The Parquet layout on a real folder: shards stored atomically (a writer that dies before
its rename leaves nothing visible), one manifest per shard, one row per id read back (the last
wins), the settings checked against each other. The fleet runs into Parquet, on S3 and in a
folder, are in tests/integration/sinks/parquet/test_sink.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from embedfleet.shared.protocol import Result
from embedfleet.shared.settings import SettingsError, load_settings
from embedfleet.sinks import open_backend, parse_sink_url
from embedfleet.sinks.parquet import STALE_TEMPORARY_S, ParquetBackend


def read_dataset(path: str) -> Any:
    """The folder as a user's tool reads it: ``pyarrow.dataset`` on the directory, as it is."""
    import pyarrow.dataset as ds

    return ds.dataset(path, format="parquet").to_table()


def _results(count: int, dim: int = 8) -> list[Result]:
    rng = np.random.default_rng(5)
    return [
        Result(
            id=f"r{i:03d}",
            model="m",
            vector=rng.standard_normal(dim).astype(np.float16),
            job="j",
            meta={"i": i},
            text=f"text {i}",
        )
        for i in range(count)
    ]


def test_a_shard_write_that_dies_before_its_rename_leaves_nothing_visible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "run"
    backend = open_backend(parse_sink_url(f"parquet://{root}"))
    assert isinstance(backend, ParquetBackend)
    backend.setup("m", 8)
    backend.upsert(_results(10))
    assert len(backend.shard_files()) == 1

    # the process "dies" after the bytes are written and fsynced, before the rename
    def crash(source: str, destination: str) -> None:
        raise KeyboardInterrupt("killed between write and rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        backend.upsert(_results(20)[10:])
    monkeypatch.undo()
    # what the dead writer left is a hidden temporary file, complete or not
    leftovers = [p.name for p in root.iterdir() if p.name.endswith(".tmp")]
    assert len(leftovers) == 1 and leftovers[0].startswith(".")
    (root / leftovers[0]).write_bytes(b"PAR1 torn")  # as a write cut short would leave it
    # the dataset as tools load it, and our reader, see only the first, complete shard
    assert sorted(read_dataset(str(root)).column("id").to_pylist()) == [
        f"r{i:03d}" for i in range(10)
    ]
    assert [row.id for row in backend.export_rows()] == [f"r{i:03d}" for i in range(10)]
    assert len(backend.manifests()) == 1  # the manifest comes only after its shard
    # the next shard goes in whole, with its manifest, and no temporary file of its own
    backend.upsert(_results(20)[10:])
    assert len(backend.shard_files()) == 2
    assert [m.rows for m in backend.manifests()] == [10, 10]
    assert len([p for p in root.iterdir() if p.name.endswith(".tmp")]) == 1
    assert read_dataset(str(root)).num_rows == 20
    # the next writer to start there removes it once it is old enough to have no writer left
    stale = root / leftovers[0]
    backend.setup("m", 8)
    assert stale.exists()  # fresh: a live writer may be about to rename it
    old = stale.stat().st_mtime - STALE_TEMPORARY_S - 1
    os.utime(stale, (old, old))
    open_backend(parse_sink_url(f"parquet://{root}")).setup("m", 8)
    assert not stale.exists() and read_dataset(str(root)).num_rows == 20


def test_the_reader_keeps_the_last_row_per_id(tmp_path: Path) -> None:
    backend = open_backend(parse_sink_url(f"parquet://{tmp_path / 'run'}"))
    assert isinstance(backend, ParquetBackend)
    backend.setup("m", 8)
    first = _results(5)
    backend.upsert(first)
    again = [Result(id="r002", model="m", vector=np.ones(8, np.float16), job="k", text="new")]
    backend.upsert(again)  # a redelivery after a crash: the same id in a later shard
    assert read_dataset(str(tmp_path / "run")).num_rows == 6  # the raw dataset holds both
    rows = {row.id: row for row in backend.export_rows()}
    assert sorted(rows) == [r.id for r in first]
    assert rows["r002"].text == "new" and rows["r002"].job == "k"
    assert np.array_equal(rows["r002"].vector, np.ones(8, np.float16))
    assert [row.id for row in backend.export_rows(job="k")] == ["r002"]


def test_another_dimension_or_precision_in_the_same_place_is_refused(tmp_path: Path) -> None:
    from embedfleet.sinks import SinkSetupError

    target = parse_sink_url(f"parquet://{tmp_path / 'run'}")
    with open_backend(target) as backend:
        backend.setup("m", 8, "float16")
        backend.upsert(_results(3))
    with pytest.raises(SinkSetupError, match="8-dim"), open_backend(target) as backend:
        backend.setup("m", 16)
    with pytest.raises(SinkSetupError, match="float16"), open_backend(target) as backend:
        backend.setup("m", 8, "int8")


def test_a_shard_time_bound_past_the_reclaim_idle_time_is_refused_at_start() -> None:
    with pytest.raises(SettingsError, match="EMBEDFLEET_PARQUET_SHARD_MAX_S=40"):
        load_settings(sink="s3://b/p", parquet_shard_max_s=40, reclaim_idle_ms=60_000)
    # the same bound is fine with another sink, and within half of the idle time
    load_settings(sink="redis", parquet_shard_max_s=40, reclaim_idle_ms=60_000)
    load_settings(sink="parquet:///tmp/x", parquet_shard_max_s=30, reclaim_idle_ms=60_000)


def test_parquet_sink_urls() -> None:
    local = parse_sink_url("parquet:///data/run")
    assert (local.kind, local.location) == ("parquet", "/data/run")
    s3 = parse_sink_url("s3://bucket/some/prefix/", s3_endpoint_url="http://minio:9000")
    assert (s3.kind, s3.location, s3.endpoint_url) == (
        "parquet",
        "s3://bucket/some/prefix",
        "http://minio:9000",
    )
    assert "s3://bucket/some/prefix" in s3.describe()


# --- the sink's buffering: acknowledged only once the shard is stored ---------------------------
async def _pending_deliveries(client: Any, settings: Any, count: int) -> list[Any]:
    """``count`` entries read through the group and not acknowledged: what a worker holds."""
    from embedfleet.sinks import Delivery

    keys = settings.keys
    await client.xgroup_create(keys.ingest, keys.group, id="0", mkstream=True)
    for n in range(count):
        await client.xadd(keys.ingest, {"p": f"chunk {n}"})
    read = await client.xreadgroup(keys.group, "w", {keys.ingest: ">"}, count=count)
    return [Delivery(keys.ingest, entry_id.decode(), "j") for entry_id, _ in read[0][1]]


async def _pending(client: Any, settings: Any) -> int:
    return int((await client.xpending(settings.keys.ingest, settings.keys.group))["pending"])


def _sink(settings: Any, client: Any, root: Path, **bounds: Any) -> Any:
    from embedfleet.sinks.parquet import ParquetSink

    backend = open_backend(parse_sink_url(f"parquet://{root}"))
    assert isinstance(backend, ParquetBackend)
    limits = {"shard_rows": 10, "shard_bytes": 1 << 20, "shard_max_s": 3600.0} | bounds
    return ParquetSink(client, settings.keys, backend, writer="w", **limits)


async def test_the_sink_acknowledges_a_shard_only_once_it_is_stored(
    settings: Any, client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from embedfleet.sinks.parquet import ObjectStoreUnavailable

    deliveries = await _pending_deliveries(client, settings, 10)
    results = _results(10)
    sink = _sink(settings, client, tmp_path / "run")
    await sink.setup("m", 8)
    await sink.write(results[:6], deliveries[:6])
    # buffered: nothing stored, nothing acknowledged
    assert sink.buffered == 6 and await _pending(client, settings) == 10
    assert not sink.parquet.shard_files()
    # the store fails as the shard fills: the write raises, nothing is acknowledged
    real = sink.parquet.write_shard

    def unavailable(*args: Any) -> Any:
        raise ObjectStoreUnavailable("the store is away")

    monkeypatch.setattr(sink.parquet, "write_shard", unavailable)
    with pytest.raises(ObjectStoreUnavailable):
        await sink.write(results[6:], deliveries[6:])
    assert await _pending(client, settings) == 10 and not sink.parquet.shard_files()
    # the worker tries the same write again: its rows are buffered once, stored, acknowledged
    monkeypatch.setattr(sink.parquet, "write_shard", real)
    await sink.write(results[6:], deliveries[6:])
    assert await _pending(client, settings) == 0
    assert await client.xlen(settings.keys.ingest) == 0  # acknowledged entries are deleted
    assert int(await client.hget(settings.keys.job("j"), "done") or 0) == 10
    assert [m.rows for m in sink.parquet.manifests()] == [10]
    await sink.close()


async def test_the_sink_stores_a_shard_by_time_and_on_close(
    settings: Any, client: Any, tmp_path: Path
) -> None:
    deliveries = await _pending_deliveries(client, settings, 5)
    sink = _sink(settings, client, tmp_path / "run", shard_max_s=0.2)
    await sink.setup("m", 8)
    await sink.write(_results(5)[:3], deliveries[:3])
    # the timer cuts the shard once its first row is 0.2 s old, with no write to prompt it
    async with asyncio.timeout(30):
        while await _pending(client, settings) != 2:
            await asyncio.sleep(0.02)  # polling the server's state: the timer emits nothing
    await sink.write(_results(5)[3:], deliveries[3:])
    await sink.close()  # a drain: the last shard is stored before the worker exits
    assert await _pending(client, settings) == 0
    assert [m.rows for m in sink.parquet.manifests()] == [3, 2]


async def test_writes_while_a_shard_is_being_stored_go_into_the_next_one(
    settings: Any, client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    deliveries = await _pending_deliveries(client, settings, 12)
    results = _results(12)
    sink = _sink(settings, client, tmp_path / "run", shard_rows=4)
    await sink.setup("m", 8)
    real = sink.parquet.write_shard
    storing, release = threading.Event(), threading.Event()

    def slow_store(*args: Any) -> Any:
        storing.set()
        release.wait(30)  # an upload in progress, held until the test has written more
        return real(*args)

    monkeypatch.setattr(sink.parquet, "write_shard", slow_store)
    first = asyncio.create_task(sink.write(results[:4], deliveries[:4]))  # fills shard 1
    await asyncio.to_thread(storing.wait, 30)
    await sink.write(results[4:6], deliveries[4:6])  # while shard 1 uploads
    assert sink.buffered == 2
    monkeypatch.setattr(sink.parquet, "write_shard", real)
    release.set()
    await first
    assert await _pending(client, settings) == 8  # shard 1's four, and only those
    await sink.write(results[6:], deliveries[6:])
    await sink.close()
    assert await _pending(client, settings) == 0
    stored = sorted(row.id for row in sink.parquet.export_rows())
    assert stored == [r.id for r in results]  # every row acknowledged was stored
    assert read_dataset(str(tmp_path / "run")).num_rows == 12


async def test_the_sink_holds_its_entries_for_their_leases_until_their_shard_is_acknowledged(
    settings: Any, client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40: a shard waiting out an outage keeps its entries' leases. The worker's in-flight
    set, which the reclaimer renews and leaves out of its claims, has what the sink holds."""
    from embedfleet.sinks.parquet import ObjectStoreUnavailable
    from embedfleet.workers.reclaim import InFlight

    deliveries = await _pending_deliveries(client, settings, 6)
    sink = _sink(settings, client, tmp_path / "run", shard_rows=6)
    in_flight = InFlight(sink)
    await sink.setup("m", 8)
    await sink.write(_results(6)[:3], deliveries[:3])  # buffered
    stream = settings.keys.ingest
    assert sorted(in_flight.snapshot()[stream]) == sorted(d.entry_id for d in deliveries[:3])
    assert in_flight.holds(stream, deliveries[0].entry_id) and len(in_flight) == 0

    def unavailable(*args: Any) -> Any:
        raise ObjectStoreUnavailable("the store is away")

    monkeypatch.setattr(sink.parquet, "write_shard", unavailable)
    with pytest.raises(ObjectStoreUnavailable):
        await sink.write(_results(6)[3:], deliveries[3:])  # the shard is full: not stored
    assert sorted(in_flight.snapshot()[stream]) == sorted(d.entry_id for d in deliveries)
    monkeypatch.undo()
    await sink.flush()  # the store is back: stored, acknowledged, no longer held
    assert in_flight.snapshot() == {} and not in_flight.holds(stream, deliveries[0].entry_id)
    assert await _pending(client, settings) == 0
    await sink.close()


def test_a_full_disk_is_waited_out_and_its_failed_shard_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40: a shard write that fails removes its ``.tmp`` at once (each try has a name of
    its own: they piled up until the next start's 15-minute sweep), and a full disk is an
    outage of the store (waited out), not a fault of the worker."""
    import errno

    from embedfleet.shared.fault_kinds import FaultKind, System, classify
    from embedfleet.sinks.parquet import ObjectStoreUnavailable

    root = tmp_path / "run"
    backend = open_backend(parse_sink_url(f"parquet://{root}"))
    assert isinstance(backend, ParquetBackend)
    backend.setup("m", 8)
    real_fsync = os.fsync

    def disk_full(descriptor: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", disk_full)  # the bytes do not fit when flushed
    for _ in range(3):
        with pytest.raises(ObjectStoreUnavailable) as failed:
            backend.upsert(_results(10))
        assert classify(failed.value, System.PARQUET).kind is FaultKind.TRANSIENT
    assert [p.name for p in root.iterdir() if p.name.endswith(".tmp")] == []
    monkeypatch.setattr(os, "fsync", real_fsync)
    backend.upsert(_results(10))
    assert read_dataset(str(root)).num_rows == 10
    assert [p.name for p in root.iterdir() if p.name.endswith(".tmp")] == []


def test_a_store_that_cannot_be_reached_is_waited_for_and_a_bad_shard_is_no_bad_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pyarrow as pa

    from embedfleet.shared.fault_kinds import FaultKind, System, classify
    from embedfleet.sinks import SinkSetupError
    from embedfleet.sinks.parquet import storage_error
    from embedfleet.workers.outages import classify_sink_error

    for name, value in {"AWS_ACCESS_KEY_ID": "t", "AWS_SECRET_ACCESS_KEY": "t"}.items():
        monkeypatch.setenv(name, value)
    with socket_closed() as port:
        target = parse_sink_url("s3://bucket/run", s3_endpoint_url=f"http://127.0.0.1:{port}")
        with pytest.raises(SinkSetupError) as refused, open_backend(target) as backend:
            backend.setup("m", 8)
    # the worker waits for an object store that is not up yet, as for a database
    assert classify_sink_error(refused.value, System.PARQUET).kind is FaultKind.TRANSIENT
    # pyarrow's ArrowInvalid is a ValueError: failing to store a shard must not read as one
    # refused row (the worker would dead-letter the batch at hand)
    error = storage_error(pa.ArrowInvalid("bad footer"), "writing a shard")
    assert classify(error, System.PARQUET).kind is FaultKind.WORKER


@contextlib.contextmanager
def socket_closed() -> Iterator[int]:
    """A loopback port nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        yield int(probe.getsockname()[1])  # bound, not listening: connections are refused
