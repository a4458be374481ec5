"""PostgreSQL + pgvector: binary COPY into a staging table, then one upsert statement.

Per upsert, in one transaction: ``COPY staging FROM STDIN (FORMAT BINARY)`` (the fastest way
into PostgreSQL), then ``INSERT … SELECT … ON CONFLICT (id) DO UPDATE``. The staging table is a
temporary table that empties itself at commit. Rows go in sorted by id so two workers upserting
overlapping ids lock them in the same order and cannot deadlock.

Vectors are ``halfvec`` (fp16, half the size) on pgvector ≥ 0.7 and ``vector`` (fp32) before;
``binary``/``ubinary`` outputs are stored as ``bit(dim)``. Search uses the cosine operator
``<=>`` on the column's own type, so the HNSW index that ``embedfleet index`` builds
(``{type}_cosine_ops``) serves it; a ``bit`` column is searched by Hamming distance ``<~>``
(``bit_hamming_ops``) and the candidates rescored with the float query. pgvector has no int8
vector type: int8/uint8 outputs are refused at setup.

A model with several representations (BGE-M3, ``Extras``) adds two nullable columns to the same
row: ``sparse sparsevec(vocabulary)`` (pgvector ≥ 0.7; searched by inner product ``<#>``) and
``multivector halfvec(d)[]``, the per-token vectors as an array of fp16 vectors in token
order. Both travel to the staging table as text and are cast by the upsert.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from embedfleet.shared.fault_kinds import FaultKind, FaultRules, System
from embedfleet.shared.logging import get_logger
from embedfleet.sinks.backend import (
    NO_EXTRAS,
    RESCORE_MULTIPLIER,
    Extras,
    SinkSetupError,
    StoredRow,
    VectorBackend,
    VectorDBError,
    meta_to_json,
    rescore_binary,
    row_fields,
)
from embedfleet.sinks.store import Store
from embedfleet.sinks.target import SinkTarget, SinkURL

if TYPE_CHECKING:
    import psycopg
    from psycopg import sql

    from embedfleet.shared.protocol import MultiVector, Result, SparseVector
    from embedfleet.sinks.backend import Hit, StoredVector, VectorDType

log = get_logger("embedfleet.sink")
ColumnType = Literal["halfvec", "vector", "bit"]
HALFVEC_SINCE = (0, 7)
COLUMN_TYPES: dict[str, ColumnType] = {
    "float16": "halfvec",
    "float32": "vector",
    "binary": "bit",
    "ubinary": "bit",
}
INDEX_OPS = {
    "halfvec": "halfvec_cosine_ops",
    "vector": "vector_cosine_ops",
    "bit": "bit_hamming_ops",
}
# HNSW returns at most ef_search rows (pgvector's default 40): a larger k raises it per query
DEFAULT_EF_SEARCH = 40
SELECTED = "id, job, model, truncated, meta"


def vector_type_for(extension_version: str) -> ColumnType:
    """``halfvec`` arrived in pgvector 0.7.0; older servers store full-precision ``vector``."""
    parts = tuple(int(p) for p in extension_version.split(".")[:2] if p.isdigit())
    return "halfvec" if parts >= HALFVEC_SINCE else "vector"


class PgvectorBackend(VectorBackend):
    DTYPES = ("float16", "float32", "binary", "ubinary")
    system = System.POSTGRESQL

    def __init__(self, target: Any, *, store_text: bool = True) -> None:
        super().__init__(target, store_text=store_text)
        self.column_type: ColumnType | None = None  # the embedding column's type, once known
        self.dim: int | None = None
        self._conn: psycopg.Connection | None = None
        self._staging_ready = False  # the temporary staging table exists in this session
        self._text_column = "text"  # "NULL::text" for a table from before texts were stored
        self.extras: Extras = NO_EXTRAS  # the sparse / multivector columns upserts fill

    # --- connection --------------------------------------------------------------------------
    def _connection(self) -> psycopg.Connection:
        """The connection, reopened after a failure (the worker retries a failed upsert)."""
        import psycopg

        if self._conn is not None and not self._conn.closed and not self._conn.broken:
            return self._conn
        self.close()
        options: dict[str, Any] = {}
        if self.statement_timeout_s is not None and "connect_timeout" not in self.target.location:
            # a server that does not answer (blackholed) is not waited on for ever either
            options["connect_timeout"] = max(2, math.ceil(self.statement_timeout_s))
        conn = psycopg.connect(self.target.location, autocommit=True, **options)
        if self.statement_timeout_s is not None:
            # for the session: every statement the server runs for this connection (the COPY,
            # the upsert, a wait for a row lock) is cancelled past it, SQLSTATE 57014: a
            # transient fault (shared/fault_kinds.py), the batch retried
            try:
                conn.execute(
                    "SELECT set_config('statement_timeout', %s, false)",
                    (f"{max(1, round(self.statement_timeout_s * 1000))}ms",),
                )
            except BaseException:
                conn.close()
                raise
        self._conn = conn
        return self._conn

    @contextmanager
    def _reading(self) -> Iterator[psycopg.Connection]:
        """The connection for a read, with the table checked to exist and pgvector's types."""
        import psycopg
        from pgvector.psycopg import register_vector

        try:
            conn = self._connection()
            if self.column_type is None:
                self.column_type, self.dim = self._column_of(conn)
                if not has_column(conn, self.target.table, "text"):
                    self._text_column = "NULL::text AS text"
            register_vector(conn)
            yield conn
        except psycopg.OperationalError as error:
            self.close()
            raise VectorDBError(f"cannot connect to PostgreSQL: {str(error).strip()}") from None

    def _column_of(self, conn: psycopg.Connection) -> tuple[ColumnType, int]:
        found = column_type(conn, self.target.table)
        if found is None:
            raise self.not_written_yet()
        name, dim = found
        if name not in COLUMN_TYPES.values():
            raise VectorDBError(
                f"{self.target.describe()} stores {name}, not halfvec, vector or bit"
            )
        return name, dim  # type: ignore[return-value]  # checked just above

    def _select(
        self, conn: psycopg.Connection, extra: str, tail: str, params: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """The row fields and ``extra`` of the rows ``tail`` picks, as dicts by column name.

        ``{type}`` in ``extra`` and ``tail`` stands for the embedding column's type.
        """
        from psycopg import sql

        query = sql.SQL(f"SELECT {{columns}}, {{text}}, {extra} FROM {{table}} {tail}").format(
            columns=sql.SQL(SELECTED),
            text=sql.SQL(self._text_column),
            table=sql.Identifier(self.target.table),
            type=sql.SQL(self.column_type or "vector"),
        )
        cursor = conn.execute(query, params)
        names = [column.name for column in cursor.description or ()]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = None
        self._staging_ready = False

    # --- writing ---------------------------------------------------------------------------
    def setup(
        self, model: str, dim: int, dtype: VectorDType | None = None, extras: Extras = NO_EXTRAS
    ) -> None:
        import psycopg
        from psycopg import sql

        self.dim = dim
        requested = COLUMN_TYPES[dtype] if dtype is not None else None
        try:
            conn = self._connection()
        except psycopg.OperationalError as error:
            raise SinkSetupError(
                f"cannot connect to PostgreSQL (EMBEDFLEET_SINK): {str(error).strip()}"
            ) from error
        table = sql.Identifier(self.target.table)
        # Workers of a fleet start together; CREATE EXTENSION / TABLE IF NOT EXISTS can still
        # collide in the catalog, so they take turns (the lock is released just below).
        lock = f"embedfleet:{self.target.table}"
        conn.execute("SELECT pg_advisory_lock(hashtext(%s))", (lock,))
        try:
            version = _ensure_extension(conn)  # also for a requested type: bit needs it too
            chosen = requested or vector_type_for(version)
            conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {table} ("
                    " id text PRIMARY KEY,"
                    " embedding {type} NOT NULL,"
                    " job text,"
                    " model text NOT NULL,"
                    " truncated boolean NOT NULL DEFAULT false,"
                    " meta jsonb,"
                    " text text,"
                    " updated_at timestamptz NOT NULL DEFAULT now())"
                ).format(table=table, type=sql.SQL(f"{chosen}({dim})"))
            )
            # a table from before texts were stored: a nullable column is a catalog change only
            conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS text text").format(table))
            existing = column_type(conn, self.target.table)
            self._add_extra_columns(conn, version, extras)
        finally:
            conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", (lock,))
        if existing is None:
            raise SinkSetupError(f"{self.target.describe()} has no 'embedding' column")
        existing_type, existing_dim = existing
        if existing_dim != dim or existing_type not in COLUMN_TYPES.values():
            raise self.dim_mismatch(f"{existing_type}({existing_dim}) vectors", dim)
        if requested and existing_type != requested:
            raise self.dtype_mismatch(existing_type, dtype)  # type: ignore[arg-type]
        self.column_type = existing_type  # type: ignore[assignment]  # checked just above
        log.info("pgvector table ready", table=self.target.table, type=f"{existing_type}({dim})")

    def _extra_columns(self, extras: Extras) -> dict[str, str]:
        """The extra columns ``extras`` need, name to type."""
        columns = {}
        if extras.sparse_dim:
            columns["sparse"] = f"sparsevec({extras.sparse_dim})"
        if extras.multivector_dim:
            columns["multivector"] = f"halfvec({extras.multivector_dim})[]"
        return columns

    def _add_extra_columns(self, conn: psycopg.Connection, version: str, extras: Extras) -> None:
        """The sparse and multivector columns (nullable: a catalog change only), checked."""
        from psycopg import sql

        if extras and vector_type_for(version) != "halfvec":
            raise SinkSetupError(
                f"pgvector {version} has no sparsevec or halfvec: this model's sparse and "
                "per-token vectors need pgvector ≥ 0.7 on the server"
            )
        for name, kind in self._extra_columns(extras).items():
            conn.execute(
                sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {}").format(
                    sql.Identifier(self.target.table), sql.Identifier(name), sql.SQL(kind)
                )
            )
            found = _column_format(conn, self.target.table, name)
            if found != kind:
                raise SinkSetupError(
                    f"{self.target.describe()} has {name} {found}, this model's rows need "
                    f"{kind}: set EMBEDFLEET_SINK_TABLE to a new table name"
                )
        self.extras = extras

    def _write_connection(self) -> psycopg.Connection:
        if self.column_type is None or self.dim is None:
            raise RuntimeError("PgvectorBackend.setup(model, dim) must run before upsert()")
        from pgvector.psycopg import register_vector
        from psycopg import sql

        conn = self._connection()
        if not self._staging_ready:
            register_vector(conn)
            # bits travel as '0101…' text (no binary COPY form in pgvector's client) and are
            # cast to bit(dim) by the upsert
            staged = "text" if self.column_type == "bit" else f"{self.column_type}({self.dim})"
            conn.execute(
                sql.SQL(
                    "CREATE TEMP TABLE IF NOT EXISTS {staging} (id text, embedding {type},"
                    " job text, model text, truncated boolean, meta text, text text,"
                    " sparse text, multivector text)"
                    " ON COMMIT DELETE ROWS"
                ).format(
                    staging=sql.Identifier(f"{self.target.table}_staging"),
                    type=sql.SQL(staged),
                )
            )
            self._staging_ready = True
        return conn

    def upsert(self, results: Sequence[Result]) -> None:
        from psycopg import sql

        conn = self._write_connection()
        assert self.column_type is not None  # _write_connection raised otherwise
        staging = sql.Identifier(f"{self.target.table}_staging")
        rows = sorted(results, key=lambda r: r.id)
        columns, vectors, wrap = self._vectors_to_copy(rows, self.column_type)
        extra = self._extra_columns(self.extras)
        names = ["id", "embedding", "job", "model", "truncated", "meta", "text", *extra]
        try:
            with conn.transaction(), conn.cursor() as cursor:
                copy_sql = sql.SQL("COPY {staging} ({names}) FROM STDIN (FORMAT BINARY)").format(
                    staging=staging, names=sql.SQL(", ".join(names))
                )
                with cursor.copy(copy_sql) as copy:
                    copy.set_types(columns + ["text"] * len(extra))
                    for r, values in zip(rows, vectors, strict=True):
                        meta = meta_to_json(r.meta)
                        text = self.stored_text(r)
                        row = [r.id, wrap(values), r.job, r.model, r.truncated, meta, text]
                        if "sparse" in extra:
                            row.append(sparsevec_text(r.sparse))
                        if "multivector" in extra:
                            row.append(halfvec_array_text(r.multivector))
                        copy.write_row(row)
                cursor.execute(self._merge_staged(staging, names, extra))
        except Exception:
            # A failed COPY can leave the connection mid-protocol; start clean on the retry.
            self.close()
            raise

    def _vectors_to_copy(
        self, rows: Sequence[Result], column_type: str
    ) -> tuple[list[str], list[str] | np.ndarray, Any]:
        """The COPY's column types (before the extra columns'), the rows' vectors and what
        wraps each for COPY: bits as '0101…' text, or the float rows as (half)vectors."""
        from pgvector import HalfVector, Vector

        if column_type == "bit":
            packed = self.quantized_vectors(rows, "ubinary", self.dim or 0)
            bits = np.unpackbits(packed, axis=-1)[:, : self.dim]
            text = ["".join("1" if bit else "0" for bit in row) for row in bits.tolist()]
            return ["text", "text", "text", "text", "bool", "text", "text"], text, str
        wrap = HalfVector if column_type == "halfvec" else Vector
        dtype = np.float16 if column_type == "halfvec" else np.float32
        columns = ["text", column_type, "text", "text", "bool", "text", "text"]
        return columns, self.float_vectors(rows, dtype, self.dim), wrap

    def _merge_staged(
        self, staging: sql.Identifier, names: list[str], extra: dict[str, str]
    ) -> sql.Composed:
        """The statement that moves the staged rows into the table, in id order, a row already
        there updated (``names``: the COPY's columns; ``extra``: the extra columns' types)."""
        from psycopg import sql

        selected = [
            "id",
            f"embedding::{self.column_type}({self.dim})",
            "job",
            "model",
            "truncated",
            "meta::jsonb",
            "text",
            *(f"{name}::{kind}" for name, kind in extra.items()),
        ]
        updates = ", ".join(f"{name} = EXCLUDED.{name}" for name in names[1:])
        return sql.SQL(
            "INSERT INTO {table} ({names}) SELECT {selected} FROM {staging} ORDER BY id"
            " ON CONFLICT (id) DO UPDATE SET {updates}, updated_at = now()"
        ).format(
            table=sql.Identifier(self.target.table),
            names=sql.SQL(", ".join(names)),
            selected=sql.SQL(", ".join(selected)),
            staging=staging,
            updates=sql.SQL(updates),
        )

    # --- reading ---------------------------------------------------------------------------
    def vector_format(self) -> tuple[str, int]:
        with self._reading():
            pass
        dtypes = {"halfvec": "float16", "vector": "float32", "bit": "ubinary"}
        return dtypes[self.column_type or "vector"], int(self.dim or 0)

    def nearest(self, vector: np.ndarray, k: int = 10) -> list[Hit]:

        query = np.asarray(vector, dtype=np.float32).reshape(-1)
        if self.vector_format()[0] == "ubinary":
            return self._nearest_bits(query, k)
        literal = "[" + ",".join(f"{value:.7g}" for value in query) + "]"
        # the same operator (<=> cosine distance) and type as the index, so HNSW serves it
        rows = self._nearest_rows(
            "1 - (embedding <=> %(q)s::{type}) AS score", "embedding <=> %(q)s::{type}", literal, k
        )
        return [self.hit(row, row["meta"], float(row["score"])) for row in rows]

    def nearest_sparse(self, sparse: SparseVector, k: int = 10) -> list[Hit]:
        with self._reading() as conn:
            if not has_column(conn, self.target.table, "sparse"):
                raise VectorDBError(f"{self.target.describe()} has no sparse column")
        literal = sparsevec_text(sparse) or ""
        # <#> is the negative inner product; rows without weights (NULL) sort last, and rows
        # sharing no index with the query (0) are no match, as in Qdrant: both dropped
        rows = self._nearest_rows(
            "-(sparse <#> %(q)s::sparsevec) AS score", "sparse <#> %(q)s::sparsevec", literal, k
        )
        return [
            self.hit(row, row["meta"], float(row["score"]))
            for row in rows
            if row["score"] is not None and row["score"] > 0
        ]

    def _nearest_rows(
        self, extra: str, distance: str, literal: str, limit: int
    ) -> list[dict[str, Any]]:
        """The ``limit`` rows nearest the query ``literal`` (``%(q)s``) by the ``distance``
        expression, with ``extra`` (as in ``_select``). HNSW returns at most ef_search rows, so
        a larger ``limit`` raises it on the connection first."""
        from psycopg import sql

        with self._reading() as conn:
            if limit > DEFAULT_EF_SEARCH:
                conn.execute(sql.SQL("SET hnsw.ef_search = {}").format(sql.Literal(limit)))
            return self._select(
                conn, extra, f"ORDER BY {distance} LIMIT %(k)s", {"q": literal, "k": limit}
            )

    def _nearest_bits(self, query: np.ndarray, k: int) -> list[Hit]:
        """Hamming distance (``<~>``, served by a bit_hamming_ops index) for k x
        RESCORE_MULTIPLIER candidates, rescored with the float query against their bits."""

        dim = self.dim or 0
        literal = "".join("1" if value > 0 else "0" for value in query[:dim])
        rows = self._nearest_rows(
            "embedding::text AS bits",
            f"embedding <~> %(q)s::bit({dim})",
            literal,
            k * RESCORE_MULTIPLIER,
        )
        if not rows:
            return []
        packed = np.packbits(np.array([[c == "1" for c in row["bits"]] for row in rows]), axis=-1)
        scores = rescore_binary(query, packed, dim)
        best = np.argsort(-scores, kind="stable")[:k]
        return [self.hit(rows[i], rows[i]["meta"], float(scores[i])) for i in best]

    def build_index(self, *, force: bool = False) -> list[str]:
        from psycopg import sql

        table = sql.Identifier(self.target.table)
        with self._reading() as conn:
            ops = INDEX_OPS[self.column_type or "vector"]
            name = f"{self.target.table}_embedding_hnsw"[:63]
            started = time.perf_counter()
            conn.execute(
                sql.SQL(
                    "CREATE INDEX IF NOT EXISTS {name} ON {table} USING hnsw (embedding {ops})"
                ).format(name=sql.Identifier(name), table=table, ops=sql.SQL(ops))
            )
            conn.execute(sql.SQL("ANALYZE {}").format(table))
            count = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone()
        rows = 0 if count is None else int(count[0])
        return [
            f"{self.target.describe()}: {rows:,} rows; HNSW index {name!r} ({ops}) "
            f"ready in {time.perf_counter() - started:.1f} s"
        ]

    def job_ids(self, job: str) -> set[str]:
        from psycopg import sql

        with self._reading() as conn:
            query = sql.SQL("SELECT id FROM {table} WHERE job = %s").format(
                table=sql.Identifier(self.target.table)
            )
            return {str(row[0]) for row in conn.execute(query, (job,)).fetchall()}

    def delete_ids(self, ids: Sequence[str]) -> None:
        from psycopg import sql

        with self._reading() as conn:  # autocommit: durable when it returns
            query = sql.SQL("DELETE FROM {table} WHERE id = ANY(%s)").format(
                table=sql.Identifier(self.target.table)
            )
            conn.execute(query, (list(ids),))

    def export_rows(self, job: str | None = None) -> list[StoredVector]:
        with self._reading() as conn:
            rows = self._select(
                conn,
                "embedding::text AS bits" if self.column_type == "bit" else "embedding",
                "WHERE %(job)s::text IS NULL OR job = %(job)s ORDER BY id",
                {"job": job},
            )
        if self.column_type == "bit":  # exported as ubinary bytes, as the results carry them
            return [
                self.stored(row, row["meta"], np.packbits([c == "1" for c in row["bits"]]))
                for row in rows
            ]
        return [self.stored(row, row["meta"], _numpy(row["embedding"])) for row in rows]

    # --- migrations: the reader name is a view, switched in one transaction ------------------
    def resolve(self) -> str:
        with self._connected() as conn:
            return _resolve(conn, self.target.table)

    def point_alias(self, alias: str) -> None:
        from psycopg import sql

        with self._connected() as conn, conn.transaction():
            if _relkind(conn, alias) not in (None, "v"):
                raise VectorDBError(
                    f"{alias!r} is a PostgreSQL table, not a view: choose another reader name"
                )
            # DROP + CREATE in one transaction (CREATE OR REPLACE VIEW cannot change a column's
            # type, and the new table's vectors have another dimension): a reader waits for the
            # commit and then reads the new table, never half of each
            conn.execute(sql.SQL("DROP VIEW IF EXISTS {}").format(sql.Identifier(alias)))
            conn.execute(
                sql.SQL("CREATE VIEW {} AS SELECT * FROM {}").format(
                    sql.Identifier(alias), sql.Identifier(self.target.table)
                )
            )

    def scan_rows(self, after: str | None, limit: int) -> tuple[list[StoredRow], str | None]:
        with self._reading() as conn:
            rows = self._select(
                conn,
                "1 AS one",
                "WHERE %(after)s::text IS NULL OR id > %(after)s ORDER BY id LIMIT %(n)s",
                {"after": after, "n": limit},
            )
        found = [StoredRow(**row_fields(row, row["meta"])) for row in rows]
        return found, (found[-1].id if len(found) == limit else None)

    def count_rows(self) -> int:
        from psycopg import sql

        with self._reading() as conn:
            query = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(self.target.table))
            row = conn.execute(query).fetchone()
        return 0 if row is None else int(row[0])

    def drop_table(self) -> None:
        from psycopg import sql

        with self._connected() as conn:
            conn.execute(
                sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(self.target.table))
            )

    @contextmanager
    def _connected(self) -> Iterator[psycopg.Connection]:
        import psycopg

        try:
            yield self._connection()
        except psycopg.OperationalError as error:
            self.close()
            raise VectorDBError(f"cannot connect to PostgreSQL: {str(error).strip()}") from None


def _relkind(conn: psycopg.Connection, name: str) -> str | None:
    """'r' for a table, 'v' for a view, None when there is neither."""
    from psycopg import sql

    query = sql.SQL("SELECT relkind FROM pg_class WHERE oid = to_regclass({})").format(
        sql.Literal(sql.Identifier(name).as_string(conn))
    )
    row = conn.execute(query).fetchone()
    return None if row is None else str(row[0])


def _resolve(conn: psycopg.Connection, name: str) -> str:
    """The table a view made by point_alias reads (the view's one table), or ``name``."""
    from psycopg import sql

    if _relkind(conn, name) != "v":
        return name
    query = sql.SQL(
        "SELECT DISTINCT t.relname FROM pg_rewrite r JOIN pg_depend d ON d.objid = r.oid"
        " JOIN pg_class t ON t.oid = d.refobjid"
        " WHERE r.ev_class = to_regclass({}) AND t.relkind = 'r' AND t.oid <> r.ev_class"
    ).format(sql.Literal(sql.Identifier(name).as_string(conn)))
    tables = [str(row[0]) for row in conn.execute(query).fetchall()]
    if len(tables) != 1:
        raise VectorDBError(f"the view {name!r} reads {len(tables)} tables, not one")
    return tables[0]


def sparsevec_text(sparse: SparseVector | None) -> str | None:
    """pgvector's sparsevec text form, ``{index:value,...}/dim`` with 1-based indices."""
    if sparse is None:
        return None
    pairs = ",".join(
        f"{int(index) + 1}:{float(value):.9g}"
        for index, value in zip(sparse.indices.tolist(), sparse.values.tolist(), strict=True)
    )
    return f"{{{pairs}}}/{sparse.dim}"


def halfvec_array_text(multi: MultiVector | None) -> str | None:
    """A ``halfvec(d)[]`` array literal of per-token vectors, in token order."""
    if multi is None or not multi.count:
        return None
    rows = ('"[' + ",".join(f"{x:.6g}" for x in row) + ']"' for row in multi.floats().tolist())
    return "{" + ",".join(rows) + "}"


def _numpy(value: Any) -> Any:
    return value.to_numpy() if hasattr(value, "to_numpy") else value


def _ensure_extension(conn: psycopg.Connection) -> str:
    """pgvector's version in this database, enabling it when this user may."""
    import psycopg

    query = "SELECT extversion FROM pg_extension WHERE extname = 'vector'"
    row = conn.execute(query).fetchone()
    if row is None:
        try:
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        except psycopg.errors.InsufficientPrivilege as error:
            raise SinkSetupError(
                "the pgvector extension is not enabled in this database and this user may "
                "not enable it: ask a superuser to run `CREATE EXTENSION vector;` there"
            ) from error
        except (psycopg.errors.FeatureNotSupported, psycopg.errors.UndefinedFile) as error:
            raise SinkSetupError(
                "this PostgreSQL server has no pgvector extension installed: install "
                "pgvector ≥ 0.7 on the server (https://github.com/pgvector/pgvector)"
            ) from error
        row = conn.execute(query).fetchone()
    assert row is not None
    return str(row[0])


def _column_format(conn: psycopg.Connection, table: str, column: str) -> str | None:
    """``format_type`` of a column ("halfvec(384)", "text"), or None if there is none."""
    from psycopg import sql

    query = sql.SQL(
        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute"
        " WHERE attrelid = to_regclass({name}) AND attname = %s AND NOT attisdropped"
    ).format(name=sql.Literal(sql.Identifier(table).as_string(conn)))
    row = conn.execute(query, (column,)).fetchone()
    return None if row is None else str(row[0])


def has_column(conn: psycopg.Connection, table: str, column: str) -> bool:
    return _column_format(conn, table, column) is not None


def column_type(conn: psycopg.Connection, table: str) -> tuple[str, int] | None:
    """("halfvec", 384) for the table's ``embedding`` column, or None if there is none."""
    found = _column_format(conn, table, "embedding")
    if found is None:
        return None
    name, _, rest = found.partition("(")
    return name, int(rest.rstrip(")") or 0)


# SQLSTATE classes (first two characters), PostgreSQL appendix A.
_SQLSTATE_TRANSIENT_CLASSES = ("08", "40", "53", "57", "58", "55")  # connection, rollback, ...
_SQLSTATE_ROW_CLASSES = ("22", "23")  # data exception, integrity constraint violation
# 28: bad credentials; 3D: no such database; 42: no such table/column, no privilege.
_SQLSTATE_WORKER_CLASSES = ("28", "3D", "42", "0A", "XX")


# What PostgreSQL says, at connection time, when only a person can help.
_PG_REFUSED = re.compile(
    r"password authentication failed|authentication failed|no pg_hba\.conf entry"
    r"|(database|role) \"[^\"]*\" does not exist|permission denied|no password supplied",
    re.IGNORECASE,
)


def _sqlstate_kind(sqlstate: str) -> FaultKind:
    prefix = sqlstate[:2]
    if prefix in _SQLSTATE_TRANSIENT_CLASSES:
        return FaultKind.TRANSIENT
    if prefix in _SQLSTATE_ROW_CLASSES:
        return FaultKind.ROW
    return FaultKind.WORKER


def postgres_fault_kind(error: BaseException) -> FaultKind:
    """The kind of a psycopg error (shared/fault_kinds.py): its SQLSTATE's class when it carries
    one; without one, the connection is gone or never came (OperationalError, InterfaceError),
    and anything else is the worker's to report. A refused connection carries no SQLSTATE either
    (libpq reports it as text): the server's words tell bad credentials or a missing database,
    which no wait fixes, from a server away."""
    sqlstate = getattr(error, "sqlstate", None)
    if isinstance(sqlstate, str) and len(sqlstate) == 5:
        return _sqlstate_kind(sqlstate)
    lost = type(error).__name__ in ("OperationalError", "InterfaceError")
    if lost and _PG_REFUSED.search(str(error)):
        return FaultKind.WORKER
    return FaultKind.TRANSIENT if lost else FaultKind.WORKER


FAULTS = FaultRules(System.POSTGRESQL, ("psycopg", "psycopg_pool"), postgres_fault_kind)


def _postgres_target(url: SinkURL) -> SinkTarget:
    # psycopg takes the libpq URL as is; the SQLAlchemy-style dialect suffix is dropped
    return STORE.target(f"postgresql://{url.rest}", url.table)


STORE = Store(
    kind="pgvector",
    schemes=("postgresql", "postgres", "postgresql+psycopg"),
    forms="postgresql://user:password@host/db",
    describe="PostgreSQL table {table!r} at {location}",
    backend=PgvectorBackend,
    extra="pgvector",
    needs=("psycopg", "pgvector"),
    parse=_postgres_target,
    faults=FAULTS,
)
