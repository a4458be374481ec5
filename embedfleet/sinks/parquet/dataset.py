"""Parquet datasets: immutable shards in a local folder or under an S3 prefix.

The Parquet sink (``embedfleet/sinks/parquet/sink.py``) writes them; ``embedfleet results`` and
``search`` read them through this backend; LanceDB, DuckDB and ``pyarrow.dataset`` load the
folder as it is. ``EMBEDFLEET_SINK=parquet:///data/run`` or ``s3://bucket/prefix``
(``EMBEDFLEET_S3_ENDPOINT_URL`` for an S3-compatible server; credentials from the standard AWS
variables, read by ``pyarrow.fs.S3FileSystem`` itself)::

    <root>/20261201T120000123456Z-<consumer>-000001-<random>.parquet   the rows of one shard
    <root>/_manifests/<same name>.json                                 written after its shard

Rows have LanceDB's columns (``lancedb.lance_schema``, so a dataset loads into a LanceDB table
unchanged): ``id``, ``vector`` (fixed-size list of float16 / float32 / int8 / uint8, or the packed
bits as uint8 for binary / ubinary, told apart by the schema's metadata), ``job``, ``model``,
``truncated``, ``meta`` (JSON text), ``text``. Names starting with ``_`` or ``.`` are skipped by
``pyarrow.dataset`` and match no ``*.parquet`` glob, so the manifests and temporary files are
never read as data.

**Atomic shards.** A shard is serialised in memory, then stored under its final name in one
step: on S3 one upload of the final key (one PUT, multipart for a shard over pyarrow's part
size: an object is visible only once its upload completes); in a folder a temporary
``.<name>.tmp`` beside it, fsynced, renamed over, and the folder fsynced. A writer killed on
the way leaves no partial ``.parquet``.

**One manifest per shard**, not one appended list: an S3 object cannot be appended to, and many
workers rewriting one list lose each other's updates without conditional writes; a manifest of
its own needs no coordination. It says what the shard holds (rows, bytes, model, dimension,
precision, writer, rows per job) without opening it, and the sink checks a new run against the
latest one (another dimension or precision in the same place is refused).

**Duplicates.** Entries are acknowledged after their shard is durable. A worker killed in
between leaves them pending; another worker embeds them again into a later shard. Readers keep
one row per id, the last one: shards in name order (the time they were written), rows in order,
as the results stream keeps the latest result per id. A plain ``SELECT`` over the folder may see
such an id twice (docs/SINKS.md shows the query that keeps one).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import numpy as np

from embedfleet.shared.fault_kinds import System
from embedfleet.shared.logging import get_logger
from embedfleet.sinks.backend import (
    BINARY_DTYPES,
    DEFAULT_DTYPE,
    FLOAT_DTYPES,
    NO_EXTRAS,
    Extras,
    SinkSetupError,
    VectorBackend,
    VectorDBError,
    meta_from_json,
    rescore_binary,
    rescore_codes,
)
from embedfleet.sinks.lancedb import (
    arrow_rows,
    lance_schema,
    row_columns,
    stored_format,
    top_hits,
    vector_matrix,
)

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs as pafs

    from embedfleet.shared.protocol import Result
    from embedfleet.sinks.backend import Hit, StoredVector, VectorDType

log = get_logger("embedfleet.sink")

MANIFESTS = "_manifests"
SHARD_SUFFIX = ".parquet"
MANIFEST_FORMAT = 1
# a temporary shard file this old has no writer left (a live write renames it within seconds)
STALE_TEMPORARY_S = 15 * 60.0
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
# Words of the AWS SDK's errors (pyarrow raises them as OSError with the SDK's text) that mean
# the store is away or busy for now, not refusing us for good.
_PASSING_S3_ERRORS = (
    "NETWORK_CONNECTION",
    "SERVICE_UNAVAILABLE",
    "SLOW_DOWN",
    "INTERNAL_FAILURE",
    "THROTTLING",
    "REQUEST_TIMEOUT",
    "Connection refused",
    "Couldn't connect",
    "Could not connect",
    "timed out",
)

# A folder that is full (or over its quota) or whose network mount went stale: an outage of the
# store, waited out like S3 away, not a fault for a person to fix before the worker may go on.
_PASSING_FOLDER_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.ESTALE})


class ObjectStoreUnavailable(ConnectionError):
    """The folder or object store could not be reached, was busy or full; waited out
    (transient)."""


class ShardWriteError(RuntimeError):
    """Storing a shard failed for a reason no wait fixes (access denied, no such bucket)."""


def storage_error(error: Exception, doing: str) -> Exception:
    """An I/O error of the store as the fault it is (shared/fault_kinds.py): a ConnectionError
    (waited out) when it passes, else a RuntimeError (the worker's to report). Never a
    ValueError: pyarrow's ArrowInvalid is one, and the worker would take it for a bad row and
    dead-letter the batch at hand for a shard that failed to upload."""
    text = f"{doing}: {type(error).__name__}: {error}"
    if isinstance(error, OSError) and any(word in str(error) for word in _PASSING_S3_ERRORS):
        return ObjectStoreUnavailable(text)
    if isinstance(error, OSError) and error.errno in _PASSING_FOLDER_ERRNOS:
        return ObjectStoreUnavailable(text)
    if isinstance(error, TimeoutError | ConnectionError):
        return ObjectStoreUnavailable(text)
    return ShardWriteError(text)


@dataclass(frozen=True)
class Manifest:
    """What one shard holds, stored as ``_manifests/<shard>.json`` (``size_bytes``: the file)."""

    file: str
    rows: int
    size_bytes: int
    model: str
    dim: int
    dtype: str
    writer: str
    written_at: str
    jobs: dict[str, int] = field(default_factory=dict)  # rows per job ("" for none)
    format: int = MANIFEST_FORMAT

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        return cls(**json.loads(data))


def shard_name(writer: str, sequence: int) -> str:
    """``<UTC time to the µs>Z-<writer>-<n>-<random>``: names sort by the time of writing (the
    order readers keep the last row by), and never collide between workers."""
    now = datetime.now(UTC)
    stamp = now.strftime("%Y%m%dT%H%M%S") + f"{now.microsecond:06d}Z"
    return f"{stamp}-{_UNSAFE.sub('_', writer)[:64]}-{sequence:06d}-{uuid.uuid4().hex[:8]}"


def open_location(target: Any) -> tuple[pafs.FileSystem, str]:
    """The filesystem and root path of a Parquet ``SinkTarget``: a local folder, or an S3
    bucket/prefix on AWS or the target's ``endpoint_url``."""
    import pyarrow.fs as pafs

    location: str = target.location
    if not location.startswith("s3://"):
        return pafs.LocalFileSystem(), os.path.abspath(location)
    # delayed open: an object smaller than one upload part goes up as one PUT on close (else
    # pyarrow starts a multipart upload at open); larger ones as a multipart upload, which S3
    # also shows only once it completes
    s3 = s3_filesystem(target.endpoint_url, allow_delayed_open=True)
    return s3, location.removeprefix("s3://").rstrip("/")


def s3_filesystem(endpoint_url: str | None, **options: Any) -> pafs.S3FileSystem:
    """pyarrow's S3 filesystem on AWS, or on the S3-compatible server at ``endpoint_url``
    (EMBEDFLEET_S3_ENDPOINT_URL), its region from ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` and
    its credentials from the other ``AWS_*`` variables: the Parquet store's, and the workers'
    reads of images sent by reference (workers/image_sources.py)."""
    import pyarrow.fs as pafs

    if endpoint_url:
        endpoint = urlsplit(endpoint_url)
        options["endpoint_override"] = endpoint.netloc or endpoint.path
        options["scheme"] = endpoint.scheme or "https"
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        options["region"] = region
    return pafs.S3FileSystem(**options)


class ParquetBackend(VectorBackend):
    """A Parquet dataset as a vector backend: ``upsert`` writes one shard (the buffering sink
    calls ``rows`` per micro-batch and ``write_shard`` per shard), the reads scan it all."""

    DTYPES = (*FLOAT_DTYPES, "int8", "uint8", *BINARY_DTYPES)
    system = System.PARQUET

    def __init__(self, target: Any, *, store_text: bool = True) -> None:
        super().__init__(target, store_text=store_text)
        self._fs: pafs.FileSystem | None = None
        self._root = ""
        self._schema: pa.Schema | None = None  # set by setup: what shards hold
        self._model = ""
        self._sequence = 0

    @property
    def local(self) -> bool:
        return not self.target.location.startswith("s3://")

    def _location(self) -> tuple[pafs.FileSystem, str]:
        if self._fs is None:
            self._fs, self._root = open_location(self.target)
        return self._fs, self._root

    # --- writing ---------------------------------------------------------------------------
    def setup(
        self, model: str, dim: int, dtype: VectorDType | None = None, extras: Extras = NO_EXTRAS
    ) -> None:
        import pyarrow.fs as pafs

        fs, root = self._location()
        try:
            if self.local:
                os.makedirs(os.path.join(root, MANIFESTS), exist_ok=True)
                self.remove_stale_temporaries(root)
            else:
                bucket = root.split("/")[0]
                if fs.get_file_info(bucket).type == pafs.FileType.NotFound:
                    raise SinkSetupError(
                        f"{self.target.describe()}: the bucket {bucket!r} does not exist (or "
                        "these credentials cannot see it): create it, or fix EMBEDFLEET_SINK, "
                        "EMBEDFLEET_S3_ENDPOINT_URL and the AWS_* credentials"
                    )
            latest = self._latest_manifest()
        except SinkSetupError:
            raise
        except Exception as error:
            raise SinkSetupError(f"cannot open {self.target.describe()}: {error}") from (
                storage_error(error, "opening the dataset")
            )
        stored = dtype or DEFAULT_DTYPE
        if latest is not None:
            if latest.dim != dim:
                raise self.dim_mismatch(f"{latest.dim}-dim vectors", dim)
            if dtype is None:
                stored = latest.dtype  # type: ignore[assignment]
            elif latest.dtype != dtype:
                raise self.dtype_mismatch(latest.dtype, dtype)
        self._schema = lance_schema(dim, stored, extras)
        self._model = model

    def rows(self, results: Sequence[Result]) -> pa.Table:
        """The results as a shard's rows; a ValueError names a row of another precision or
        dimension (the worker dead-letters it alone)."""
        return arrow_rows(self, results, self._written_schema())

    def write_shard(self, tables: Sequence[pa.Table], writer: str) -> Manifest:
        """Store ``tables`` as one shard, atomically, then its manifest; durable on return.
        I/O errors come out as ``storage_error`` says (waited out, or the worker's)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = self._written_schema()
        table = pa.concat_tables(tables) if tables else schema.empty_table()
        self._sequence += 1
        name = shard_name(writer, self._sequence)
        buffer = pa.BufferOutputStream()
        pq.write_table(table, buffer, compression="zstd")
        data = buffer.getvalue().to_pybytes()
        jobs: dict[str, int] = {}
        for job in table.column("job").to_pylist():
            jobs[job or ""] = jobs.get(job or "", 0) + 1
        dtype, dim = stored_format(schema)
        manifest = Manifest(
            file=name + SHARD_SUFFIX,
            rows=table.num_rows,
            size_bytes=len(data),
            model=self._model,
            dim=dim,
            dtype=dtype,
            writer=writer,
            written_at=datetime.now(UTC).isoformat(),
            jobs=jobs,
        )
        try:
            self._put(name + SHARD_SUFFIX, data)
            self._put(f"{MANIFESTS}/{name}.json", manifest.to_json())
        except Exception as error:
            raise storage_error(error, f"writing {name}{SHARD_SUFFIX}") from error
        return manifest

    def upsert(self, results: Sequence[Result]) -> None:
        if results:
            self.write_shard([self.rows(results)], writer="upsert")

    def _written_schema(self) -> pa.Schema:
        if self._schema is None:
            raise RuntimeError("ParquetBackend.setup(model, dim) must run before writing")
        return self._schema

    def _put(self, relative: str, data: bytes) -> None:
        """``data`` under ``root/relative`` in one step: readers see all of it or nothing."""
        fs, root = self._location()
        if not self.local:
            # one upload of the final key: S3 shows an object only once its upload completes
            with fs.open_output_stream(f"{root}/{relative}") as stream:
                stream.write(data)
            return
        path = os.path.join(root, relative)
        directory, base = os.path.split(path)
        temporary = os.path.join(directory, f".{base}.tmp")  # hidden from readers and globs
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(descriptor, view) :]
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
            os.replace(temporary, path)
        except Exception:
            # A failed write (a full disk) removes its own file: the shard is tried again under
            # a new name, and each try would leave one more until the next start's sweep,
            # holding the space it waits for. Only a writer killed here leaves one behind.
            with contextlib.suppress(OSError):
                os.remove(temporary)
            raise
        folder = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(folder)  # the rename itself survives a power cut
        finally:
            os.close(folder)

    def close(self) -> None:
        self._fs = None

    @staticmethod
    def remove_stale_temporaries(root: str, older_than_s: float = STALE_TEMPORARY_S) -> list[str]:
        """Delete the ``.<name>.tmp`` files a writer killed mid-write left in ``root`` and its
        manifests folder (a live write renames its file within seconds; one older than
        ``older_than_s`` has no writer left). Returns the paths removed."""
        removed: list[str] = []
        cutoff = time.time() - older_than_s
        for folder in (root, os.path.join(root, MANIFESTS)):
            with contextlib.suppress(FileNotFoundError):
                for entry in os.scandir(folder):
                    if not (entry.name.startswith(".") and entry.name.endswith(".tmp")):
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        if entry.stat().st_mtime < cutoff:
                            os.remove(entry.path)
                            removed.append(entry.path)
        if removed:
            log.info("removed stale temporary shard files", files=len(removed), folder=root)
        return removed

    # --- reading ---------------------------------------------------------------------------
    def shard_files(self) -> list[str]:
        """The shards' paths on the filesystem, in name (writing) order."""
        import pyarrow.fs as pafs

        fs, root = self._location()
        try:
            infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
        except OSError as error:
            raise VectorDBError(f"cannot list {self.target.describe()}: {error}") from None
        names = [
            info.base_name
            for info in infos
            if info.type == pafs.FileType.File
            and info.base_name.endswith(SHARD_SUFFIX)
            and not info.base_name.startswith(("_", "."))
        ]
        return [f"{root}/{name}" for name in sorted(names)]

    def manifests(self) -> list[Manifest]:
        """Every shard's manifest, in name order."""
        import pyarrow.fs as pafs

        fs, root = self._location()
        infos = fs.get_file_info(pafs.FileSelector(f"{root}/{MANIFESTS}", allow_not_found=True))
        found = []
        for info in sorted(infos, key=lambda i: i.base_name):
            if info.type == pafs.FileType.File and info.base_name.endswith(".json"):
                with fs.open_input_stream(info.path) as stream:
                    found.append(Manifest.from_json(stream.read()))
        return found

    def _latest_manifest(self) -> Manifest | None:
        found = self.manifests()
        return found[-1] if found else None

    def latest_rows(self, columns: Sequence[str] | None = None) -> pa.Table:
        """One row per id, the last written (shards in name order, rows in order)."""
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        files = self.shard_files()
        if not files:
            raise self.not_written_yet()
        fs, _ = self._location()
        wanted = None if columns is None else list(dict.fromkeys(["id", *columns]))
        try:
            table = pa.concat_tables(
                pq.read_table(path, filesystem=fs, columns=wanted) for path in files
            )
        except (pa.ArrowInvalid, OSError) as error:
            raise VectorDBError(f"cannot read {self.target.describe()}: {error}") from None
        order = pa.array(np.arange(table.num_rows, dtype=np.int64))
        numbered = table.append_column("__order", order)
        last = numbered.group_by("id", use_threads=False).aggregate([("__order", "max")])
        keep = pc.sort_indices(last.column("__order_max"))
        return table.take(pc.take(last.column("__order_max"), keep))

    def vector_format(self) -> tuple[str, int]:
        latest = self._latest_manifest()
        if latest is not None:
            return latest.dtype, latest.dim
        import pyarrow.parquet as pq

        files = self.shard_files()
        if not files:
            raise self.not_written_yet()
        fs, _ = self._location()
        return stored_format(pq.read_schema(files[-1], filesystem=fs))

    def nearest(self, vector: np.ndarray, k: int = 10) -> list[Hit]:
        """An exact scan: every row scored against the float query (cosine for floats; the
        rescoring of sentence-transformers for codes and bits, as the other backends do)."""
        table = self.latest_rows()
        if table.num_rows == 0:
            return []
        dtype, dim = stored_format(table.schema)
        query = np.asarray(vector, np.float32).reshape(-1)
        stored = vector_matrix(table)
        if dtype in BINARY_DTYPES:
            scores = rescore_binary(query, stored, dim)
        elif dtype in FLOAT_DTYPES:
            floats = stored.astype(np.float32)
            norms = np.linalg.norm(floats, axis=1) * max(float(np.linalg.norm(query)), 1e-12)
            scores = floats @ query / np.maximum(norms, 1e-12)
        else:
            scores = rescore_codes(query, stored)
        return top_hits(self, table, scores, k)

    def build_index(self, *, force: bool = False) -> list[str]:
        files = self.shard_files()
        return [
            f"{self.target.describe()}: {len(files)} shards; Parquet has no vector index "
            "(searched by an exact scan): load it into LanceDB to index it (docs/SINKS.md)"
        ]

    def export_rows(self, job: str | None = None) -> list[StoredVector]:
        import pyarrow.compute as pc

        table = self.latest_rows()
        if job is not None:
            table = table.filter(pc.equal(table["job"], job))
        table = table.sort_by("id")
        vectors = vector_matrix(table)
        columns = table.select(row_columns(table.schema)).to_pylist()
        return [
            self.stored(row, meta_from_json(row["meta"]), vectors[i])
            for i, row in enumerate(columns)
        ]
