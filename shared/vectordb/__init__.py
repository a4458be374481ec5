"""The vector databases: where ``EMBEDFLEET_SINK`` points, and one backend module per database.

``target`` parses the URL; ``backend`` is the small interface every database implements (set
up, upsert, nearest, build index, export rows); ``lancedb``, ``pgvector`` and ``qdrant`` each do
all of it for their database and are imported only when opened (their clients are extras).
"""

from __future__ import annotations

from embedfleet.shared.vectordb.backend import (
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
from embedfleet.shared.vectordb.target import (
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
    "Extras",
    "Hit",
    "MissingExtraError",
    "SinkKind",
    "SinkSetupError",
    "SinkTarget",
    "SinkURLError",
    "StoredRow",
    "StoredVector",
    "VectorBackend",
    "VectorDBError",
    "VectorDType",
    "local_sink_url",
    "meta_from_json",
    "meta_to_json",
    "open_backend",
    "parse_sink_url",
    "prune_job",
    "reciprocal_rank_fusion",
    "require_extra",
]
