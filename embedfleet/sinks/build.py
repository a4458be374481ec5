"""Where vectors go. A sink writes a batch of results and acknowledges their entries.

``EMBEDFLEET_SINK`` picks one (``build_sink``): the Redis results stream (default), a vector
database (LanceDB, PostgreSQL + pgvector, Qdrant) through its ``embedfleet.sinks`` backend, or
Parquet shards in a folder or on S3 (``ParquetSink``, which acknowledges per stored shard).
Every sink upserts by chunk id and acknowledges only after its write is durable, so delivery
stays at-least-once and a redelivery never duplicates a row. The database client libraries are
optional extras, imported only when their backend is chosen.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from embedfleet.shared.logging import get_logger
from embedfleet.shared.settings import Settings
from embedfleet.sinks.backend import MissingExtraError, VectorDType, open_backend, require_extra
from embedfleet.sinks.redis_stream import RedisStreamSink
from embedfleet.sinks.sink import (
    DatabaseSink,
    Delivery,
    Sink,
    SinkSetupError,
    latest_per_id,
    queue_acknowledgements,
)
from embedfleet.sinks.target import SinkTarget, SinkURLError, parse_sink_url

log = get_logger(__name__)

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


def check_sink(settings: Settings) -> SinkTarget:
    """Parse EMBEDFLEET_SINK and check its client library is installed; connects to nothing."""
    target = parse_sink_url(settings.sink, settings.sink_table, settings.s3_endpoint_url)
    require_extra(target.kind)
    return target


def build_sink(settings: Settings, client: aioredis.Redis) -> Sink:
    """The sink ``EMBEDFLEET_SINK`` names; SinkURLError says which forms exist when it is bad.

    A database sink stores EMBEDFLEET_OUTPUT_DTYPE's vectors natively; its setup refuses, with
    SinkSetupError, a precision the database cannot hold.
    """
    target = parse_sink_url(settings.sink, settings.sink_table, settings.s3_endpoint_url)
    if target.kind == "redis":
        return sink_for_target(target, settings, client)
    return sink_for_target(target, settings, client, dtype=settings.output_dtype)


def sink_for_target(
    target: SinkTarget,
    settings: Settings,
    client: aioredis.Redis,
    *,
    dtype: VectorDType | None = None,
) -> Sink:
    if target.kind == "redis":
        return RedisStreamSink(client, settings.keys, settings.results_max_entries)
    backend = open_backend(target, store_text=settings.store_text)
    backend.statement_timeout_s = settings.sink_statement_timeout_s
    if target.kind == "parquet":
        from embedfleet.sinks.parquet import ParquetBackend, ParquetSink  # pyarrow: when chosen

        assert isinstance(backend, ParquetBackend)  # open_backend's class for the kind
        if settings.parquet_shard_rows * 2 > settings.backlog_high_water:
            # A shard's entries stay in the ingest stream until it is written, and the producer
            # counts them against the mark: with shards this large it waits for every shard,
            # and the fleet runs at about high_water / shard_max_s (measured: loadtest.drain).
            log.warning(
                "parquet shards hold more than half the backlog mark: producers will wait for "
                "each shard. Lower EMBEDFLEET_PARQUET_SHARD_ROWS or raise "
                "EMBEDFLEET_BACKLOG_HIGH_WATER",
                shard_rows=settings.parquet_shard_rows,
                high_water=settings.backlog_high_water,
                at_most_per_s=round(settings.backlog_high_water / settings.parquet_shard_max_s),
            )
        return ParquetSink(
            client,
            settings.keys,
            backend,
            writer=settings.consumer,
            shard_rows=settings.parquet_shard_rows,
            shard_bytes=settings.parquet_shard_bytes,
            shard_max_s=settings.parquet_shard_max_s,
            dtype=dtype,
        )
    return DatabaseSink(client, settings.keys, backend, dtype=dtype)
