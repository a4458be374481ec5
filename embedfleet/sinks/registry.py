"""The stores ``EMBEDFLEET_SINK`` can name, one line each, and what is derived from them.

Each store declares itself in its own module (``Store``: schemes, extra, backend, sink); this is
the one list of them. The kinds, the URL forms the messages list, the database kinds prune and
migrate accept, the extras, the worker's sink, the reader's backend and the fault rules every
side classifies errors by (registered at import) all come from it: a new
store is its module and one line here. A kind or scheme nobody registered fails loudly, naming
it and the registered ones.
"""

from __future__ import annotations

from pathlib import Path

import redis.asyncio as aioredis

import embedfleet.sinks.lancedb as lancedb
import embedfleet.sinks.parquet as parquet
import embedfleet.sinks.pgvector as pgvector
import embedfleet.sinks.qdrant as qdrant
import embedfleet.sinks.redis_stream as redis_stream
from embedfleet.shared.fault_kinds import register_fault_rules
from embedfleet.shared.settings import Settings
from embedfleet.sinks.backend import VectorBackend, VectorDBError, VectorDType
from embedfleet.sinks.sink import Sink
from embedfleet.sinks.store import SinkParts, Store
from embedfleet.sinks.target import SinkKind, SinkTarget, SinkURL, SinkURLError, check_table

STORES: tuple[Store, ...] = (
    redis_stream.STORE,
    lancedb.STORE,
    pgvector.STORE,
    qdrant.STORE,
    qdrant.LOCAL_STORE,
    parquet.STORE,
)

# Each store's fault rules join the classification every side shares (shared/fault_kinds.py):
# a store's errors are known for what they are wherever a store can raise them (any import of
# embedfleet.sinks runs this), and the light client, which imports no store, carries none.
for _store in STORES:
    if _store.faults is not None:
        register_fault_rules(_store.faults)


def kinds() -> tuple[SinkKind, ...]:
    """Every registered kind, in registry order."""
    return tuple(store.kind for store in STORES)


def database_kinds() -> tuple[SinkKind, ...]:
    """The kinds that are vector databases (rows by id: search, prune, migrate)."""
    return tuple(store.kind for store in STORES if store.database)


def url_forms() -> str:
    """How the registered stores' URLs look, for the messages that list them."""
    return ", ".join(store.forms for store in STORES)


# the forms of the stores registered at import, for messages and docs
SINK_URL_FORMS = url_forms()


def store_of(kind: SinkKind) -> Store:
    """The store registered for ``kind``; SinkURLError naming it and the registered ones."""
    for store in STORES:
        if store.kind == kind:
            return store
    raise SinkURLError(
        f"no sink of kind {kind!r} is registered (embedfleet/sinks/registry.py); "
        f"registered: {', '.join(kinds())}"
    )


def parse_sink_url(url: str, table: str = "embeddings", s3_endpoint_url: str = "") -> SinkTarget:
    """Read ``EMBEDFLEET_SINK``; unknown forms raise SinkURLError naming the accepted ones.

    ``s3_endpoint_url`` (EMBEDFLEET_S3_ENDPOINT_URL) goes with an ``s3://`` target."""
    check_table(table)
    raw = url.strip()
    scheme, separator, rest = raw.partition("://")
    scheme = scheme.lower()
    if not separator:
        for store in STORES:
            if store.word and raw.lower() == store.word:
                return store.target("", table)
        raise SinkURLError(f"EMBEDFLEET_SINK={url!r} is not a URL; use one of: {url_forms()}")
    for store in STORES:
        if scheme in store.schemes:
            return store.read(SinkURL(url, scheme, rest, table, s3_endpoint_url))
    raise SinkURLError(
        f"EMBEDFLEET_SINK={url!r}: unknown sink scheme {scheme + '://'!r}; "
        f"use one of: {url_forms()}"
    )


def local_sink_url(kind: str, directory: Path, postgres_uri: str | None = None) -> str:
    """``EMBEDFLEET_SINK`` for a sink on this machine (tests, benchmarks, the demo).

    The embedded databases (LanceDB, Qdrant local mode) live in ``directory``; PostgreSQL is a
    server, so a ``pgvector*`` kind takes its URI.
    """
    for store in STORES:
        if store.kind != kind:
            continue
        if store.word:
            return store.word
        if store.local:
            return f"{store.schemes[0]}://{directory / store.local}"
    if kind.startswith("pgvector") and postgres_uri is not None:
        return postgres_uri
    raise SinkURLError(f"no local {kind} sink (a pgvector sink needs the server's URI)")


def require_extra(kind: SinkKind) -> None:
    """Fail with the install command, rather than an ImportError deep inside a backend."""
    store_of(kind).require()


def open_backend(target: SinkTarget, *, store_text: bool = True) -> VectorBackend:
    """The backend for ``target``; connects lazily, on the first call that needs it."""
    store = store_of(target.kind)
    if store.backend is None:
        readable = ", ".join(other.forms for other in STORES if other.backend is not None)
        raise VectorDBError(
            f"EMBEDFLEET_SINK is `{target.kind}` ({target.describe()}), which is not a vector "
            f"database: set EMBEDFLEET_SINK to the URL the workers write to, one of: {readable}"
        )
    store.require()
    return store.backend(target, store_text=store_text)


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
    return sink_for_target(target, settings, client, dtype=settings.output_dtype)


def sink_for_target(
    target: SinkTarget,
    settings: Settings,
    client: aioredis.Redis,
    *,
    dtype: VectorDType | None = None,
) -> Sink:
    """The worker's sink for ``target``: its store's, on its backend (when it has one)."""
    store = store_of(target.kind)
    backend = None
    if store.backend is not None:
        backend = open_backend(target, store_text=settings.store_text)
        backend.statement_timeout_s = settings.sink_statement_timeout_s
    return store.sink(SinkParts(target, backend, settings, client, dtype))
