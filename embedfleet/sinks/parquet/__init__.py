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
from embedfleet.sinks.parquet.sink import ParquetSink

__all__ = [
    "MANIFESTS",
    "STALE_TEMPORARY_S",
    "ObjectStoreUnavailable",
    "ParquetBackend",
    "ParquetSink",
    "ShardWriteError",
    "open_location",
    "storage_error",
]
