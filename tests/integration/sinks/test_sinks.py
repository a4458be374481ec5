"""Every sink against the real thing: Redis, LanceDB, PostgreSQL + pgvector, Qdrant local mode.

Per backend, a real worker embeds the same chunks twice (same ids; one text and one meta
changed the second time). The database must then hold exactly one row per id, with the new
vector, the metadata passed through and the job counters advanced; nearest-neighbour search
must find the chunk a query was made from. The rows are read back with each database's own
client, not through the code under test.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from embedfleet.producer import Producer
from embedfleet.producer.chunker import builtin_corpus
from embedfleet.server import isolated_settings
from embedfleet.shared.jobs import JobProgress
from embedfleet.shared.protocol import PAYLOAD_FIELD, Chunk, Result, decode_result
from embedfleet.shared.redis_conn import connect
from embedfleet.shared.settings import Settings
from embedfleet.sinks import (
    Hit,
    Sink,
    SinkSetupError,
    SinkTarget,
    SinkURLError,
    StoredVector,
    VectorDBError,
    build_sink,
    local_sink_url,
    meta_to_json,
    open_backend,
    parse_sink_url,
    sink_for_target,
)
from embedfleet.sinks.pgvector import vector_type_for
from embedfleet.sinks.qdrant import point_id
from tests import forks
from tests.conftest import (
    WorkerLauncher,
    reference_model,
    require_slow_tier,
    running_pg,
    shared_encoder,
    worker_env,
)

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = pytest.mark.slow

BACKENDS = ["redis", "lancedb", "pgvector", "pgvector-vector", "qdrant-local"]
DATABASES = [b for b in BACKENDS if b != "redis"]
CHANGED = 5  # the chunk whose text and meta change in the second round
NEW_TEXT = "A recipe: boil the pasta for nine minutes, then stir in the tomato sauce and basil."
COUNT = 30


def first_round() -> list[Chunk]:
    chunks = []
    for n, chunk in enumerate(builtin_corpus(COUNT)):
        meta = None if n == 7 else {**(chunk.meta or {}), "tags": ["a", "b"], "note": "café"}
        chunks.append(Chunk(id=chunk.id, text=chunk.text, meta=meta))
    return chunks


def second_round(first: list[Chunk]) -> list[Chunk]:
    second = list(first)
    second[CHANGED] = Chunk(id=first[CHANGED].id, text=NEW_TEXT, meta={"changed": True})
    return second


@dataclass
class Loaded:
    backend: str
    settings: Settings
    target: SinkTarget
    first: list[Chunk]
    final: list[Chunk]
    progress: list[JobProgress]
    pending: int
    ingest_left: int


def _sink(backend: str, settings: Settings, client: Any) -> Sink:
    if backend == "pgvector-vector":  # what a pgvector < 0.7 server gets: full-precision vector
        target = parse_sink_url(settings.sink, settings.sink_table)
        return sink_for_target(target, settings, client, dtype="float32")
    return build_sink(settings, client)


# --- the read side, through each database's backend ------------------------------------------
def nearest(target: SinkTarget, vector: np.ndarray, k: int = 10) -> list[Hit]:
    with open_backend(target) as backend:
        return backend.nearest(vector, k)


def build_index(target: SinkTarget, *, force: bool = False) -> list[str]:
    with open_backend(target) as backend:
        return backend.build_index(force=force)


def stored_vectors(target: SinkTarget, job: str | None = None) -> list[StoredVector]:
    with open_backend(target) as backend:
        return backend.export_rows(job)


def _sink_url(backend: str, request: pytest.FixtureRequest, tmp: Path) -> str:
    # the PostgreSQL server starts only for the tests that use it
    pg = None
    if backend.startswith("pgvector"):
        pg = running_pg(request.getfixturevalue("pg_session_server")).get_uri()
    return local_sink_url(backend, tmp, pg)


@pytest.fixture(scope="module", params=BACKENDS)
async def loaded(
    request: pytest.FixtureRequest, redis_server, encoder, tmp_path_factory
) -> AsyncIterator[Loaded]:
    backend: str = request.param
    settings = isolated_settings(
        redis_server.url,
        consumer="sink-test",
        sink=_sink_url(backend, request, tmp_path_factory.mktemp(backend)),
        sink_table=f"emb_{uuid.uuid4().hex[:8]}",
    )
    first = first_round()
    final = second_round(first)
    client = connect(settings.effective_redis_url)
    progress = []
    sink = _sink(backend, settings, client)
    workers = WorkerLauncher(settings, shared_encoder, tmp_path_factory.mktemp("workers"))
    async with (
        Producer(settings, client) as producer,
        workers.run(settings, sink=sink, client=client),
    ):
        # one round at a time: the second must overwrite rows the first wrote durably
        for job, chunks in (("round1", first), ("round2", final)):
            await producer.enqueue(chunks, job=job)
            progress.append(await producer.wait_for_job(job, timeout=120))
    pending = (await client.xpending(settings.keys.ingest, settings.group))["pending"]
    ingest_left = await client.xlen(settings.keys.ingest)
    target = parse_sink_url(settings.sink, settings.sink_table)
    yield Loaded(backend, settings, target, first, final, progress, pending, ingest_left)
    await client.aclose()


@pytest.fixture(scope="module")
def reference(encoder) -> tuple[np.ndarray, np.ndarray]:
    """sentence-transformers' vectors of the final texts, and of the changed chunk's first text."""

    model = reference_model()
    first = first_round()
    return model.encode([c.text for c in second_round(first)]), model.encode([first[CHANGED].text])


# --- reading each backend with its own client -------------------------------------------------
def _rows(loaded: Loaded) -> list[dict[str, Any]]:
    """Every stored row as {id, vector (float32), job, model, truncated, meta, text}."""
    target = loaded.target
    if target.kind == "lancedb":
        import lancedb

        table = lancedb.connect(target.location).open_table(target.table).to_arrow()
        return [
            {**row, "vector": np.asarray(row["vector"], np.float32), "meta": _json(row["meta"])}
            for row in table.to_pylist()
        ]
    if target.kind == "pgvector":
        import psycopg

        with psycopg.connect(target.location) as conn:
            rows = conn.execute(
                f"SELECT id, embedding::text, job, model, truncated, meta, text FROM {target.table}"
            ).fetchall()
        return [
            {
                "id": r[0],
                "vector": np.asarray(json.loads(r[1]), np.float32),
                "job": r[2],
                "model": r[3],
                "truncated": r[4],
                "meta": r[5],
                "text": r[6],
            }
            for r in rows
        ]
    from qdrant_client import QdrantClient

    qdrant = QdrantClient(path=target.location)
    try:
        points, _ = qdrant.scroll(target.table, limit=1000, with_payload=True, with_vectors=True)
    finally:
        qdrant.close()
    rows = []
    for point in points:
        assert point.payload is not None
        assert point.id == point_id(point.payload["id"])  # the deterministic point id
        rows.append({**point.payload, "vector": np.asarray(point.vector, np.float32)})
    return rows


def _json(text: str | None) -> Any:
    return None if text is None else json.loads(text)


async def _stream_results(loaded: Loaded) -> list[dict[str, Any]]:
    client = connect(loaded.settings.effective_redis_url)
    try:
        entries = await client.xrange(loaded.settings.keys.results)
    finally:
        await client.aclose()
    results = [decode_result(fields[PAYLOAD_FIELD]) for _, fields in entries]
    return [
        {
            "id": r.id,
            "vector": r.vector.astype(np.float32),
            "job": r.job,
            "model": r.model,
            "truncated": r.truncated,
            "meta": r.meta,
        }
        for r in results
    ]


def _cosines(ours: np.ndarray, reference: np.ndarray) -> np.ndarray:
    return (ours * reference).sum(1) / (
        np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1)
    )


# --- the tests ----------------------------------------------------------------------------------
async def test_upserts_keep_one_row_per_id_with_the_latest_vector(
    loaded: Loaded, reference: tuple[np.ndarray, np.ndarray], encoder
) -> None:
    assert [(p.enqueued, p.done, p.dead) for p in loaded.progress] == [(COUNT, COUNT, 0)] * 2
    assert loaded.pending == 0 and loaded.ingest_left == 0  # acknowledged and deleted
    if loaded.backend == "redis":
        # an append-only stream: each round appends every id once; readers keep the last
        entries = await _stream_results(loaded)
        assert sorted(e["id"] for e in entries) == sorted(c.id for c in loaded.final * 2)
        latest = {e["id"]: e for e in entries}
        rows = list(latest.values())
    else:
        rows = _rows(loaded)
        ids = [row["id"] for row in rows]
        assert len(ids) == len(set(ids)) == COUNT, "exactly one row per id"
    by_id = {row["id"]: row for row in rows}
    assert set(by_id) == {c.id for c in loaded.final}

    final_reference, first_reference = reference
    ours = np.stack([by_id[c.id]["vector"] for c in loaded.final])
    cosines = _cosines(ours, final_reference)
    print(f"{loaded.backend}: min cosine vs sentence-transformers {cosines.min():.6f}")
    assert cosines.min() >= 0.999
    # the changed chunk really holds the new text's vector, not the first round's
    assert _cosines(ours[CHANGED : CHANGED + 1], first_reference)[0] < 0.9

    for chunk in loaded.final:
        row = by_id[chunk.id]
        assert row["meta"] == chunk.meta, chunk.id
        assert row["job"] == "round2" and row["model"] == encoder.name
        assert row["truncated"] is False
        if loaded.backend != "redis":  # databases keep the text beside the vector
            assert row["text"] == chunk.text, chunk.id


async def test_search_finds_the_chunk_a_query_was_made_from(loaded: Loaded, encoder) -> None:
    if loaded.backend == "redis":
        with pytest.raises(VectorDBError, match="EMBEDFLEET_SINK is `redis`"):
            nearest(loaded.target, np.zeros(encoder.dim, np.float32))
        return
    probe = loaded.final[12]
    hits = nearest(loaded.target, encoder.embed_texts([probe.text])[0], k=3)
    assert [h.id for h in hits][:1] == [probe.id]
    assert hits[0].score > 0.99 and hits[0].meta == probe.meta and hits[0].job == "round2"
    assert len(hits) == 3 and hits[0].score >= hits[1].score >= hits[2].score
    # a paraphrase finds the chunk whose text changed: the search sees the upserted vector
    pasta = nearest(loaded.target, encoder.embed_texts(["how long to cook pasta"])[0], k=1)
    assert pasta[0].id == loaded.final[CHANGED].id and pasta[0].meta == {"changed": True}


async def test_search_embeds_the_query_through_the_priority_lane(
    workers: WorkerLauncher, loaded: Loaded, encoder
) -> None:
    from embedfleet.ops.search import format_hits, search

    client = connect(loaded.settings.effective_redis_url)
    query = "boiling pasta in tomato sauce"
    try:
        # queries are answered on reply keys, whatever sink the bulk results go to
        async with workers.run(loaded.settings):
            if loaded.backend == "redis":
                with pytest.raises(VectorDBError, match="EMBEDFLEET_SINK is `redis`"):
                    await search(loaded.settings, loaded.target, query, 2, 30)
                return
            hits = await search(loaded.settings, loaded.target, query, 2, 30)
    finally:
        await client.aclose()
    assert hits[0].id == loaded.final[CHANGED].id
    lines = format_hits(hits, as_json=True)
    assert len(lines) == 2
    best = json.loads(lines[0])
    assert best["id"] == loaded.final[CHANGED].id and best["text"] == NEW_TEXT  # the full text
    assert best["meta"] == {"changed": True} and 0.3 < best["score"] <= 1
    # for people: score, id, a one-line snippet of the text, meta
    line = format_hits(hits)[0]
    assert line.startswith(f"{hits[0].score:6.3f}  {hits[0].id}")
    assert "A recipe: boil the pasta for nine minutes, then stir in the tomato" in line
    assert line.rstrip().endswith('{"changed": true}') and "\n" not in line


async def test_stored_vectors_exports_one_per_id(loaded: Loaded) -> None:
    if loaded.backend == "redis":
        with pytest.raises(VectorDBError, match="EMBEDFLEET_SINK is `redis`"):
            stored_vectors(loaded.target)
        return
    stored = stored_vectors(loaded.target, job="round2")
    assert sorted(s.id for s in stored) == sorted(c.id for c in loaded.final)
    assert all(s.vector.dtype == np.float16 and s.vector.shape == (384,) for s in stored)
    assert stored_vectors(loaded.target, job="round1") == []  # every row was overwritten


@pytest.mark.parametrize("suffix", [".npz", ".jsonl"])
def test_results_out_exports_the_same_vectors_from_every_sink(
    loaded: Loaded, reference: tuple[np.ndarray, np.ndarray], tmp_path: Path, suffix: str
) -> None:
    """`embedfleet results --out` as a user runs it, whatever EMBEDFLEET_SINK is: one vector
    per id, the very vectors the sink holds (read back with the database's own client), and
    those are sentence-transformers' vectors of the final texts."""
    from click.testing import CliRunner

    from embedfleet.cli import main

    out = tmp_path / f"vectors{suffix}"
    env = {
        "EMBEDFLEET_REDIS_URL": loaded.settings.effective_redis_url,
        "EMBEDFLEET_NAMESPACE": loaded.settings.namespace,
        "EMBEDFLEET_SINK": loaded.settings.sink,
        "EMBEDFLEET_SINK_TABLE": loaded.settings.sink_table,
    }
    ran = CliRunner().invoke(main, ["results", "--job", "round2", "--out", str(out)], env=env)
    assert ran.exit_code == 0, ran.output
    assert f"wrote {COUNT} vectors from" in ran.output
    if suffix == ".npz":
        with np.load(out) as exported:
            ids, vectors = list(exported["ids"]), exported["vectors"]
        assert vectors.dtype == np.float16
    else:
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        ids = [line["id"] for line in lines]
        vectors = np.asarray([line["vector"] for line in lines], np.float32)
    assert len(ids) == len(set(ids)) == COUNT and vectors.shape == (COUNT, 384)
    exported_by_id = dict(zip(ids, vectors.astype(np.float32), strict=True))

    if loaded.backend == "redis":
        held = {row["id"]: row["vector"] for row in asyncio_run(_stream_results(loaded))}
    else:
        held = {row["id"]: row["vector"] for row in _rows(loaded)}
    for chunk_id, vector in exported_by_id.items():
        # fp16 both sides (a float32 pgvector column holds fp16 values exactly)
        assert np.array_equal(vector, held[chunk_id].astype(np.float16).astype(np.float32))
    final_reference, _ = reference
    ours = np.stack([exported_by_id[c.id] for c in loaded.final])
    assert _cosines(ours, final_reference).min() >= 0.999


def test_results_out_of_a_database_with_nothing_written_says_so(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from embedfleet.cli import main

    env = {"EMBEDFLEET_SINK": f"lancedb://{tmp_path / 'empty'}", "EMBEDFLEET_SINK_TABLE": "none"}
    ran = CliRunner().invoke(main, ["results", "--out", str(tmp_path / "v.npz")], env=env)
    assert ran.exit_code == 1 and "have workers written there yet?" in ran.output


def asyncio_run(coroutine: Any) -> Any:
    import asyncio

    return asyncio.run(coroutine)


async def test_index_builds_and_search_still_finds_the_chunk(loaded: Loaded, encoder) -> None:
    if loaded.backend == "redis":
        with pytest.raises(VectorDBError, match="EMBEDFLEET_SINK is `redis`"):
            build_index(loaded.target)
        return
    done = build_index(loaded.target, force=True)
    target = loaded.target
    if target.kind == "lancedb":
        import lancedb

        table = lancedb.connect(target.location).open_table(target.table)
        assert {tuple(i.columns) for i in table.list_indices()} == {("id",), ("vector",)}
        assert "under 100,000 rows" in build_index(target)[1]  # without --force: explained
    elif target.kind == "pgvector":
        import psycopg

        with psycopg.connect(target.location) as conn:
            (indexdef,) = conn.execute(
                "SELECT indexdef FROM pg_indexes WHERE tablename = %s AND indexdef LIKE %s",
                (target.table, "%hnsw%"),
            ).fetchone()
        expected = "halfvec" if loaded.backend == "pgvector" else "vector"
        assert f"{expected}_cosine_ops" in indexdef, indexdef
    else:
        from qdrant_client import QdrantClient

        qdrant = QdrantClient(path=target.location)
        try:
            config = qdrant.get_collection(target.table).config
        finally:
            qdrant.close()
        assert config.optimizer_config.indexing_threshold == 20_000, done
    probe = loaded.final[20]
    hits = nearest(target, encoder.embed_texts([probe.text])[0], k=1)
    assert hits[0].id == probe.id


async def test_worker_process_search_and_index_verbs_end_to_end(
    workers: WorkerLauncher, settings: Settings, client, tmp_path: Path
) -> None:
    """`embedfleet worker` with EMBEDFLEET_SINK, then `search` and `index` as a user runs them."""
    import signal

    sink = {"EMBEDFLEET_SINK": f"lancedb://{tmp_path / 'vectors'}"}
    chunks = first_round()[:12]
    # the eager model, its query and its documents alike: what is asserted is the verbs, not a
    # forward path, so no frozen or int8 copy is built and timed at start (CI's CPU seconds)
    worker = workers.process("e2e", settings, EMBEDFLEET_FROZEN_QUERIES="false", **sink)
    try:
        async with Producer(settings, client) as producer:
            await producer.enqueue(chunks, job="e2e")
            progress = await producer.wait_for_job("e2e", timeout=180)
        found = forks.run(
            ["search", chunks[3].text, "--k", "2", "--json"],
            text=True,
            env=worker_env(settings, **sink),
            timeout=120,
        )
    finally:
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(timeout=60)
        log = worker.log()
    assert progress.done == 12 and code == 0, log[-2000:]
    assert found.returncode == 0, found.stderr[-2000:]
    hits = [json.loads(line) for line in found.stdout.splitlines()]
    assert [h["id"] for h in hits][:1] == [chunks[3].id] and len(hits) == 2
    assert hits[0]["text"] == chunks[3].text  # --json carries the full stored text
    indexed = forks.run(["index"], text=True, env=worker_env(settings, **sink), timeout=120)
    assert indexed.returncode == 0 and "12 rows" in indexed.stdout, indexed.stderr[-2000:]


@pytest.mark.parametrize("backend", DATABASES)
async def test_a_table_of_another_dimension_is_refused_clearly(
    backend: str, request: pytest.FixtureRequest, redis_server, tmp_path: Path
) -> None:
    settings = Settings(
        redis_url=redis_server.url,
        sink=_sink_url(backend, request, tmp_path),
        sink_table=f"dim_{uuid.uuid4().hex[:8]}",
    )
    client = connect(settings.effective_redis_url)
    try:
        small = _sink(backend, settings, client)
        await small.setup("tiny-model", 8)
        await small.close()
        big = _sink(backend, settings, client)
        with pytest.raises(SinkSetupError, match=r"8\)?-dim|\(8\)") as raised:
            await big.setup("all-MiniLM-L6-v2", 384)
        await big.close()
    finally:
        await client.aclose()
    assert "EMBEDFLEET_SINK_TABLE" in str(raised.value)


def _database(
    backend: str, request: pytest.FixtureRequest, settings: Settings, tmp_path: Path
) -> Settings:
    """``settings`` with a fresh table of ``backend`` as the sink."""
    url = _sink_url(backend, request, tmp_path)
    return settings.model_copy(update={"sink": url, "sink_table": f"t_{uuid.uuid4().hex[:8]}"})


async def _write(sink: Sink, settings: Settings, client: Any, results: list[Result]) -> None:
    """``sink.write`` as the worker calls it, each result answering a real pending entry."""
    from embedfleet.shared.redis_conn import ensure_group
    from embedfleet.sinks import Delivery

    entry_ids = [await client.xadd(settings.keys.ingest, {"m": b"x"}) for _ in results]
    # delivered to a consumer, so pending: only pending entries are acknowledged and counted
    await ensure_group(client, settings.keys, settings.keys.ingest)
    await client.xreadgroup(settings.group, "sink-test", {settings.keys.ingest: ">"})
    deliveries = [
        Delivery(settings.keys.ingest, e.decode(), r.job)
        for e, r in zip(entry_ids, results, strict=True)
    ]
    await sink.write(results, deliveries)


@pytest.mark.parametrize("backend", DATABASES)
async def test_an_id_twice_in_one_batch_is_written_once_last_wins(
    backend: str, request: pytest.FixtureRequest, settings: Settings, client, tmp_path: Path
) -> None:
    settings = _database(backend, request, settings, tmp_path)
    sink = _sink(backend, settings, client)
    await sink.setup("tiny-model", 4)
    first, last = np.eye(4, dtype=np.float16)[0], np.eye(4, dtype=np.float16)[1]
    results = [
        Result(id="same", model="tiny-model", vector=first, job="j", meta={"v": 1}),
        Result(id="same", model="tiny-model", vector=last, job="j", meta={"v": 2}),
    ]
    await _write(sink, settings, client, results)
    await sink.close()
    stored = stored_vectors(parse_sink_url(settings.sink, settings.sink_table))
    assert [(s.id, s.meta) for s in stored] == [("same", {"v": 2})]
    assert np.array_equal(stored[0].vector, last)
    assert await client.hget(settings.keys.job("j"), "done") == b"2"  # both entries answered
    assert await client.xlen(settings.keys.ingest) == 0  # ... acknowledged and deleted


@pytest.mark.parametrize("backend", DATABASES)
async def test_texts_are_stored_unless_store_text_is_off(
    backend: str, request: pytest.FixtureRequest, settings: Settings, client, tmp_path: Path
) -> None:
    settings = _database(backend, request, settings, tmp_path)
    for store_text, chunk_id in ((True, "kept"), (False, "elsewhere")):
        sink = _sink(backend, settings.model_copy(update={"store_text": store_text}), client)
        await sink.setup("tiny-model", 4)
        vector = np.eye(4, dtype=np.float16)[0]
        result = Result(id=chunk_id, model="tiny-model", vector=vector, text="the chunk's text")
        await _write(sink, settings, client, [result])
        await sink.close()
    stored = stored_vectors(parse_sink_url(settings.sink, settings.sink_table))
    assert {row.id: row.text for row in stored} == {"kept": "the chunk's text", "elsewhere": None}


@pytest.mark.parametrize("backend", ["lancedb", "pgvector"])
async def test_a_table_from_before_texts_were_stored_gets_the_column(
    backend: str, request: pytest.FixtureRequest, settings: Settings, client, tmp_path: Path
) -> None:
    """Readers show no text for an old table; a worker's setup adds the column, then writes."""
    settings = _database(backend, request, settings, tmp_path)
    target = parse_sink_url(settings.sink, settings.sink_table)
    old = Result(id="old", model="tiny-model", vector=np.eye(4, dtype=np.float16)[0])
    if backend == "lancedb":  # the layout before the text column, written with lancedb itself
        import lancedb
        import pyarrow as pa

        from embedfleet.sinks.lancedb import lance_schema

        schema = lance_schema(4)
        schema = schema.remove(schema.get_field_index("text"))
        rows = {"id": ["old"], "vector": [old.vector.tolist()], "job": [None], "model": ["m"]}
        rows |= {"truncated": [False], "meta": [None]}
        lancedb.connect(target.location).create_table(target.table, pa.table(rows, schema=schema))
    else:
        import psycopg

        with psycopg.connect(target.location, autocommit=True) as conn:
            conn.execute(
                f"CREATE TABLE {target.table} (id text PRIMARY KEY, embedding halfvec(4) NOT NULL,"
                " job text, model text NOT NULL, truncated boolean NOT NULL DEFAULT false,"
                " meta jsonb, updated_at timestamptz NOT NULL DEFAULT now())"
            )
            conn.execute(
                f"INSERT INTO {target.table} (id, embedding, model) VALUES ('old', "
                "'[1,0,0,0]', 'm')"
            )
    assert [(row.id, row.text) for row in stored_vectors(target)] == [("old", None)]
    assert nearest(target, np.eye(4, dtype=np.float32)[0], 1)[0].text is None

    sink = _sink(backend, settings, client)
    await sink.setup("tiny-model", 4)
    new = Result(id="new", model="tiny-model", vector=np.eye(4, dtype=np.float16)[1], text="hi")
    await _write(sink, settings, client, [new])
    await sink.close()
    assert {row.id: row.text for row in stored_vectors(target)} == {"old": None, "new": "hi"}


@pytest.mark.parametrize("backend", DATABASES)
def test_a_row_the_table_cannot_take_is_named_in_a_value_error(
    backend: str, request: pytest.FixtureRequest, settings: Settings, tmp_path: Path
) -> None:
    """Quantized or truncated results (a chunk's dtype/dimensions options) are refused per row
    with a ValueError, the kind of fault that dead-letters the row and writes the others."""
    settings = _database(backend, request, settings, tmp_path)
    target = parse_sink_url(settings.sink, settings.sink_table)
    good = Result(id="good", model="m", vector=np.eye(4, dtype=np.float16)[0])
    codes = Result(id="codes", model="m", vector=np.zeros(4, np.int8), dtype="int8")
    short = Result(id="short", model="m", vector=np.ones(2, np.float16))
    with open_backend(target) as backend_:
        backend_.setup("m", 4, "float32" if backend == "pgvector-vector" else None)
        with pytest.raises(ValueError, match=r"row 'codes'.*int8"):
            backend_.upsert([good, codes])
        with pytest.raises(ValueError, match="row 'short' has 2 dimensions"):
            backend_.upsert([short, good])
        backend_.upsert([good])
        assert [row.id for row in backend_.export_rows()] == ["good"]


async def test_unknown_sink_scheme_is_a_clear_error(settings: Settings, client) -> None:
    with pytest.raises(SinkURLError, match="unknown sink scheme 'mongodb://'") as raised:
        build_sink(settings.model_copy(update={"sink": "mongodb://db:27017"}), client)
    for form in ("lancedb:///", "postgresql://", "qdrant://", "qdrant+local:///"):
        assert form in str(raised.value)
    with pytest.raises(SinkURLError, match="not a valid table name"):
        build_sink(
            settings.model_copy(update={"sink": "lancedb:///x", "sink_table": "a b"}), client
        )


def _cli_with_sink(sink: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``embedfleet ARGS`` run as a process of its own with EMBEDFLEET_SINK=``sink``."""
    env = {**os.environ, "EMBEDFLEET_SINK": sink}
    return forks.run(args, text=True, env=env, timeout=60)


def test_worker_and_search_refuse_bad_sinks_before_loading_anything() -> None:
    require_slow_tier("an `embedfleet worker` process")
    worker = _cli_with_sink("mongodb://db:27017", "worker")
    assert worker.returncode == 1 and "unknown sink scheme" in worker.stderr
    assert "Traceback" not in worker.stderr
    search = _cli_with_sink("redis", "search", "anything")
    assert search.returncode == 1 and "needs a vector database sink" in search.stderr


def test_pgvector_uses_halfvec_from_0_7() -> None:
    assert vector_type_for("0.6.2") == "vector"
    assert vector_type_for("0.7.0") == "halfvec"
    assert vector_type_for("0.10.1") == "halfvec"


def test_sink_urls() -> None:
    assert parse_sink_url("lancedb:///data/v").location == "/data/v"
    assert parse_sink_url("qdrant://q").location == "http://q:6333"
    cloud = parse_sink_url("https://:secret@x.cloud:6333")
    assert (cloud.kind, cloud.api_key, cloud.location) == (
        "qdrant",
        "secret",
        "https://x.cloud:6333",
    )
    assert "secret" not in cloud.describe()
    pg = parse_sink_url("postgres://u:pw@h/db")
    assert pg.kind == "pgvector" and "pw" not in pg.describe()
    assert parse_sink_url("qdrant+local:///tmp/q").kind == "qdrant-local"


def test_meta_that_json_cannot_hold_is_converted_not_fatal() -> None:
    text = meta_to_json({"raw": b"\x00\xff", "x": float("nan"), "deep": [{"k": b"a"}]})
    assert json.loads(text) == {"raw": "AP8=", "x": "nan", "deep": [{"k": "YQ=="}]}


@pytest.mark.parametrize("verb", ["search", "index"])
def test_search_and_index_explain_themselves(verb: str) -> None:
    from click.testing import CliRunner

    from embedfleet.cli import main

    result = CliRunner().invoke(main, [verb, "--help"])
    assert result.exit_code == 0 and "EMBEDFLEET_SINK" in result.output
