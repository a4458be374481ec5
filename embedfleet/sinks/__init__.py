"""Where vectors go: one home for every store ``EMBEDFLEET_SINK`` can name.

``backend`` is the reader-side contract every database implements (set up, upsert, nearest,
build index, export rows, prune, migrate) and ``sink`` the worker-side one (write a batch and
acknowledge its entries). One module per store holds both sides and ends with its ``Store``
declaration (``store.py``: its schemes, extra, backend, sink): ``redis_stream`` (the results
stream), ``lancedb``, ``pgvector``, ``qdrant`` (server and local mode) and ``parquet/``.
``registry`` lists the stores, one line each, and derives the rest from them: parsing
``EMBEDFLEET_SINK`` (``target`` is what it gives), the kinds, the extras, the worker's sink
(``build_sink``) and the reader's backend (``open_backend``). A database's client library is an
extra, imported only when opened. ``reply`` writes the answers of chunks that carry a reply
key. May import only ``embedfleet.shared``.
"""

from __future__ import annotations

from embedfleet.sinks.backend import (
    DEFAULT_DTYPE,
    NO_EXTRAS,
    RRF_K,
    Extras,
    Hit,
    MissingExtraError,
    SinkSetupError,
    StoredRow,
    StoredVector,
    VectorBackend,
    VectorDBError,
    VectorDType,
    meta_from_json,
    meta_to_json,
    prune_job,
    reciprocal_rank_fusion,
)
from embedfleet.sinks.redis_stream import RedisStreamSink
from embedfleet.sinks.registry import (
    SINK_URL_FORMS,
    STORES,
    build_sink,
    check_sink,
    database_kinds,
    kinds,
    local_sink_url,
    open_backend,
    parse_sink_url,
    require_extra,
    sink_for_target,
    store_of,
)
from embedfleet.sinks.sink import (
    DatabaseSink,
    Delivery,
    Sink,
    latest_per_id,
    queue_acknowledgements,
)
from embedfleet.sinks.store import Store
from embedfleet.sinks.target import SinkKind, SinkTarget, SinkURLError

__all__ = [
    "DEFAULT_DTYPE",
    "NO_EXTRAS",
    "RRF_K",
    "SINK_URL_FORMS",
    "STORES",
    "DatabaseSink",
    "Delivery",
    "Extras",
    "Hit",
    "MissingExtraError",
    "RedisStreamSink",
    "Sink",
    "SinkKind",
    "SinkSetupError",
    "SinkTarget",
    "SinkURLError",
    "Store",
    "StoredRow",
    "StoredVector",
    "VectorBackend",
    "VectorDBError",
    "VectorDType",
    "build_sink",
    "check_sink",
    "database_kinds",
    "kinds",
    "latest_per_id",
    "local_sink_url",
    "meta_from_json",
    "meta_to_json",
    "open_backend",
    "parse_sink_url",
    "prune_job",
    "queue_acknowledgements",
    "reciprocal_rank_fusion",
    "require_extra",
    "sink_for_target",
    "store_of",
]
