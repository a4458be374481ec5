"""LanceDB, embedded: a directory on disk, fp16 vectors, upserted by id.

LanceDB's Python client is synchronous, so every call runs on the sink's own thread. Each
upsert commits a new table version with a small fragment; the sink compacts every
``COMPACT_EVERY`` writes so a long bulk load does not leave thousands of tiny files behind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import redis.asyncio as aioredis
from embedfleet.shared.keys import Keys
from embedfleet.shared.logging import get_logger
from embedfleet.shared.protocol import Result
from embedfleet.shared.vectordb import meta_to_json
from embedfleet.workers.sinks.base import DatabaseSink, Delivery, SinkSetupError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from lancedb.table import Table

log = get_logger("embedfleet.sink")
COMPACT_EVERY = 100
VECTOR_COLUMN = "vector"  # LanceDB's default vector column name: plain `table.search(q)` finds it


def lance_schema(dim: int) -> pa.Schema:
    return pa.schema(
        [
            pa.field("id", pa.string(), nullable=False),
            pa.field(VECTOR_COLUMN, pa.list_(pa.float16(), dim), nullable=False),
            pa.field("job", pa.string()),
            pa.field("model", pa.string(), nullable=False),
            pa.field("truncated", pa.bool_(), nullable=False),
            pa.field("meta", pa.string()),  # JSON text: meta has no fixed schema
        ]
    )


class LanceDBSink(DatabaseSink):
    def __init__(self, client: aioredis.Redis, keys: Keys, path: str, table: str) -> None:
        super().__init__(client, keys)
        self.path = path
        self.table_name = table
        self._table: Table | None = None
        self._schema: pa.Schema | None = None
        self._writes = 0

    async def setup(self, model: str, dim: int) -> None:
        try:
            self._table = await self._blocking(self._open_or_create, dim)
        except SinkSetupError:
            raise
        except Exception as error:  # a directory that cannot be created or read, ...
            raise SinkSetupError(
                f"cannot open LanceDB table {self.table_name!r} in {self.path}: "
                f"{type(error).__name__}: {error}"
            ) from error
        self._schema = lance_schema(dim)

    def _open_or_create(self, dim: int) -> Table:
        import lancedb

        database = lancedb.connect(self.path)
        try:
            table = database.open_table(self.table_name)
        except ValueError:  # not found; exist_ok covers a worker that created it meanwhile
            table = database.create_table(self.table_name, schema=lance_schema(dim), exist_ok=True)
            log.info("created LanceDB table", path=self.path, table=self.table_name, dim=dim)
        field = table.schema.field(VECTOR_COLUMN) if VECTOR_COLUMN in table.schema.names else None
        existing = getattr(field.type, "list_size", None) if field is not None else None
        if existing != dim:
            has = "no fixed-size vector column" if existing is None else f"{existing}-dim vectors"
            raise SinkSetupError(
                f"LanceDB table {self.table_name!r} in {self.path} has {has}, the model makes "
                f"{dim}-dim vectors: set EMBEDFLEET_SINK_TABLE to a new table name, or delete "
                "the old table"
            )
        return table

    async def write(self, results: Sequence[Result], deliveries: Sequence[Delivery]) -> None:
        await super().write(results, deliveries)
        self._writes += 1
        if self._writes % COMPACT_EVERY == 0:
            await self._blocking(self._compact)

    async def _upsert(self, results: list[Result]) -> None:
        if self._table is None or self._schema is None:
            raise RuntimeError("LanceDBSink.setup(model, dim) must run before write()")
        batch = self._arrow(results, self._schema)
        await self._blocking(self._merge, self._table, batch)

    @staticmethod
    def _arrow(results: list[Result], schema: pa.Schema) -> pa.Table:
        dim = schema.field(VECTOR_COLUMN).type.list_size
        vectors = np.stack([np.asarray(r.vector, dtype=np.float16) for r in results])
        if vectors.shape[1] != dim:
            raise ValueError(f"vectors have {vectors.shape[1]} dimensions, the table {dim}")
        columns: dict[str, Any] = {
            "id": [r.id for r in results],
            VECTOR_COLUMN: pa.FixedSizeListArray.from_arrays(
                pa.array(vectors.reshape(-1), type=pa.float16()), dim
            ),
            "job": [r.job for r in results],
            "model": [r.model for r in results],
            "truncated": [r.truncated for r in results],
            "meta": [meta_to_json(r.meta) for r in results],
        }
        return pa.table(columns, schema=schema)

    @staticmethod
    def _merge(table: Table, batch: pa.Table) -> None:
        (
            table.merge_insert("id")
            .when_matched_update_all()
            .when_not_matched_insert_all()
            .execute(batch)
        )

    def _compact(self) -> None:
        # Best effort: the rows are already durable and acknowledged; a failed compaction (say,
        # racing another worker's commit) is retried at the next round.
        if self._table is None:
            return
        try:
            self._table.optimize()
        except Exception as error:
            log.warning("LanceDB compaction failed; will retry", error=str(error))

    async def close(self) -> None:
        if self._table is not None and self._writes % COMPACT_EVERY:
            await self._blocking(self._compact)
        await super().close()
