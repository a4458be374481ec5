"""Where vectors go. A sink writes a batch of results and acknowledges their entries.

``EMBEDFLEET_SINK`` picks one (``build_sink``): the Redis results stream (default), LanceDB,
PostgreSQL + pgvector or Qdrant. Every sink upserts by chunk id and acknowledges only after its
write is durable, so delivery stays at-least-once and a redelivery never duplicates a row.
The database client libraries are optional extras, imported only when their sink is chosen.
"""

from __future__ import annotations

import importlib.util

import redis.asyncio as aioredis
from embedfleet.shared.settings import Settings
from embedfleet.shared.vectordb import SinkTarget, SinkURLError, parse_sink_url
from embedfleet.workers.sinks.base import (
    DatabaseSink,
    Delivery,
    Sink,
    SinkSetupError,
    latest_per_id,
    queue_acknowledgements,
)
from embedfleet.workers.sinks.redis_stream import RedisStreamSink

__all__ = [
    "DatabaseSink",
    "Delivery",
    "MissingExtraError",
    "RedisStreamSink",
    "Sink",
    "SinkSetupError",
    "SinkURLError",
    "build_sink",
    "check_sink",
    "latest_per_id",
    "queue_acknowledgements",
    "sink_for_target",
]

# backend → (modules it imports, the pip extra that installs them)
_EXTRAS = {
    "lancedb": (("lancedb", "pyarrow"), "lancedb"),
    "pgvector": (("psycopg", "pgvector"), "pgvector"),
    "qdrant": (("qdrant_client",), "qdrant"),
    "qdrant-local": (("qdrant_client",), "qdrant"),
}


class MissingExtraError(RuntimeError):
    """The chosen sink's client library is not installed; the message has the pip command."""


def require_extra(kind: str) -> None:
    """Fail with the install command, rather than an ImportError deep inside a sink."""
    modules, extra = _EXTRAS.get(kind, ((), ""))
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtraError(
            f"the {kind} sink needs {', '.join(missing)}: pip install 'embedfleet[{extra}]'"
        )


def check_sink(settings: Settings) -> SinkTarget:
    """Parse EMBEDFLEET_SINK and check its client library is installed; connects to nothing."""
    target = parse_sink_url(settings.sink, settings.sink_table)
    require_extra(target.kind)
    return target


def build_sink(settings: Settings, client: aioredis.Redis) -> Sink:
    """The sink ``EMBEDFLEET_SINK`` names; SinkURLError says which forms exist when it is bad."""
    return sink_for_target(parse_sink_url(settings.sink, settings.sink_table), settings, client)


def sink_for_target(target: SinkTarget, settings: Settings, client: aioredis.Redis) -> Sink:
    require_extra(target.kind)
    if target.kind == "redis":
        return RedisStreamSink(client, settings.keys)
    if target.kind == "lancedb":
        from embedfleet.workers.sinks.lancedb import LanceDBSink

        return LanceDBSink(client, settings.keys, target.location, target.table)
    if target.kind == "pgvector":
        from embedfleet.workers.sinks.pgvector import PgvectorSink

        return PgvectorSink(client, settings.keys, target.location, target.table)
    from embedfleet.workers.sinks.qdrant import QdrantSink

    return QdrantSink(
        client,
        settings.keys,
        target.location,
        target.table,
        local=target.kind == "qdrant-local",
        api_key=target.api_key,
    )
