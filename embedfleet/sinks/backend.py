"""One small interface over the vector databases: set up, upsert, nearest, build index, export.

Each database has one module beside this one (``lancedb``, ``pgvector``, ``qdrant``) that does
all of it, so its SQL, client construction and layout live in one place. The worker's sink
writes through a backend (``embedfleet.sinks.DatabaseSink``); ``embedfleet search``, ``index`` and
``results`` read through one. The client libraries are optional extras, imported only when
their backend is opened (``registry.open_backend``).

Everything here is synchronous, as the client libraries are: the worker calls its backend from
one dedicated thread (a client is never used from two threads at once), the CLI through
``asyncio.to_thread``.
"""

from __future__ import annotations

import abc
import base64
import contextlib
import dataclasses
import json
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from embedfleet.shared.fault_kinds import System
from embedfleet.shared.protocol import Result, SparseVector
from embedfleet.sinks.target import SinkTarget

# What one stored vector component is: the output dtypes (shared/protocol.py). float16 is the
# default everywhere (half of float32's size, and the precision results travel in); float32 is
# what pgvector before 0.7 stores. Each backend lists the ones it stores natively (``DTYPES``)
# and the worker's sink refuses the others at setup.
VectorDType = Literal["float16", "float32", "int8", "uint8", "binary", "ubinary"]
FLOAT_DTYPES: tuple[str, ...] = ("float16", "float32")
BINARY_DTYPES: tuple[str, ...] = ("binary", "ubinary")
DEFAULT_DTYPE: VectorDType = "float16"
# Binary search finds this many times k candidates by Hamming distance, then rescores them with
# the float query against their bits (sentence-transformers' binary search + rescoring recipe).
RESCORE_MULTIPLIER = 4
# The row fields every backend stores beside the vector (see embedfleet/sinks/target.py).
ROW_FIELDS = ("id", "job", "model", "truncated", "meta", "text")


@dataclass(frozen=True)
class Extras:
    """What a table keeps beside each row's dense vector, for a model that gives several
    representations from one pass (BGE-M3): sparse weights over ``sparse_dim`` entries (the
    vocabulary) and per-token vectors of ``multivector_dim`` values. A row whose chunk did not
    ask for one stores none (NULL, or no named vector)."""

    sparse_dim: int | None = None
    multivector_dim: int | None = None

    def __bool__(self) -> bool:
        return bool(self.sparse_dim or self.multivector_dim)


NO_EXTRAS = Extras()
# RRF's constant (Cormack et al. 2009, and what Elasticsearch and OpenSearch default to)
RRF_K = 60


def reciprocal_rank_fusion(rankings: Sequence[Sequence[Hit]], k: int = RRF_K) -> list[Hit]:
    """Rankings fused by reciprocal rank: each id scores the sum over the rankings it is in of
    ``1 / (k + rank)``, rank 1 the best; best first, ties by id. A hit keeps the row of the
    first ranking that has it and the fused score."""
    scores: dict[str, float] = {}
    rows: dict[str, Hit] = {}
    for ranking in rankings:
        for rank, hit in enumerate(ranking, start=1):
            scores[hit.id] = scores.get(hit.id, 0.0) + 1.0 / (k + rank)
            rows.setdefault(hit.id, hit)
    order = sorted(scores, key=lambda chunk_id: (-scores[chunk_id], chunk_id))
    return [dataclasses.replace(rows[chunk_id], score=scores[chunk_id]) for chunk_id in order]


class VectorDBError(RuntimeError):
    """The vector database cannot be read as asked; the message says what to do."""


class SinkSetupError(RuntimeError):
    """The database cannot take this model's vectors as it is; the message says what to do."""


class MissingExtraError(RuntimeError):
    """The chosen backend's client library is not installed; the message has the pip command."""


@dataclass(frozen=True, kw_only=True)
class StoredRow:
    """What a backend keeps beside each vector, one row per chunk id."""

    id: str
    job: str | None
    model: str | None
    truncated: bool
    meta: dict[str, Any] | None
    text: str | None  # None when EMBEDFLEET_STORE_TEXT was off (or the row predates it)

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in ROW_FIELDS}


@dataclass(frozen=True, kw_only=True)
class Hit(StoredRow):
    """One nearest neighbour: cosine similarity (1 = same direction) and the stored row."""

    score: float

    def as_dict(self) -> dict[str, Any]:
        return {"score": round(self.score, 6), **super().as_dict()}


@dataclass(frozen=True, kw_only=True)
class StoredVector(StoredRow):
    """One stored row with its vector (float16, as the results stream carries it)."""

    vector: np.ndarray


def row_fields(record: Mapping[str, Any], meta: dict[str, Any] | None) -> dict[str, Any]:
    """``StoredRow``'s fields from a row or payload holding ``ROW_FIELDS`` (``text`` optional)."""
    return {
        "id": str(record["id"]),
        "job": record.get("job"),
        "model": record.get("model"),
        "truncated": bool(record.get("truncated")),
        "meta": meta,
        "text": record.get("text"),
    }


class VectorBackend(contextlib.AbstractContextManager["VectorBackend"], abc.ABC):
    """One vector database, written by the worker and read by the CLI.

    A writer calls ``setup`` once (it creates the table), then ``upsert`` per micro-batch. A
    reader calls ``nearest``, ``build_index`` or ``export_rows`` directly; they raise
    VectorDBError when there is nothing to read yet. ``close`` releases the connection.
    """

    # the vector dtypes this database stores natively (see VectorDType)
    DTYPES: tuple[str, ...] = FLOAT_DTYPES
    # the system its errors are filed under (shared/fault_kinds.py): logs, metrics, the setting
    system: System = System.UNKNOWN
    # The longest one statement may run (the worker's sink sets EMBEDFLEET_SINK_STATEMENT_TIMEOUT_S;
    # None: the database's own default). A backend whose server can enforce it does (PostgreSQL's
    # statement_timeout): a hung write then fails as a transient fault instead of waiting for ever.
    statement_timeout_s: float | None = None

    def __init__(self, target: SinkTarget, *, store_text: bool = True) -> None:
        self.target = target
        self.store_text = store_text

    def vector_format(self) -> tuple[str, int]:
        """(dtype, dimension) of the stored vectors: what a search must embed its query as."""
        raise VectorDBError(f"{self.target.describe()} cannot say what it stores")

    # --- writing (the worker's sink) -------------------------------------------------------
    @abc.abstractmethod
    def setup(
        self, model: str, dim: int, dtype: VectorDType | None = None, extras: Extras = NO_EXTRAS
    ) -> None:
        """Create the table if missing; check an existing one takes ``dim``-dim vectors.

        ``dtype`` None: float16 for a new table (float32 where the database has no float16),
        and whatever an existing table stores; a given ``dtype`` must match an existing table.
        ``extras``: the sparse and per-token vectors it keeps too (a backend that cannot
        raises SinkSetupError). Raises SinkSetupError naming the setting to change.
        """

    @abc.abstractmethod
    def upsert(self, results: Sequence[Result]) -> None:
        """Insert or replace the rows of ``results`` by id (unique here); durable on return."""

    # --- reading ---------------------------------------------------------------------------
    @abc.abstractmethod
    def nearest(self, vector: np.ndarray, k: int = 10) -> list[Hit]:
        """The ``k`` stored rows closest to ``vector`` by cosine similarity, best first."""

    def nearest_sparse(self, sparse: SparseVector, k: int = 10) -> list[Hit]:
        """The ``k`` stored rows with the largest dot product of their sparse weights with
        ``sparse``, best first (the score is that dot product); rows without weights never."""
        raise VectorDBError(
            f"{self.target.describe()} has no sparse search: hybrid search runs on Qdrant and "
            "PostgreSQL (pgvector sparsevec)"
        )

    @abc.abstractmethod
    def build_index(self, *, force: bool = False) -> list[str]:
        """Build the approximate nearest-neighbour index after a bulk load; what was done.

        Upserts never index: maintaining a graph per micro-batch slows a bulk load many times
        over, and an index built once over all the rows is better.
        """

    @abc.abstractmethod
    def export_rows(self, job: str | None = None) -> list[StoredVector]:
        """Every stored row (optionally one job's), one per id, sorted by id."""

    # --- migrations (``embedfleet migrate``, embedfleet/ops/migration.py) -----------------------
    # A migration copies a table's stored texts into a new table written by another model, then
    # switches readers with one atomic step: the reader name (the alias) is a Qdrant collection
    # alias, a PostgreSQL view, a LanceDB pointer file. A backend opened on an alias reads the
    # table it points at.
    def scan_rows(self, after: str | None, limit: int) -> tuple[list[StoredRow], str | None]:
        """Up to ``limit`` stored rows (no vectors) after the cursor ``after`` (None: from the
        start), and the cursor to pass next (None once there are no more). The cursor is the
        backend's own string (a chunk id, a Qdrant point id), so a copy resumes where it was."""
        raise self.no_migrations()

    def count_rows(self) -> int:
        """How many rows (ids) the table holds."""
        raise self.no_migrations()

    def resolve(self) -> str:
        """The table ``target.table`` names now: itself, or the table the alias points at."""
        return self.target.table

    def point_alias(self, alias: str) -> None:
        """Point the reader name ``alias`` at this table in one atomic step, creating it if
        missing; refused (VectorDBError) when ``alias`` is a table itself."""
        raise self.no_migrations()

    def drop_table(self) -> None:
        """Delete this table and its rows (``embedfleet migrate finish --drop-old``)."""
        raise self.no_migrations()

    def no_migrations(self) -> VectorDBError:
        return VectorDBError(
            f"{self.target.describe()} cannot be migrated: a live migration needs a vector "
            "database sink (lancedb://, postgresql://, qdrant://)"
        )

    # --- pruning (`embedfleet prune`, `enqueue --prune`) --------------------------------------
    def job_ids(self, job: str) -> set[str]:
        """The ids of the rows whose ``job`` is ``job`` (the job that last wrote them)."""
        raise VectorDBError(f"{self.target.describe()} cannot list a job's rows")

    def delete_ids(self, ids: Sequence[str]) -> None:
        """Delete the rows of ``ids`` (those that exist); durable on return."""
        raise VectorDBError(f"{self.target.describe()} cannot delete rows")

    def close(self) -> None:
        """Release the connection; the next call opens a new one."""

    def __exit__(self, *exception: object) -> None:
        self.close()

    # --- for the backends --------------------------------------------------------------------
    def hit(self, record: Mapping[str, Any], meta: dict[str, Any] | None, score: float) -> Hit:
        """A search result from a row or payload holding ``ROW_FIELDS``."""
        return Hit(score=score, **row_fields(record, meta))

    def stored(
        self, record: Mapping[str, Any], meta: dict[str, Any] | None, vector: np.ndarray
    ) -> StoredVector:
        """An exported row from a row or payload holding ``ROW_FIELDS``, and its vector."""
        array = np.asarray(vector)
        if array.dtype.kind == "f":  # quantized vectors are exported as stored
            array = array.astype(np.float16)
        return StoredVector(vector=array, **row_fields(record, meta))

    def stored_text(self, result: Result) -> str | None:
        return result.text if self.store_text else None

    def float_vectors(self, results: Sequence[Result], dtype: Any, dim: int | None) -> np.ndarray:
        """The results' vectors as one (rows, dim) array of ``dtype``.

        A ValueError names the row a table cannot take (a result quantized by a chunk's
        ``dtype`` option, or truncated by its ``dimensions``): the sink dead-letters that row
        alone and writes the others.
        """
        for result in results:
            if result.dim == 0:
                raise ValueError(
                    f"row {result.id!r} has no dense vector (its chunk asked for "
                    "representations without 'dense'): a database row needs the dense vector "
                    "beside its sparse and per-token vectors; ask for 'dense' too, or read such "
                    "results from the Redis sink"
                )
            if result.dtype not in FLOAT_DTYPES:
                raise ValueError(
                    f"row {result.id!r}: {self.target.describe()} stores float vectors, and "
                    f"this result is {result.dtype} (the chunk's dtype option): send it without "
                    "one, or read such results from the Redis sink"
                )
            if dim is not None and result.dim != dim:
                raise ValueError(
                    f"row {result.id!r} has {result.dim} dimensions, {self.target.describe()} "
                    f"{dim} (the chunk's dimensions option?)"
                )
        return np.stack([np.asarray(r.vector, dtype=dtype) for r in results])

    def quantized_vectors(self, results: Sequence[Result], dtype: str, dim: int) -> np.ndarray:
        """The results' stored codes (int8/uint8) or packed bits as ``ubinary`` bytes (binary
        is each byte - 128, so + 128 gives the same bits), one row each; a ValueError names a
        row of another dtype or dimension (dead-lettered alone, as in float_vectors)."""
        for result in results:
            same = result.dtype == dtype or {result.dtype, dtype} == set(BINARY_DTYPES)
            if not same:
                raise ValueError(
                    f"row {result.id!r}: {self.target.describe()} stores {dtype} vectors, and "
                    f"this result is {result.dtype} (the chunk's dtype option)"
                )
            if result.dim != dim:
                raise ValueError(
                    f"row {result.id!r} has {result.dim} dimensions, {self.target.describe()} "
                    f"{dim} (the chunk's dimensions option?)"
                )
        if dtype in BINARY_DTYPES:
            return np.stack([_as_ubinary(r) for r in results])
        return np.stack([np.asarray(r.vector, dtype=dtype) for r in results])

    def not_written_yet(self) -> VectorDBError:
        return VectorDBError(
            f"no {self.target.describe()}: have workers written there yet? (EMBEDFLEET_SINK, "
            "EMBEDFLEET_SINK_TABLE)"
        )

    def dtype_mismatch(self, stored: str, requested: VectorDType) -> SinkSetupError:
        return SinkSetupError(
            f"{self.target.describe()} stores {stored} vectors, not {requested}: set "
            "EMBEDFLEET_SINK_TABLE to a new table name for the new precision"
        )

    def dim_mismatch(self, stored: str, dim: int) -> SinkSetupError:
        return SinkSetupError(
            f"{self.target.describe()} has {stored}, the model makes {dim}-dim vectors: set "
            "EMBEDFLEET_SINK_TABLE to a new table name, or delete the old one"
        )


def _as_ubinary(result: Result) -> np.ndarray:
    vector = np.asarray(result.vector)
    if result.dtype == "binary":
        return (vector.astype(np.int16) + 128).astype(np.uint8)
    return vector.astype(np.uint8)


def rescore_binary(query: np.ndarray, packed: np.ndarray, dim: int) -> np.ndarray:
    """Scores of bit-packed rows for a float query: query . bits (0/1), the rescoring step of
    sentence-transformers' binary search (``quantization.semantic_search_*`` with rescore)."""
    bits = np.unpackbits(packed.astype(np.uint8), axis=-1)[:, :dim].astype(np.float32)
    return bits @ np.asarray(query, np.float32).reshape(-1)[:dim]


def rescore_codes(query: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Scores of int8/uint8 rows for a float query: query . codes, uint8 centred as int8
    (int8 is uint8 - 128 in quantize_embeddings), the int8 rescoring step."""
    centred = codes.astype(np.float32) - (128.0 if codes.dtype == np.uint8 else 0.0)
    return centred @ np.asarray(query, np.float32).reshape(-1)


def meta_to_json(meta: dict[str, Any] | None) -> str | None:
    """Metadata as JSON text for the databases.

    msgpack can carry what JSON cannot: binary values become base64 strings and non-finite
    floats become the strings "nan"/"inf"/"-inf", so one odd chunk cannot fail its whole batch.
    """
    if meta is None:
        return None
    return json.dumps(_jsonable(meta), ensure_ascii=False, allow_nan=False)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def meta_from_json(text: str | None) -> dict[str, Any] | None:
    return None if text is None else json.loads(text)


def jsonable_meta(meta: dict[str, Any] | None) -> dict[str, Any] | None:
    """Metadata as a JSON value, for a store whose payload is JSON (Qdrant): what
    ``meta_to_json`` writes, read back (binary as base64, non-finite floats as strings)."""
    return meta_from_json(meta_to_json(meta))


# ids per delete statement (an IN list, an ANY array, a point list)
PRUNE_BATCH = 1000


def prune_job(
    backend: VectorBackend, job: str, keep: Collection[str], *, dry_run: bool = False
) -> list[str]:
    """Delete the rows of ``job`` whose ids are not in ``keep`` (the ids its latest run sent):
    the chunks removed from its corpus since the run before. Returns those ids, sorted (with
    ``dry_run``, only says which). A row another job wrote last is not the job's, and stays."""
    gone = sorted(backend.job_ids(job) - set(keep))
    if not dry_run:
        for start in range(0, len(gone), PRUNE_BATCH):
            backend.delete_ids(gone[start : start + PRUNE_BATCH])
    return gone


def sql_string(value: str) -> str:
    """A SQL string literal (single quotes doubled), for the filters LanceDB takes as text."""
    return "'" + value.replace("'", "''") + "'"
