"""PostgreSQL + pgvector: binary COPY into a staging table, then one upsert statement.

Per micro-batch, in one transaction: ``COPY staging FROM STDIN (FORMAT BINARY)`` (the fastest
way into PostgreSQL), then ``INSERT … SELECT … ON CONFLICT (id) DO UPDATE``. The staging table
is a temporary table that empties itself at commit. Rows go in sorted by id so two workers
upserting overlapping ids lock them in the same order and cannot deadlock.

Vectors are ``halfvec`` (fp16, half the size) on pgvector ≥ 0.7 and ``vector`` before. psycopg
3's asyncio connection is used, so nothing here blocks the worker's event loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np
import redis.asyncio as aioredis
from embedfleet.shared.keys import Keys
from embedfleet.shared.logging import get_logger
from embedfleet.shared.protocol import Result
from embedfleet.shared.vectordb import meta_to_json
from embedfleet.workers.sinks.base import DatabaseSink, SinkSetupError

if TYPE_CHECKING:
    import psycopg

log = get_logger("embedfleet.sink")
VectorType = Literal["halfvec", "vector"]
HALFVEC_SINCE = (0, 7)


def vector_type_for(extension_version: str) -> VectorType:
    """``halfvec`` arrived in pgvector 0.7.0; older servers store full-precision ``vector``."""
    parts = tuple(int(p) for p in extension_version.split(".")[:2] if p.isdigit())
    return "halfvec" if parts >= HALFVEC_SINCE else "vector"


class PgvectorSink(DatabaseSink):
    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        dsn: str,
        table: str,
        *,
        vector_type: VectorType | None = None,
    ) -> None:
        """``vector_type`` None: halfvec when the server's pgvector has it, else vector."""
        super().__init__(client, keys)
        self.dsn = dsn
        self.table = table
        self.requested_type = vector_type
        self.vector_type: VectorType | None = None
        self.dim: int | None = None
        self._conn: psycopg.AsyncConnection | None = None

    async def setup(self, model: str, dim: int) -> None:
        from psycopg import sql

        self.dim = dim
        async with await self._connect_raw() as conn:
            # Workers of a fleet start together; CREATE EXTENSION / TABLE IF NOT EXISTS can still
            # collide in the catalog, so they take turns (the lock ends with the connection).
            await conn.execute(
                "SELECT pg_advisory_lock(hashtext(%s))", (f"embedfleet:{self.table}",)
            )
            version = await self._ensure_extension(conn)
            chosen = self.requested_type or vector_type_for(version)
            await conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {table} ("
                    " id text PRIMARY KEY,"
                    " embedding {type} NOT NULL,"
                    " job text,"
                    " model text NOT NULL,"
                    " truncated boolean NOT NULL DEFAULT false,"
                    " meta jsonb,"
                    " updated_at timestamptz NOT NULL DEFAULT now())"
                ).format(table=sql.Identifier(self.table), type=sql.SQL(f"{chosen}({dim})"))
            )
            existing = await column_type(conn, self.table)
        if existing is None:
            raise SinkSetupError(f"table {self.table!r} has no 'embedding' column")
        existing_type, existing_dim = existing
        if existing_dim != dim or existing_type not in ("halfvec", "vector"):
            raise SinkSetupError(
                f"PostgreSQL table {self.table!r} stores {existing_type}({existing_dim}), the "
                f"model makes {dim}-dim vectors: set EMBEDFLEET_SINK_TABLE to a new table name, "
                "or drop the old table"
            )
        if self.requested_type and existing_type != self.requested_type:
            raise SinkSetupError(
                f"table {self.table!r} already stores {existing_type}, not {self.requested_type}"
            )
        self.vector_type = existing_type  # type: ignore[assignment]  # checked just above
        log.info("pgvector table ready", table=self.table, type=f"{existing_type}({dim})")

    async def _connect_raw(self) -> psycopg.AsyncConnection:
        import psycopg

        try:
            return await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
        except psycopg.OperationalError as error:
            raise SinkSetupError(
                f"cannot connect to PostgreSQL (EMBEDFLEET_SINK): {str(error).strip()}"
            ) from error

    @staticmethod
    async def _ensure_extension(conn: psycopg.AsyncConnection) -> str:
        import psycopg

        query = "SELECT extversion FROM pg_extension WHERE extname = 'vector'"
        row = await (await conn.execute(query)).fetchone()
        if row is None:
            try:
                await conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
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
            row = await (await conn.execute(query)).fetchone()
        assert row is not None
        return str(row[0])

    async def _connection(self) -> psycopg.AsyncConnection:
        """The write connection, reopened after a failure (the worker retries the write)."""
        if self._conn is not None and not self._conn.closed and not self._conn.broken:
            return self._conn
        if self.vector_type is None or self.dim is None:
            raise RuntimeError("PgvectorSink.setup(model, dim) must run before write()")
        from pgvector.psycopg import register_vector_async
        from psycopg import sql

        if self._conn is not None:
            await self._conn.close()
        conn = await self._connect_raw()
        await register_vector_async(conn)
        await conn.execute(
            sql.SQL(
                "CREATE TEMP TABLE IF NOT EXISTS {staging} (id text, embedding {type},"
                " job text, model text, truncated boolean, meta text) ON COMMIT DELETE ROWS"
            ).format(
                staging=sql.Identifier(f"{self.table}_staging"),
                type=sql.SQL(f"{self.vector_type}({self.dim})"),
            )
        )
        self._conn = conn
        return conn

    async def _upsert(self, results: list[Result]) -> None:
        from pgvector import HalfVector, Vector
        from psycopg import sql

        conn = await self._connection()
        staging = sql.Identifier(f"{self.table}_staging")
        wrap = HalfVector if self.vector_type == "halfvec" else Vector
        dtype = np.float16 if self.vector_type == "halfvec" else np.float32
        try:
            async with conn.transaction(), conn.cursor() as cursor:
                copy_sql = sql.SQL(
                    "COPY {staging} (id, embedding, job, model, truncated, meta)"
                    " FROM STDIN (FORMAT BINARY)"
                ).format(staging=staging)
                async with cursor.copy(copy_sql) as copy:
                    copy.set_types(["text", self.vector_type, "text", "text", "bool", "text"])
                    for r in sorted(results, key=lambda r: r.id):
                        await copy.write_row(
                            (
                                r.id,
                                wrap(np.asarray(r.vector, dtype=dtype)),
                                r.job,
                                r.model,
                                r.truncated,
                                meta_to_json(r.meta),
                            )
                        )
                await cursor.execute(
                    sql.SQL(
                        "INSERT INTO {table} (id, embedding, job, model, truncated, meta)"
                        " SELECT id, embedding, job, model, truncated, meta::jsonb"
                        " FROM {staging} ORDER BY id"
                        " ON CONFLICT (id) DO UPDATE SET embedding = EXCLUDED.embedding,"
                        " job = EXCLUDED.job, model = EXCLUDED.model,"
                        " truncated = EXCLUDED.truncated, meta = EXCLUDED.meta,"
                        " updated_at = now()"
                    ).format(table=sql.Identifier(self.table), staging=staging)
                )
        except Exception:
            # A failed COPY can leave the connection mid-protocol; start clean on the retry.
            await conn.close()
            raise

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None
        await super().close()


async def column_type(conn: psycopg.AsyncConnection, table: str) -> tuple[str, int] | None:
    """("halfvec", 384) for the table's ``embedding`` column, or None if there is none."""
    from psycopg import sql

    query = sql.SQL(
        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute"
        " WHERE attrelid = to_regclass({name}) AND attname = 'embedding' AND NOT attisdropped"
    ).format(name=sql.Literal(sql.Identifier(table).as_string(conn)))
    row = await (await conn.execute(query)).fetchone()
    if row is None:
        return None
    name, _, rest = str(row[0]).partition("(")
    return name, int(rest.rstrip(")") or 0)
