"""Sink settings: where the workers write vectors (embedfleet/sinks/), and how."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from embedfleet.shared.settings.section import Section


class SinkSettings(Section):
    """The vector store ``EMBEDFLEET_SINK`` names, its table, and the Parquet sink's shards."""

    title: ClassVar[str] = "Vector sink"

    sink: str = "redis"
    """Where workers write vectors, read by `embedfleet search`: `redis` (the results stream),
    `lancedb:///path/to/dir`, `postgresql://user:password@host/db` (pgvector), `qdrant://host:6333`
    or `https://:API_KEY@host:6333` (Qdrant server), `qdrant+local:///path/to/dir` (Qdrant local
    mode, one process). `embedfleet demo` defaults to LanceDB in its --out-dir."""
    sink_table: str = "embeddings"
    """Table (LanceDB, PostgreSQL) or collection (Qdrant) the sink upserts into; created with the
    model's dimension when missing."""
    sink_statement_timeout_s: float = Field(default=60.0, gt=0)
    """Longest a PostgreSQL sink statement (an upsert, the table's creation) may run before the
    server cancels it (`statement_timeout`), and a connection attempt may wait (`connect_timeout`,
    unless the URL sets one): a hung upsert fails as a transient fault, so the batch
    is retried while its entries stay pending; a sink call that outlives three times this bound (a
    server that no longer answers the connection, which cannot cancel anything) turns the worker's
    `/healthz` red, so it is restarted and others reclaim its entries."""
    store_text: bool = True
    """Database sinks store each chunk's text beside its vector, so `embedfleet search` shows what
    it found. `false` if you keep the texts elsewhere (the column stays, empty)."""
    s3_endpoint_url: str = ""
    """The S3-compatible server of an `s3://bucket/prefix` sink (MinIO, Ceph, R2, ...), e.g.
    `http://minio:9000`; empty = AWS. Credentials and region come from the standard AWS variables
    (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`) or files."""
    parquet_shard_rows: int = Field(default=100_000, ge=1)
    """The Parquet sink writes a shard once it holds this many rows."""
    parquet_shard_bytes: int = Field(default=128 * 1024 * 1024, ge=1024)
    """...or this many bytes of vectors, ids, texts and metadata (before compression), whichever
    comes first: what one worker holds in memory."""
    parquet_shard_max_s: float = Field(default=20.0, gt=0)
    """...or once its first row is this old. Its entries stay unacknowledged until the shard is
    written, so this must be at most half of EMBEDFLEET_RECLAIM_IDLE_MS (checked at start)."""

    @property
    def parquet_sink(self) -> bool:
        """Whether EMBEDFLEET_SINK is the Parquet sink (``parquet://`` or ``s3://``)."""
        return self.sink.strip().lower().startswith(("parquet://", "s3://"))
