"""The Parquet store: ``parquet:///dir`` or ``s3://bucket/prefix``.

Its two sides are each a module: ``dataset`` is the layout, the atomic shard write and the reader
(``ParquetBackend``: search, export), ``sink`` the worker's write path (``ParquetSink``, which
acknowledges per stored shard).
"""

from __future__ import annotations

from embedfleet.sinks.parquet.dataset import (
    MANIFESTS,
    STALE_TEMPORARY_S,
    ObjectStoreUnavailable,
    ParquetBackend,
    ShardWriteError,
    open_location,
    storage_error,
)
from embedfleet.sinks.parquet.sink import ParquetSink, parquet_sink
from embedfleet.sinks.store import Store
from embedfleet.sinks.target import SinkTarget, SinkURL, SinkURLError

__all__ = [
    "MANIFESTS",
    "STALE_TEMPORARY_S",
    "STORE",
    "ObjectStoreUnavailable",
    "ParquetBackend",
    "ParquetSink",
    "ShardWriteError",
    "open_location",
    "storage_error",
]


def _dataset_target(url: SinkURL) -> SinkTarget:
    if url.scheme != "s3":
        return STORE.target(url.path(), url.table)
    if not url.rest.split("/")[0]:
        raise SinkURLError(f"EMBEDFLEET_SINK={url.url!r} names no bucket, e.g. s3://bucket/prefix")
    location = "s3://" + url.rest.rstrip("/")
    return STORE.target(location, url.table, endpoint_url=url.s3_endpoint_url)


STORE = Store(
    kind="parquet",
    schemes=("parquet", "s3"),
    forms="parquet:///path/to/dir, s3://bucket/prefix (Parquet)",
    describe="the Parquet dataset {location}",
    backend=ParquetBackend,
    extra="parquet",
    needs=("pyarrow",),
    local="parquet",
    parse=_dataset_target,
    sink=parquet_sink,
)
