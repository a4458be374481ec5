"""Adding a store is one file and one line: a toy store, written here as its own module and
registered with one line, works through ``parse_sink_url``, ``open_backend`` and the worker's
write path (``build_sink``: upsert, then acknowledge); a store nobody registered fails loudly,
naming the scheme or kind and the registered ones. The lists of kinds, schemes, extras and fault
systems come from the registry, and each store module declares its own."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import embedfleet.sinks.registry as registry
from embedfleet.shared.fault_kinds import System
from embedfleet.shared.protocol import Result
from embedfleet.shared.settings import Settings
from embedfleet.sinks import (
    DatabaseSink,
    Delivery,
    SinkTarget,
    SinkURLError,
    VectorDBError,
    build_sink,
    database_kinds,
    kinds,
    local_sink_url,
    open_backend,
    parse_sink_url,
    store_of,
)

# the whole of a new store: its backend (both sides: the worker's upsert, the verbs' reads) and
# its declaration
TOY_STORE = """
from __future__ import annotations

import numpy as np

from embedfleet.shared.fault_kinds import System
from embedfleet.sinks.backend import Hit, StoredVector, VectorBackend, row_fields
from embedfleet.sinks.store import Store

ROWS: dict[str, dict[str, dict]] = {}  # location -> id -> row, the toy's "disk"


class ToyBackend(VectorBackend):
    system = System.UNKNOWN

    def setup(self, model, dim, dtype=None, extras=None):
        ROWS.setdefault(self.target.location, {})

    def upsert(self, results):
        table = ROWS.setdefault(self.target.location, {})
        for result in results:
            table[result.id] = {"id": result.id, "job": result.job, "model": result.model,
                                "vector": np.asarray(result.vector, np.float32)}

    def nearest(self, vector, k=10):
        rows = ROWS.get(self.target.location, {}).values()
        scored = sorted(rows, key=lambda row: -float(row["vector"] @ vector))[:k]
        return [self.hit(row, None, float(row["vector"] @ vector)) for row in scored]

    def build_index(self, *, force=False):
        return []

    def export_rows(self, job=None):
        rows = sorted(ROWS.get(self.target.location, {}).values(), key=lambda row: row["id"])
        return [self.stored(row, None, row["vector"]) for row in rows
                if job is None or row["job"] == job]


STORE = Store(
    kind="toy",
    schemes=("toy",),
    forms="toy:///path/to/dir",
    describe="the toy store {location}",
    backend=ToyBackend,
    local="toy",
)
"""


@pytest.fixture
def toy_module(tmp_path: Path) -> Iterator[ModuleType]:
    """The toy store's one file, imported as a module of its own."""
    path = tmp_path / "toy_store.py"
    path.write_text(textwrap.dedent(TOY_STORE))
    spec = importlib.util.spec_from_file_location("toy_store", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["toy_store"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("toy_store", None)


@pytest.fixture
def toy(toy_module: ModuleType, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The one line: the toy store in the registry's list."""
    monkeypatch.setattr(registry, "STORES", (*registry.STORES, toy_module.STORE))
    return toy_module


async def test_a_registered_store_works_end_to_end(toy: ModuleType, settings: Settings, client):
    target = parse_sink_url("toy:///data/toys", "toys")
    assert (target.kind, target.location, target.table) == ("toy", "/data/toys", "toys")
    assert target.describe() == "the toy store /data/toys"
    assert "toy" in kinds() and "toy" in database_kinds()
    assert "toy:///path/to/dir" in registry.url_forms()
    assert local_sink_url("toy", Path("/tmp/out")) == "toy:///tmp/out/toy"

    # the worker's write path: the sink factory, upsert, then acknowledge
    settings = settings.model_copy(update={"sink": "toy:///data/toys", "sink_table": "toys"})
    sink = build_sink(settings, client)
    assert isinstance(sink, DatabaseSink) and isinstance(sink.backend, toy.ToyBackend)
    assert sink.system is System.UNKNOWN
    await sink.setup("tiny-model", 4)
    from embedfleet.shared.redis_conn import ensure_group

    vectors = np.eye(4, dtype=np.float16)
    results = [Result(id=f"c{i}", model="tiny-model", vector=vectors[i], job="j") for i in (0, 1)]
    entry_ids = [await client.xadd(settings.keys.ingest, {"m": b"x"}) for _ in results]
    await ensure_group(client, settings.keys, settings.keys.ingest)
    await client.xreadgroup(settings.group, "toy-test", {settings.keys.ingest: ">"})
    deliveries = [Delivery(settings.keys.ingest, e.decode(), "j") for e in entry_ids]
    await sink.write(results, deliveries)
    await sink.close()
    assert await client.hget(settings.keys.job("j"), "done") == b"2"
    assert await client.xlen(settings.keys.ingest) == 0

    # the verbs' side: the same store read back through open_backend
    with open_backend(target) as backend:
        assert [row.id for row in backend.export_rows()] == ["c0", "c1"]
        assert backend.nearest(np.eye(4, dtype=np.float32)[1], k=1)[0].id == "c1"


def test_a_store_missing_from_the_registry_fails_loudly(toy_module: ModuleType) -> None:
    """The toy's file exists but its line does not: nothing finds it, and each error says what
    was asked and what is registered."""
    with pytest.raises(SinkURLError, match="unknown sink scheme 'toy://'") as raised:
        parse_sink_url("toy:///data/toys")
    for form in ("lancedb:///", "postgresql://", "qdrant://", "parquet:///"):
        assert form in str(raised.value)
    with pytest.raises(SinkURLError, match="no sink of kind 'toy' is registered") as raised:
        store_of("toy")
    assert all(kind in str(raised.value) for kind in ("redis", "lancedb", "parquet"))
    with pytest.raises(SinkURLError, match="'toy'"):
        open_backend(SinkTarget("toy", "/data/toys", "toys"))


# the system each database kind's errors and backend belong to (both declared by its module)
DATABASE_SYSTEMS = {
    "lancedb": System.LANCEDB,
    "pgvector": System.POSTGRESQL,
    "qdrant": System.QDRANT,
    "qdrant-local": System.QDRANT,
}


def test_each_list_of_kinds_comes_from_the_registry() -> None:
    assert kinds() == ("redis", "lancedb", "pgvector", "qdrant", "qdrant-local", "parquet")
    assert database_kinds() == ("lancedb", "pgvector", "qdrant", "qdrant-local")
    assert {store_of(kind).extra for kind in kinds()} == {
        "",
        "lancedb",
        "pgvector",
        "qdrant",
        "parquet",
    }
    backends = {kind: store_of(kind).backend for kind in database_kinds()}
    systems = {kind: backend.system for kind, backend in backends.items() if backend}
    assert systems == DATABASE_SYSTEMS
    with pytest.raises(VectorDBError, match="not a vector database"):
        open_backend(parse_sink_url("redis"))


def test_each_store_declares_its_fault_rules_and_the_registry_registers_them() -> None:
    """A store's errors are known as its by the modules of its client libraries, declared in its
    module (``faults``) and registered by the registry; no module is claimed by two systems."""
    from embedfleet.shared.fault_kinds import FaultRules, register_fault_rules, system_of

    declared = {kind: store_of(kind).faults for kind in kinds()}
    assert {kind: rules.system for kind, rules in declared.items() if rules} == DATABASE_SYSTEMS
    for rules in filter(None, declared.values()):
        for module in rules.modules:
            raised_there = type("StoreError", (Exception,), {"__module__": f"{module}.errors"})
            assert system_of(raised_there()) is rules.system
    with pytest.raises(ValueError, match="'psycopg' are postgresql's already"):
        register_fault_rules(FaultRules(System.QDRANT, ("psycopg",)))


def test_the_sinks_import_only_shared() -> None:
    """The design card's rule for the sinks' home: it may import ``embedfleet.shared`` (and
    itself), never the workers, the producer or the gateway."""
    import ast

    import embedfleet.sinks

    home = Path(embedfleet.sinks.__file__).parent
    found = set()
    for path in home.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
    ours = {name for name in found if name.startswith("embedfleet")}
    assert ours and all(name.startswith(("embedfleet.shared", "embedfleet.sinks")) for name in ours)
