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

``text`` is the chunk's text (``EMBEDFLEET_STORE_TEXT``, on by default; null when off); an image
chunk's row holds its ``image_ref`` there, where the image came from (a path, an ``s3://`` URI;
null without one), never the image's bytes (``Chunk.row_text``).

Which URL names which store is each store's own declaration (its ``Store``: schemes, how it
reads the rest of the URL, how it describes itself); ``embedfleet.sinks.registry`` parses a URL
by them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple

# a registered store's kind ("lancedb", "qdrant-local", ...): embedfleet.sinks.registry.KINDS
SinkKind = str

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
    # how its store says it, a template of {table} and {location} (the store's ``describe``)
    described: str = field(default="", repr=False, compare=False)

    def describe(self) -> str:
        """For people: "LanceDB table 'embeddings' in /data/lancedb"; never shows secrets."""
        template = self.described or "the {kind} sink {table!r} at {location}"
        return template.format(
            kind=self.kind, table=self.table, location=_without_password(self.location)
        )


class SinkURL(NamedTuple):
    """``EMBEDFLEET_SINK`` taken apart, for the store its scheme names to read the rest."""

    url: str  # as given
    scheme: str  # lower case, without "://"
    rest: str  # what follows "://"
    table: str  # EMBEDFLEET_SINK_TABLE, checked
    s3_endpoint_url: str  # EMBEDFLEET_S3_ENDPOINT_URL

    def path(self) -> str:
        """The directory of a ``scheme:///dir`` URL (``scheme://rel/dir``: relative to the
        working directory); SinkURLError when it names none."""
        if not self.rest or self.rest == "/":
            raise SinkURLError(
                f"EMBEDFLEET_SINK={self.url!r} names no directory, e.g. lancedb:///data/lancedb"
            )
        return self.rest


def check_table(table: str) -> None:
    if not _TABLE_NAME.match(table):
        raise SinkURLError(
            f"EMBEDFLEET_SINK_TABLE={table!r} is not a valid table name: use letters, digits and "
            "underscores, starting with a letter or underscore (at most 63 characters)"
        )


def _without_password(dsn: str) -> str:
    return re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", dsn)
