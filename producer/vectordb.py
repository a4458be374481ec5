"""Reading the vector databases the sinks write: nearest neighbours, index builds, exports.

The read side of ``workers.sinks`` (the layout is in ``shared.vectordb``). Everything here is
synchronous, since the client libraries are; async callers run it with ``asyncio.to_thread``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from embedfleet.shared.vectordb import SinkTarget, meta_from_json

if TYPE_CHECKING:
    import psycopg

# LanceDB: under this many rows a brute-force scan of fp16 vectors takes milliseconds and an
# approximate index would only cost recall; LanceDB's own guidance starts indexing around here.
LANCEDB_MIN_INDEX_ROWS = 100_000
# Qdrant's default: segments larger than this many KB of vectors get an HNSW graph.
QDRANT_INDEXING_THRESHOLD_KB = 20_000


class VectorDBError(RuntimeError):
    """The sink cannot be read as asked; the message says what to do."""


@dataclass(frozen=True)
class Hit:
    """One nearest neighbour: cosine similarity (1 = same direction) and what the sink stored."""

    id: str
    score: float
    job: str | None
    model: str | None
    truncated: bool
    meta: dict[str, Any] | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "score": round(self.score, 6),
            "job": self.job,
            "model": self.model,
            "truncated": self.truncated,
            "meta": self.meta,
        }


@dataclass(frozen=True)
class StoredVector:
    id: str
    vector: np.ndarray  # float16
    job: str | None
    model: str | None
    truncated: bool
    meta: dict[str, Any] | None


def _needs_database(target: SinkTarget, verb: str) -> None:
    if target.kind == "redis":
        raise VectorDBError(
            f"`embedfleet {verb}` reads a vector database, and EMBEDFLEET_SINK is `redis` (the "
            "results stream, which has no search): set EMBEDFLEET_SINK to the lancedb://, "
            "postgresql:// or qdrant:// URL the workers write to"
        )


# --- nearest neighbours ----------------------------------------------------------------------
def nearest(target: SinkTarget, vector: np.ndarray, k: int = 10) -> list[Hit]:
    """The ``k`` stored chunks closest to ``vector`` by cosine similarity, best first."""
    _needs_database(target, "search")
    query = np.asarray(vector, dtype=np.float32).reshape(-1)
    if target.kind == "lancedb":
        return _lancedb_nearest(target, query, k)
    if target.kind == "pgvector":
        return _pg_nearest(target, query, k)
    return _qdrant_nearest(target, query, k)


def _lancedb_table(target: SinkTarget) -> Any:
    import lancedb

    try:
        return lancedb.connect(target.location).open_table(target.table)
    except ValueError:
        raise VectorDBError(
            f"no {target.describe()}: have workers written there yet? (EMBEDFLEET_SINK, "
            "EMBEDFLEET_SINK_TABLE)"
        ) from None


def _lancedb_nearest(target: SinkTarget, query: np.ndarray, k: int) -> list[Hit]:
    rows = (
        _lancedb_table(target)
        .search(query, vector_column_name="vector")
        .distance_type("cosine")
        .limit(k)
        .select(["id", "job", "model", "truncated", "meta", "_distance"])
        .to_list()
    )
    return [
        Hit(
            id=row["id"],
            score=1.0 - float(row["_distance"]),  # LanceDB's cosine distance is 1 - similarity
            job=row["job"],
            model=row["model"],
            truncated=bool(row["truncated"]),
            meta=meta_from_json(row["meta"]),
        )
        for row in rows
    ]


def _pg_connect(target: SinkTarget) -> psycopg.Connection:
    import psycopg

    try:
        return psycopg.connect(target.location, autocommit=True)
    except psycopg.OperationalError as error:
        raise VectorDBError(f"cannot connect to PostgreSQL: {str(error).strip()}") from None


def _pg_vector_type(conn: psycopg.Connection, table: str) -> str:
    from psycopg import sql

    query = sql.SQL(
        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute"
        " WHERE attrelid = to_regclass({name}) AND attname = 'embedding' AND NOT attisdropped"
    ).format(name=sql.Literal(sql.Identifier(table).as_string(conn)))
    row = conn.execute(query).fetchone()
    if row is None:
        raise VectorDBError(
            f"no PostgreSQL table {table!r} with an embedding column: have workers written "
            "there yet? (EMBEDFLEET_SINK, EMBEDFLEET_SINK_TABLE)"
        )
    return str(row[0]).partition("(")[0]  # halfvec or vector


def _pg_nearest(target: SinkTarget, query: np.ndarray, k: int) -> list[Hit]:
    from psycopg import sql

    literal = "[" + ",".join(f"{value:.7g}" for value in query) + "]"
    with _pg_connect(target) as conn:
        vector_type = _pg_vector_type(conn, target.table)
        if k > 40:  # HNSW returns at most ef_search rows (default 40)
            conn.execute(sql.SQL("SET hnsw.ef_search = {}").format(sql.Literal(k)))
        # the same operator (<=> cosine distance) and type as the index, so HNSW can serve it
        rows = conn.execute(
            sql.SQL(
                "SELECT id, job, model, truncated, meta, 1 - (embedding <=> %(q)s::{type})"
                " FROM {table} ORDER BY embedding <=> %(q)s::{type} LIMIT %(k)s"
            ).format(type=sql.SQL(vector_type), table=sql.Identifier(target.table)),
            {"q": literal, "k": k},
        ).fetchall()
    return [
        Hit(id=r[0], score=float(r[5]), job=r[1], model=r[2], truncated=bool(r[3]), meta=r[4])
        for r in rows
    ]


def _qdrant_client(target: SinkTarget) -> Any:
    from qdrant_client import QdrantClient

    if target.kind == "qdrant-local":
        if not Path(target.location).is_dir():  # QdrantClient(path=) would create it, empty
            raise VectorDBError(f"no {target.describe()}: the directory does not exist")
        try:
            client = QdrantClient(path=target.location)
        except RuntimeError as error:  # local mode locks its directory to one process
            raise VectorDBError(
                f"{target.describe()} is open in another process ({error}); local mode allows "
                "one process at a time: stop the worker, or run a Qdrant server"
            ) from None
    else:
        client = QdrantClient(url=target.location, api_key=target.api_key, timeout=60)
    if not client.collection_exists(target.table):
        client.close()
        raise VectorDBError(
            f"no {target.describe()}: have workers written there yet? (EMBEDFLEET_SINK, "
            "EMBEDFLEET_SINK_TABLE)"
        )
    return client


def _qdrant_nearest(target: SinkTarget, query: np.ndarray, k: int) -> list[Hit]:
    client = _qdrant_client(target)
    try:
        points = client.query_points(
            target.table, query=query.tolist(), limit=k, with_payload=True
        ).points
    finally:
        client.close()
    return [
        Hit(
            id=str(p.payload.get("id")),
            score=float(p.score),
            job=p.payload.get("job"),
            model=p.payload.get("model"),
            truncated=bool(p.payload.get("truncated")),
            meta=p.payload.get("meta"),
        )
        for p in points
        if p.payload is not None
    ]


# --- index builds ----------------------------------------------------------------------------
def build_index(target: SinkTarget, *, force: bool = False) -> list[str]:
    """Build the approximate nearest-neighbour index after a bulk load; returns what was done.

    Sinks never index on upsert: maintaining a graph per micro-batch slows a bulk load many
    times over, and an index built once over all the rows is better.
    """
    _needs_database(target, "index")
    if target.kind == "lancedb":
        return _lancedb_index(target, force)
    if target.kind == "pgvector":
        return _pg_index(target)
    return _qdrant_index(target)


def _lancedb_index(target: SinkTarget, force: bool) -> list[str]:
    from lancedb.index import BTree, IvfHnswSq

    table = _lancedb_table(target)
    table.optimize()  # compact the upserts' small fragments first: the index covers them all
    rows = table.count_rows()
    # the id index makes each upsert's match on id a lookup instead of a scan of the table
    table.create_index("id", config=BTree(), replace=True)
    done = [f"{target.describe()}: {rows:,} rows, compacted; id index (BTree) built"]
    if rows < LANCEDB_MIN_INDEX_ROWS and not force:
        done.append(
            f"vector index not built: under {LANCEDB_MIN_INDEX_ROWS:,} rows an exact search "
            "is fast and exact (pass --force to build IVF_HNSW_SQ anyway)"
        )
        return done
    started = time.perf_counter()
    table.create_index("vector", config=IvfHnswSq(distance_type="cosine"), replace=True)
    done.append(f"vector index IVF_HNSW_SQ (cosine) built in {time.perf_counter() - started:.1f} s")
    return done


def _pg_index(target: SinkTarget) -> list[str]:
    from psycopg import sql

    with _pg_connect(target) as conn:
        vector_type = _pg_vector_type(conn, target.table)
        name = f"{target.table}_embedding_hnsw"[:63]
        started = time.perf_counter()
        conn.execute(
            sql.SQL(
                "CREATE INDEX IF NOT EXISTS {name} ON {table} USING hnsw (embedding {ops})"
            ).format(
                name=sql.Identifier(name),
                table=sql.Identifier(target.table),
                ops=sql.SQL(f"{vector_type}_cosine_ops"),
            )
        )
        conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(target.table)))
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(target.table)))
        count = row.fetchone()[0]  # type: ignore[index]
    return [
        f"{target.describe()}: {count:,} rows; HNSW index {name!r} ({vector_type}_cosine_ops) "
        f"ready in {time.perf_counter() - started:.1f} s"
    ]


def _qdrant_index(target: SinkTarget) -> list[str]:
    from qdrant_client import models

    client = _qdrant_client(target)
    try:
        client.update_collection(
            target.table,
            optimizers_config=models.OptimizersConfigDiff(
                indexing_threshold=QDRANT_INDEXING_THRESHOLD_KB
            ),
            hnsw_config=models.HnswConfigDiff(m=16, ef_construct=100),
        )
        if target.kind == "qdrant":  # local mode has no payload indexes (and warns)
            client.create_payload_index(target.table, "job", models.PayloadSchemaType.KEYWORD)
        count = client.count(target.table).count
    finally:
        client.close()
    done = [
        f"{target.describe()}: {count:,} points; HNSW indexing on (m=16, ef_construct=100, "
        f"threshold {QDRANT_INDEXING_THRESHOLD_KB:,} KB)"
    ]
    if target.kind == "qdrant-local":
        done.append("local mode always searches exactly; a Qdrant server builds the graph")
    else:
        done.append(
            "payload index on job; the server builds the graph in the background "
            "(collection status: yellow until done)"
        )
    return done


# --- export ----------------------------------------------------------------------------------
def stored_vectors(target: SinkTarget, job: str | None = None) -> list[StoredVector]:
    """Every stored row (optionally one job's), one per id; for exports and checks."""
    _needs_database(target, "results")
    if target.kind == "lancedb":
        return _lancedb_rows(target, job)
    if target.kind == "pgvector":
        return _pg_rows(target, job)
    return _qdrant_rows(target, job)


def _lancedb_rows(target: SinkTarget, job: str | None) -> list[StoredVector]:
    import pyarrow.compute as pc

    data = _lancedb_table(target).to_arrow()
    if job is not None:
        data = data.filter(pc.equal(data["job"], job))
    dim = data.schema.field("vector").type.list_size
    vectors = data["vector"].combine_chunks().flatten().to_numpy(zero_copy_only=False)
    vectors = vectors.astype(np.float16).reshape(-1, dim)
    columns = data.select(["id", "job", "model", "truncated", "meta"]).to_pylist()
    return [
        StoredVector(
            id=row["id"],
            vector=vectors[i],
            job=row["job"],
            model=row["model"],
            truncated=bool(row["truncated"]),
            meta=meta_from_json(row["meta"]),
        )
        for i, row in enumerate(columns)
    ]


def _pg_rows(target: SinkTarget, job: str | None) -> list[StoredVector]:
    from pgvector.psycopg import register_vector
    from psycopg import sql

    with _pg_connect(target) as conn:
        _pg_vector_type(conn, target.table)
        register_vector(conn)
        query = sql.SQL(
            "SELECT id, embedding, job, model, truncated, meta FROM {table}"
            " WHERE %(job)s::text IS NULL OR job = %(job)s ORDER BY id"
        ).format(table=sql.Identifier(target.table))
        rows = conn.execute(query, {"job": job}).fetchall()
    return [
        StoredVector(
            id=r[0],
            vector=np.asarray(r[1].to_numpy() if hasattr(r[1], "to_numpy") else r[1]).astype(
                np.float16
            ),
            job=r[2],
            model=r[3],
            truncated=bool(r[4]),
            meta=r[5],
        )
        for r in rows
    ]


def _qdrant_rows(target: SinkTarget, job: str | None) -> list[StoredVector]:
    from qdrant_client import models

    client = _qdrant_client(target)
    selector = (
        None
        if job is None
        else models.Filter(
            must=[models.FieldCondition(key="job", match=models.MatchValue(value=job))]
        )
    )
    found: list[StoredVector] = []
    offset = None
    try:
        while True:
            points, offset = client.scroll(
                target.table,
                scroll_filter=selector,
                limit=1000,
                offset=offset,
                with_payload=True,
                with_vectors=True,
            )
            for p in points:
                payload = p.payload or {}
                found.append(
                    StoredVector(
                        id=str(payload.get("id")),
                        vector=np.asarray(p.vector, dtype=np.float16),
                        job=payload.get("job"),
                        model=payload.get("model"),
                        truncated=bool(payload.get("truncated")),
                        meta=payload.get("meta"),
                    )
                )
            if offset is None:
                return found
    finally:
        client.close()
