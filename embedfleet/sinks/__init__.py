"""Where vectors go: one home for every store ``EMBEDFLEET_SINK`` can name.

``target`` parses the URL; ``backend`` is the reader-side contract every database implements
(set up, upsert, nearest, build index, export rows, prune, migrate) and ``sink`` the worker-side
one (write a batch and acknowledge its entries); ``build`` makes the worker's sink. One module per
store holds both sides: ``redis_stream`` (the results stream), ``lancedb``, ``pgvector``,
``qdrant`` and ``parquet``; a database's client library is an extra, imported only when opened.
``reply`` writes the answers of chunks that carry a reply key. May import only
``embedfleet.shared``.
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
    open_backend,
    prune_job,
    reciprocal_rank_fusion,
    require_extra,
)
from embedfleet.sinks.build import build_sink, check_sink, sink_for_target
from embedfleet.sinks.redis_stream import RedisStreamSink
from embedfleet.sinks.sink import (
    DatabaseSink,
    Delivery,
    Sink,
    latest_per_id,
    queue_acknowledgements,
)
from embedfleet.sinks.target import (
    SINK_URL_FORMS,
    SinkKind,
    SinkTarget,
    SinkURLError,
    local_sink_url,
    parse_sink_url,
)

__all__ = [
    "DEFAULT_DTYPE",
    "NO_EXTRAS",
    "RRF_K",
    "SINK_URL_FORMS",
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
    "StoredRow",
    "StoredVector",
    "VectorBackend",
    "VectorDBError",
    "VectorDType",
    "build_sink",
    "check_sink",
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
]
