"""LanceDB, embedded: a directory on disk, fp16 vectors, upserted by id.

Each upsert is a ``merge_insert`` on ``id`` that commits a new table version with a small
fragment; the writer compacts every ``COMPACT_EVERY`` upserts (and on close) so a long bulk
load does not leave thousands of tiny files behind. Search is exact until ``embedfleet index``
builds IVF_HNSW_SQ, which it does only from ``MIN_INDEX_ROWS`` rows (or with ``--force``).

A model with several representations (BGE-M3, ``Extras``) adds nullable columns, the same in
LanceDB and in Parquet shards (both write ``arrow_rows``): ``sparse_indices`` (list of uint32,
ascending) and ``sparse_values`` (list of float32, one per index), and ``multivector`` (a list
of fixed-size lists of float16: the per-token vectors in token order).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from embedfleet.shared.fault_kinds import FaultRules, System
from embedfleet.shared.logging import get_logger
from embedfleet.sinks.backend import (
    BINARY_DTYPES,
    DEFAULT_DTYPE,
    FLOAT_DTYPES,
    NO_EXTRAS,
    RESCORE_MULTIPLIER,
    ROW_FIELDS,
    Extras,
    SinkSetupError,
    StoredRow,
    VectorBackend,
    VectorDBError,
    meta_from_json,
    meta_to_json,
    rescore_binary,
    rescore_codes,
    row_fields,
    sql_string,
)
from embedfleet.sinks.store import Store

if TYPE_CHECKING:
    import pyarrow as pa
    from lancedb.query import LanceVectorQueryBuilder
    from lancedb.table import Table

    from embedfleet.shared.protocol import Result
    from embedfleet.sinks.backend import Hit, StoredVector, VectorDType

log = get_logger("embedfleet.sink")

COMPACT_EVERY = 100
VECTOR_COLUMN = "vector"  # LanceDB's default vector column name: plain `table.search(q)` finds it
# Under this many rows a brute-force scan of fp16 vectors takes milliseconds and an approximate
# index would only cost recall; LanceDB's own guidance starts indexing around here.
MIN_INDEX_ROWS = 100_000
# A reader name (``embedfleet migrate``'s alias) is a small JSON file beside the tables,
# ``<alias>.alias.json`` = {"alias": ..., "table": ...}, replaced in one rename(2): LanceDB has no
# aliases of its own, and a rename is atomic on every POSIX file system.
ALIAS_SUFFIX = ".alias.json"


# The precision and dimension a table holds, in its schema metadata: binary and ubinary rows
# are both packed bits (uint8, dim / 8 per row), told apart only by this.
DTYPE_KEY = b"embedfleet_dtype"
DIM_KEY = b"embedfleet_dim"
SPARSE_DIM_KEY = b"embedfleet_sparse_dim"
MULTIVECTOR_DIM_KEY = b"embedfleet_multivector_dim"
SPARSE_COLUMNS = ("sparse_indices", "sparse_values")
MULTIVECTOR_COLUMN = "multivector"


def extra_fields(extras: Extras) -> list[pa.Field]:
    """The nullable columns ``extras`` add (see the module docstring)."""
    import pyarrow as pa

    fields = []
    if extras.sparse_dim:
        fields += [
            pa.field(SPARSE_COLUMNS[0], pa.list_(pa.uint32())),
            pa.field(SPARSE_COLUMNS[1], pa.list_(pa.float32())),
        ]
    if extras.multivector_dim:
        row = pa.list_(pa.float16(), extras.multivector_dim)
        fields.append(pa.field(MULTIVECTOR_COLUMN, pa.list_(row)))
    return fields


def lance_schema(
    dim: int, dtype: VectorDType = DEFAULT_DTYPE, extras: Extras = NO_EXTRAS
) -> pa.Schema:
    """Fixed-size lists of float16/float32/int8/uint8; binary types as uint8 lists of the packed
    bits (LanceDB's Hamming distance reads those); the ``extras`` columns after the row's."""
    import pyarrow as pa

    value_type = pa.uint8() if dtype in BINARY_DTYPES else pa.from_numpy_dtype(np.dtype(dtype))
    width = (dim + 7) // 8 if dtype in BINARY_DTYPES else dim
    metadata = {DTYPE_KEY: dtype.encode(), DIM_KEY: str(dim).encode()}
    if extras.sparse_dim:
        metadata[SPARSE_DIM_KEY] = str(extras.sparse_dim).encode()
    if extras.multivector_dim:
        metadata[MULTIVECTOR_DIM_KEY] = str(extras.multivector_dim).encode()
    return pa.schema(
        [
            pa.field("id", pa.string(), nullable=False),
            pa.field(VECTOR_COLUMN, pa.list_(value_type, width), False),
            pa.field("job", pa.string()),
            pa.field("model", pa.string(), nullable=False),
            pa.field("truncated", pa.bool_(), nullable=False),
            pa.field("meta", pa.string()),  # JSON text: meta has no fixed schema
            pa.field("text", pa.string()),
            *extra_fields(extras),
        ],
        metadata=metadata,
    )


def stored_format(schema: pa.Schema) -> tuple[str, int]:
    """(dtype, dimension) of a table: from its metadata, or (older tables) its vector type."""
    field = schema.field(VECTOR_COLUMN)
    metadata = schema.metadata or {}
    if DTYPE_KEY in metadata:
        return metadata[DTYPE_KEY].decode(), int(metadata[DIM_KEY])
    return str(field.type.value_type.to_pandas_dtype().__name__), field.type.list_size


def arrow_rows(backend: VectorBackend, results: Sequence[Result], schema: pa.Schema) -> pa.Table:
    """``results`` as rows of ``schema`` (a ``lance_schema``), vectors in its precision: what a
    LanceDB upsert and a Parquet shard both write. A ValueError names a row of another
    precision or dimension."""
    import pyarrow as pa

    vector_type = schema.field(VECTOR_COLUMN).type
    dtype, dim = stored_format(schema)
    if dtype in FLOAT_DTYPES:
        vectors = backend.float_vectors(results, vector_type.value_type.to_pandas_dtype(), dim)
    else:
        vectors = backend.quantized_vectors(results, dtype, dim)
    columns: dict[str, Any] = {
        "id": [r.id for r in results],
        VECTOR_COLUMN: pa.FixedSizeListArray.from_arrays(
            pa.array(vectors.reshape(-1), type=vector_type.value_type), vector_type.list_size
        ),
        "job": [r.job for r in results],
        "model": [r.model for r in results],
        "truncated": [r.truncated for r in results],
        "meta": [meta_to_json(r.meta) for r in results],
        "text": [backend.stored_text(r) for r in results],
    }
    if SPARSE_COLUMNS[0] in schema.names:
        columns[SPARSE_COLUMNS[0]] = [
            None if r.sparse is None else r.sparse.indices.astype(np.uint32) for r in results
        ]
        columns[SPARSE_COLUMNS[1]] = [
            None if r.sparse is None else r.sparse.values.astype(np.float32) for r in results
        ]
    if MULTIVECTOR_COLUMN in schema.names:
        columns[MULTIVECTOR_COLUMN] = [
            None if r.multivector is None else list(r.multivector.floats().astype(np.float16))
            for r in results
        ]
    return pa.table(columns, schema=schema)


def vector_matrix(table: pa.Table) -> np.ndarray:
    """The vector column of ``table`` as one (rows, width) array, in its stored type (floats,
    codes, or packed bits)."""
    width = table.schema.field(VECTOR_COLUMN).type.list_size
    flat = table[VECTOR_COLUMN].combine_chunks().flatten().to_numpy(zero_copy_only=False)
    return np.asarray(flat).reshape(-1, width)


def row_columns(schema: pa.Schema) -> list[str]:
    """The row fields a table of ``schema`` has (one from before texts were stored has none)."""
    return [name for name in ROW_FIELDS if name in schema.names]


def top_hits(backend: VectorBackend, table: pa.Table, scores: np.ndarray, k: int) -> list[Hit]:
    """The ``k`` rows of ``table`` with the highest ``scores`` (one per row), best first, ties
    in row order: an exact scan's answer."""
    best = np.argsort(-scores, kind="stable")[:k]
    rows = table.take(best).select(row_columns(table.schema)).to_pylist()
    return [
        backend.hit(row, meta_from_json(row["meta"]), float(scores[i]))
        for i, row in zip(best, rows, strict=True)
    ]


def _vector_search(table: Table, query: np.ndarray) -> LanceVectorQueryBuilder:
    """``table.search`` for a vector, typed as the vector query it is: the abstract
    ``Table.search`` is typed as returning any ``LanceQueryBuilder``, which has no
    ``distance_type``; only ``LanceTable``'s overloads say a vector gets a vector query."""
    return cast("LanceVectorQueryBuilder", table.search(query, vector_column_name=VECTOR_COLUMN))


class LanceDBBackend(VectorBackend):
    DTYPES = (*FLOAT_DTYPES, "int8", "uint8", *BINARY_DTYPES)
    system = System.LANCEDB

    def __init__(self, target: Any, *, store_text: bool = True) -> None:
        super().__init__(target, store_text=store_text)
        self._table: Table | None = None
        self._schema: pa.Schema | None = None  # set by setup: what upserts write
        self._writes = 0

    # --- writing ---------------------------------------------------------------------------
    def setup(
        self, model: str, dim: int, dtype: VectorDType | None = None, extras: Extras = NO_EXTRAS
    ) -> None:
        try:
            self._table, stored = self._open_or_create(dim, dtype, extras)
        except SinkSetupError:
            raise
        except Exception as error:  # a directory that cannot be created or read, ...
            raise SinkSetupError(
                f"cannot open {self.target.describe()}: {type(error).__name__}: {error}"
            ) from error
        self._schema = lance_schema(dim, stored, extras)  # type: ignore[arg-type]

    def _open_or_create(
        self, dim: int, dtype: VectorDType | None, extras: Extras
    ) -> tuple[Table, str]:
        import lancedb
        import pyarrow as pa

        database = lancedb.connect(self.target.location)
        name = self.target.table
        try:
            table = database.open_table(name)
        except ValueError:  # not found; exist_ok covers a worker that created it meanwhile
            schema = lance_schema(dim, dtype or DEFAULT_DTYPE, extras)
            table = database.create_table(name, schema=schema, exist_ok=True)
            log.info("created LanceDB table", path=self.target.location, table=name, dim=dim)
        field = table.schema.field(VECTOR_COLUMN) if VECTOR_COLUMN in table.schema.names else None
        if field is None or getattr(field.type, "list_size", None) is None:
            raise self.dim_mismatch("no fixed-size vector column", dim)
        stored, existing = stored_format(table.schema)
        if existing != dim:
            raise self.dim_mismatch(f"{existing}-dim vectors", dim)
        if dtype is not None and stored != dtype:
            raise self.dtype_mismatch(stored, dtype)
        missing = [f.name for f in extra_fields(extras) if f.name not in table.schema.names]
        if missing:
            raise SinkSetupError(
                f"{self.target.describe()} has no {', '.join(missing)} column, which this "
                "model's rows bring: set EMBEDFLEET_SINK_TABLE to a new table name"
            )
        if "text" not in table.schema.names:  # a table from before texts were stored
            try:
                table.add_columns(pa.field("text", pa.string()))
            except Exception:  # another worker added it first
                table.checkout_latest()
                if "text" not in table.schema.names:
                    raise
        return table, stored

    def upsert(self, results: Sequence[Result]) -> None:
        if self._table is None or self._schema is None:
            raise RuntimeError("LanceDBBackend.setup(model, dim) must run before upsert()")
        (
            self._table.merge_insert("id")
            .when_matched_update_all()
            .when_not_matched_insert_all()
            .execute(arrow_rows(self, results, self._schema))
        )
        self._writes += 1
        if self._writes % COMPACT_EVERY == 0:
            self._compact()

    def _compact(self) -> None:
        # Best effort: the rows are already durable; a failed compaction (say, racing another
        # worker's commit) is retried at the next round.
        if self._table is None:
            return
        try:
            self._table.optimize()
        except Exception as error:
            log.warning("LanceDB compaction failed; will retry", error=str(error))

    def close(self) -> None:
        if self._schema is not None and self._writes % COMPACT_EVERY:
            self._compact()
        self._table = None
        self._schema = None
        self._writes = 0

    # --- reading ---------------------------------------------------------------------------
    def _opened(self) -> Table:
        if self._table is None:
            import lancedb

            try:
                self._table = lancedb.connect(self.target.location).open_table(self.resolve())
            except ValueError:
                raise self.not_written_yet() from None
        return self._table

    # --- migrations ------------------------------------------------------------------------
    def _alias_file(self, alias: str) -> Path:
        return Path(self.target.location) / f"{alias}{ALIAS_SUFFIX}"

    def _exists(self, name: str) -> bool:
        return (Path(self.target.location) / f"{name}.lance").is_dir()

    def resolve(self) -> str:
        name = self.target.table
        pointer = self._alias_file(name)
        if self._exists(name) or not pointer.is_file():
            return name
        return str(json.loads(pointer.read_text())["table"])

    def point_alias(self, alias: str) -> None:
        if self._exists(alias):
            raise VectorDBError(
                f"{alias!r} is a LanceDB table in {self.target.location}, not an alias: choose "
                "another reader name"
            )
        pointer = self._alias_file(alias)
        scratch = pointer.with_name(f".{pointer.name}.{os.getpid()}")
        scratch.write_text(json.dumps({"alias": alias, "table": self.target.table}))
        with scratch.open("rb") as written:
            os.fsync(written.fileno())
        os.replace(scratch, pointer)  # the one atomic step: readers see the old or the new

    def scan_rows(self, after: str | None, limit: int) -> tuple[list[StoredRow], str | None]:
        # LanceDB's plain queries have no ORDER BY: the rows after the cursor (without their
        # vectors) are read and the first ``limit`` by id kept
        table = self._opened()
        query = table.search().select(row_columns(table.schema)).limit(None)
        if after is not None:
            query = query.where("id > '" + after.replace("'", "''") + "'")
        data = query.to_arrow().sort_by("id").slice(0, limit)
        rows = [
            StoredRow(**row_fields(row, meta_from_json(row["meta"]))) for row in data.to_pylist()
        ]
        return rows, (rows[-1].id if len(rows) == limit else None)

    def count_rows(self) -> int:
        return int(self._opened().count_rows())

    def drop_table(self) -> None:
        import lancedb

        self._table = None
        lancedb.connect(self.target.location).drop_table(self.target.table)

    def vector_format(self) -> tuple[str, int]:
        return stored_format(self._opened().schema)

    def nearest(self, vector: np.ndarray, k: int = 10) -> list[Hit]:
        table = self._opened()
        query = np.asarray(vector, np.float32).reshape(-1)
        dtype, dim = stored_format(table.schema)
        if dtype in BINARY_DTYPES:
            return self._nearest_binary(table, query, dim, k)
        if dtype not in FLOAT_DTYPES:
            return self._nearest_codes(table, query, k)
        rows = (
            _vector_search(table, query)
            .distance_type("cosine")
            .limit(k)
            .select([*row_columns(table.schema), "_distance"])
            .to_list()
        )
        return [
            # LanceDB's cosine distance is 1 - similarity
            self.hit(row, meta_from_json(row["meta"]), 1.0 - float(row["_distance"]))
            for row in rows
        ]

    def _nearest_binary(self, table: Table, query: np.ndarray, dim: int, k: int) -> list[Hit]:
        """Hamming distance on the packed bits for k x RESCORE_MULTIPLIER candidates, then the
        float query against their bits decides the order (the score is that dot product)."""
        bits = np.packbits(query[:dim] > 0)
        rows = (
            _vector_search(table, bits)
            # typed Literal["l2", "cosine", "dot"] by LanceDB, which takes "hamming" for its
            # binary vectors too
            .distance_type("hamming")  # type: ignore[arg-type]
            .limit(k * RESCORE_MULTIPLIER)
            .select([*row_columns(table.schema), VECTOR_COLUMN])
            .to_list()
        )
        if not rows:
            return []
        scores = rescore_binary(query, np.array([row[VECTOR_COLUMN] for row in rows]), dim)
        best = np.argsort(-scores, kind="stable")[:k]
        return [self.hit(rows[i], meta_from_json(rows[i]["meta"]), float(scores[i])) for i in best]

    def _nearest_codes(self, table: Table, query: np.ndarray, k: int) -> list[Hit]:
        """int8/uint8 rows: LanceDB has no distance for them, so an exact scan scores every row
        with the float query against its codes (int8 rescoring over the whole table)."""
        data = table.to_arrow()
        if data.num_rows == 0:
            return []
        return top_hits(self, data, rescore_codes(query, vector_matrix(data)), k)

    def build_index(self, *, force: bool = False) -> list[str]:
        from lancedb.index import BTree, IvfHnswSq

        table = self._opened()
        table.optimize()  # compact the upserts' small fragments first: the index covers them all
        rows = table.count_rows()
        # the id index makes each upsert's match on id a lookup instead of a scan of the table
        table.create_index("id", config=BTree(), replace=True)
        done = [f"{self.target.describe()}: {rows:,} rows, compacted; id index (BTree) built"]
        dtype, _ = stored_format(table.schema)
        if dtype not in FLOAT_DTYPES:
            done.append(
                f"vector index not built: the table holds {dtype} vectors, searched exactly "
                "(binary: Hamming distance, then rescored; int8/uint8: a scan)"
            )
            return done
        if rows < MIN_INDEX_ROWS and not force:
            done.append(
                f"vector index not built: under {MIN_INDEX_ROWS:,} rows an exact search "
                "is fast and exact (pass --force to build IVF_HNSW_SQ anyway)"
            )
            return done
        started = time.perf_counter()
        table.create_index(VECTOR_COLUMN, config=IvfHnswSq(distance_type="cosine"), replace=True)
        seconds = time.perf_counter() - started
        done.append(f"vector index IVF_HNSW_SQ (cosine) built in {seconds:.1f} s")
        return done

    def job_ids(self, job: str) -> set[str]:
        rows = (
            self._opened()
            .search()
            .where(f"job = {sql_string(job)}")
            .select(["id"])
            .limit(None)
            .to_arrow()
        )
        return {str(value) for value in rows["id"].to_pylist()}

    def delete_ids(self, ids: Sequence[str]) -> None:
        if ids:
            self._opened().delete(f"id IN ({', '.join(sql_string(i) for i in ids)})")

    def export_rows(self, job: str | None = None) -> list[StoredVector]:
        import pyarrow.compute as pc

        table = self._opened()
        data = table.to_arrow()
        if job is not None:
            data = data.filter(pc.equal(data["job"], job))
        data = data.sort_by("id")
        vectors = vector_matrix(data)  # floats become float16 in stored(); codes stay
        columns = data.select(row_columns(table.schema)).to_pylist()
        return [
            self.stored(row, meta_from_json(row["meta"]), vectors[i])
            for i, row in enumerate(columns)
        ]


# LanceDB's errors are its (logs, metrics, the setting to change); what they mean is the common
# rules' (an Arrow value it cannot store is a ValueError: that row)
FAULTS = FaultRules(System.LANCEDB, ("lancedb", "pyarrow", "lance"))

STORE = Store(
    kind="lancedb",
    schemes=("lancedb",),
    forms="lancedb:///path/to/dir",
    describe="LanceDB table {table!r} in {location}",
    backend=LanceDBBackend,
    extra="lancedb",
    needs=("lancedb", "pyarrow"),
    local="lancedb",
    faults=FAULTS,
)
