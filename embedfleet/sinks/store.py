"""What a store declares about itself, in its own module: one ``Store`` per kind of sink.

A store module (``lancedb.py``, ``pgvector.py``, ``qdrant.py``, ``parquet/``,
``redis_stream.py``) ends with its declaration: the URL schemes that name it and how it reads the
rest of the URL, how it describes a target, its pip extra and the modules that extra brings, its
reader-side backend class (search, export, prune, migration), the worker's sink it builds and its
fault rules (which errors are its and what they mean, ``shared/fault_kinds.FaultRules``). The
registry (``registry.py``) lists the declarations, one line each, and every list of kinds,
schemes or extras is derived from it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from embedfleet.shared.fault_kinds import FaultRules
from embedfleet.sinks.backend import MissingExtraError, VectorBackend, VectorDType
from embedfleet.sinks.sink import DatabaseSink, Sink
from embedfleet.sinks.target import SinkKind, SinkTarget, SinkURL

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from embedfleet.shared.settings import Settings


@dataclass(frozen=True)
class SinkParts:
    """What a store builds the worker's sink for a target from."""

    target: SinkTarget
    backend: VectorBackend | None  # the store's, open on the target; None: it has none
    settings: Settings
    client: aioredis.Redis
    dtype: VectorDType | None  # the vectors' precision in the store (None: the store's own)


# the worker's sink for a target
SinkFactory = Callable[[SinkParts], Sink]


def database_sink(parts: SinkParts) -> Sink:
    """The sink of a database store: upserts through its backend, then acknowledges."""
    assert parts.backend is not None  # a database store has a backend
    return DatabaseSink(parts.client, parts.settings.keys, parts.backend, dtype=parts.dtype)


@dataclass(frozen=True)
class Store:
    """One kind of sink, as its module declares it."""

    kind: SinkKind
    # the URL schemes that name it (lower case, without "://")
    schemes: tuple[str, ...]
    # how a URL for it looks, for the messages that list them (SINK_URL_FORMS)
    forms: str
    # a target described for people: a template of {table} and {location} (no secrets)
    describe: str
    # the reader side (search, export, prune, migration): None for the results stream
    backend: type[VectorBackend] | None = None
    # the pip extra that installs its client, and the modules it brings
    extra: str = ""
    needs: tuple[str, ...] = ()
    # the folder of OUT_DIR a local sink of it lives in (local_sink_url; "": none)
    local: str = ""
    # the rest of the URL read into a target (None: a directory, ``scheme:///dir``)
    parse: Callable[[SinkURL], SinkTarget] | None = None
    # the worker's sink (its write path)
    sink: SinkFactory = database_sink
    # the plain word that names it too (EMBEDFLEET_SINK=redis; "": none)
    word: str = ""
    # which errors are its client library's and what they mean (None: the common rules only)
    faults: FaultRules | None = None

    @property
    def database(self) -> bool:
        """A vector database: rows kept by id, which `embedfleet prune` and `migrate` work on.

        Its sink is the one that upserts them by id through its backend (the results stream and
        the Parquet dataset, which only append, have sinks of their own)."""
        return self.sink is database_sink

    def target(
        self, location: str, table: str, *, api_key: str | None = None, endpoint_url: str = ""
    ) -> SinkTarget:
        """A target of this store."""
        return SinkTarget(
            self.kind, location, table, api_key, endpoint_url, described=self.describe
        )

    def read(self, url: SinkURL) -> SinkTarget:
        """The target ``url`` names (its scheme is one of ``schemes``)."""
        if self.parse is not None:
            return self.parse(url)
        return self.target(url.path(), url.table)

    def require(self) -> None:
        """Fail with the install command, rather than an ImportError deep inside a backend."""
        missing = [name for name in self.needs if importlib.util.find_spec(name) is None]
        if missing:
            raise MissingExtraError(
                f"the {self.kind} sink needs {', '.join(missing)}: "
                f"pip install 'embedfleet[{self.extra}]'"
            )
