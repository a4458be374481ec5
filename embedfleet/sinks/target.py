"""Where the vectors are: ``EMBEDFLEET_SINK`` parsed into a ``SinkTarget``, and the layout.

Workers write and ``embedfleet search`` / ``index`` / ``results`` read through the backend this
names (``embedfleet.sinks.open_backend``), so both sides agree on where the vectors are and how
they are laid out:

=============  ================================================================================
backend        layout (one row / point per chunk id; ``EMBEDFLEET_SINK_TABLE`` names it)
=============  ================================================================================
LanceDB        columns ``id`` (string), ``vector`` (fixed-size list of float16), ``job``,
               ``model``, ``truncated``, ``meta`` (JSON text), ``text``
PostgreSQL     ``id text primary key``, ``embedding halfvec(dim)`` (``vector(dim)`` before
               pgvector 0.7), ``job``, ``model``, ``truncated``, ``meta jsonb``, ``text``,
               ``updated_at``
Qdrant         point id ``uuid5(NAMESPACE_URL, id)``, payload ``id``, ``job``, ``model``,
               ``truncated``, ``meta`` (a nested object: filter on ``meta.<key>``), ``text``
Parquet        LanceDB's columns, in immutable shards ``<UTC time>-<consumer>-<n>.parquet`` of
               a local folder (``parquet:///dir``) or an S3 prefix (``s3://bucket/prefix``),
               one manifest per shard in ``_manifests/``; read back one row per id, the last
               shard's winning (``embedfleet/sinks/parquet/dataset.py``)
=============  ================================================================================

``text`` is the chunk's text (``EMBEDFLEET_STORE_TEXT``, on by default; null when off).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

SinkKind = Literal["redis", "lancedb", "pgvector", "qdrant", "qdrant-local", "parquet"]

SINK_URL_FORMS = (
    "redis (the results stream), lancedb:///path/to/dir, postgresql://user:password@host/db, "
    "qdrant://host:6333 (or http://, https://), qdrant+local:///path/to/dir, "
    "parquet:///path/to/dir, s3://bucket/prefix (Parquet)"
)
# PostgreSQL identifiers are the strictest of the three backends; one rule keeps a table name
# portable between them and safe to quote.
_TABLE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


class SinkURLError(ValueError):
    """EMBEDFLEET_SINK or EMBEDFLEET_SINK_TABLE is not something a sink can be built from."""


@dataclass(frozen=True)
class SinkTarget:
    """Where vectors go: the backend, its location (path, DSN or URL) and the table name."""

    kind: SinkKind
    location: str
    table: str
    api_key: str | None = None  # Qdrant Cloud: given as the URL's password
    # Parquet on S3: the S3-compatible server to use instead of AWS (EMBEDFLEET_S3_ENDPOINT_URL)
    endpoint_url: str = ""

    def describe(self) -> str:
        """For people: "LanceDB table 'embeddings' in /data/lancedb"; never shows secrets."""
        if self.kind == "redis":
            return "the Redis results stream"
        if self.kind == "lancedb":
            return f"LanceDB table {self.table!r} in {self.location}"
        if self.kind == "pgvector":
            return f"PostgreSQL table {self.table!r} at {_without_password(self.location)}"
        if self.kind == "qdrant-local":
            return f"Qdrant (local mode) collection {self.table!r} in {self.location}"
        if self.kind == "parquet":
            return f"the Parquet dataset {self.location}"
        return f"Qdrant collection {self.table!r} at {self.location}"


def parse_sink_url(url: str, table: str = "embeddings", s3_endpoint_url: str = "") -> SinkTarget:
    """Read ``EMBEDFLEET_SINK``; unknown forms raise SinkURLError naming the accepted ones.

    ``s3_endpoint_url`` (EMBEDFLEET_S3_ENDPOINT_URL) goes with an ``s3://`` target."""
    if not _TABLE_NAME.match(table):
        raise SinkURLError(
            f"EMBEDFLEET_SINK_TABLE={table!r} is not a valid table name: use letters, digits and "
            "underscores, starting with a letter or underscore (at most 63 characters)"
        )
    raw = url.strip()
    scheme, separator, rest = raw.partition("://")
    scheme = scheme.lower()
    if raw.lower() == "redis" or (scheme in ("redis", "rediss") and separator and not rest):
        return SinkTarget("redis", "", table)
    if not separator:
        raise SinkURLError(f"EMBEDFLEET_SINK={url!r} is not a URL; use one of: {SINK_URL_FORMS}")
    if scheme == "lancedb":
        return SinkTarget("lancedb", _path_of(url, rest), table)
    if scheme == "qdrant+local":
        return SinkTarget("qdrant-local", _path_of(url, rest), table)
    if scheme == "parquet":
        return SinkTarget("parquet", _path_of(url, rest), table)
    if scheme == "s3":
        bucket = rest.split("/")[0]
        if not bucket:
            raise SinkURLError(f"EMBEDFLEET_SINK={url!r} names no bucket, e.g. s3://bucket/prefix")
        location = "s3://" + rest.rstrip("/")
        return SinkTarget("parquet", location, table, endpoint_url=s3_endpoint_url)
    if scheme in ("postgresql", "postgres", "postgresql+psycopg"):
        # psycopg takes the libpq URL as is; the SQLAlchemy-style dialect suffix is dropped
        return SinkTarget("pgvector", f"postgresql://{rest}", table)
    if scheme in ("qdrant", "http", "https"):
        return _qdrant_target(url, "https" if scheme == "https" else "http", rest, table)
    if scheme in ("redis", "rediss"):
        raise SinkURLError(
            f"EMBEDFLEET_SINK={url!r}: the redis sink writes to the queue's own server "
            "(EMBEDFLEET_REDIS_URL); set EMBEDFLEET_SINK=redis"
        )
    raise SinkURLError(
        f"EMBEDFLEET_SINK={url!r}: unknown sink scheme {scheme + '://'!r}; "
        f"use one of: {SINK_URL_FORMS}"
    )


def local_sink_url(kind: str, directory: Path, postgres_uri: str | None = None) -> str:
    """``EMBEDFLEET_SINK`` for a sink on this machine (tests, benchmarks, the demo).

    The embedded databases (LanceDB, Qdrant local mode) live in ``directory``; PostgreSQL is a
    server, so a ``pgvector*`` kind takes its URI.
    """
    if kind == "redis":
        return "redis"
    if kind == "lancedb":
        return f"lancedb://{directory / 'lancedb'}"
    if kind == "qdrant-local":
        return f"qdrant+local://{directory / 'qdrant'}"
    if kind == "parquet":
        return f"parquet://{directory / 'parquet'}"
    if kind.startswith("pgvector") and postgres_uri is not None:
        return postgres_uri
    raise SinkURLError(f"no local {kind} sink (a pgvector sink needs the server's URI)")


def _path_of(url: str, rest: str) -> str:
    # lancedb:///abs/dir → /abs/dir; lancedb://rel/dir → rel/dir (relative to the working dir)
    if not rest or rest == "/":
        raise SinkURLError(
            f"EMBEDFLEET_SINK={url!r} names no directory, e.g. lancedb:///data/lancedb"
        )
    return rest


def _qdrant_target(url: str, scheme: str, rest: str, table: str) -> SinkTarget:
    credentials, at, host = rest.rpartition("@")
    if not host.split("/")[0]:
        raise SinkURLError(f"EMBEDFLEET_SINK={url!r} names no host, e.g. qdrant://localhost:6333")
    api_key = (credentials.partition(":")[2] or None) if at else None
    hostport = host.split("/")[0]
    if ":" not in hostport.rsplit("]", 1)[-1]:
        hostport += ":6333"  # Qdrant's REST port, not the scheme's 80/443
    return SinkTarget("qdrant", f"{scheme}://{hostport}", table, api_key=api_key)


def _without_password(dsn: str) -> str:
    return re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", dsn)
