"""Qdrant: points upserted by a deterministic id, fp16 vectors, the row in the payload.

Production points at a Qdrant server (``qdrant://host:6333``, ``https://…`` for Qdrant Cloud
with the API key as the URL's password). ``qdrant+local:///path`` runs the client's local mode
in-process, for tests and single-process use: it takes a file lock on the directory, so only one
process at a time can open it, and it searches by brute force.

Qdrant point ids must be UUIDs or integers, so a point's id is ``uuid5(NAMESPACE_URL, chunk id)``
and the chunk id itself is kept in the payload. A new collection starts with HNSW indexing off
(``indexing_threshold=0``, Qdrant's advice for bulk loads); ``embedfleet index`` turns it on.

A collection for a model with several representations (BGE-M3, ``Extras``) has named vectors:
``dense`` (the vector as above), ``multivector`` (the per-token vectors, a Qdrant multivector
compared by MAX_SIM, fp16, no HNSW graph: it reranks, it does not index) and the sparse vector
``sparse`` (Qdrant's sparse vectors, searched by dot product). A plain collection keeps its one
unnamed vector.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from embedfleet.shared.fault_kinds import FaultKind, FaultRules, System
from embedfleet.shared.logging import get_logger
from embedfleet.sinks.backend import (
    NO_EXTRAS,
    Extras,
    SinkSetupError,
    StoredRow,
    VectorBackend,
    VectorDBError,
    jsonable_meta,
    rescore_codes,
    row_fields,
)
from embedfleet.sinks.store import Store
from embedfleet.sinks.target import SinkTarget, SinkURL, SinkURLError

if TYPE_CHECKING:
    from qdrant_client import QdrantClient

    from embedfleet.shared.protocol import Result, SparseVector
    from embedfleet.sinks.backend import Hit, StoredVector, VectorDType

log = get_logger("embedfleet.sink")
# Qdrant's default: segments larger than this many KB of vectors get an HNSW graph.
INDEXING_THRESHOLD_KB = 20_000
SCROLL_PAGE = 1000
# the named vectors of a collection with Extras
DENSE, SPARSE, MULTIVECTOR = "dense", "sparse", "multivector"


class _SharedLocal:
    """One local-mode client of a directory for the whole process, its calls one at a time.

    Local mode locks its directory to one client, so the backends of one process (a worker's
    sinks of two model lanes, a migration's source and target, a search) share one; the lock
    makes the calls of their threads take turns, as a server would serialise them."""

    def __init__(self, client: QdrantClient) -> None:
        self.client = client
        self.users = 0
        self.lock = threading.RLock()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.client, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            with self.lock:
                return attribute(*args, **kwargs)

        return call


_LOCAL: dict[str, _SharedLocal] = {}
_LOCAL_LOCK = threading.Lock()


def _local_client(path: str, make: Callable[[], QdrantClient]) -> QdrantClient:
    with _LOCAL_LOCK:
        shared = _LOCAL.get(path)
        if shared is None:
            shared = _LOCAL[path] = _SharedLocal(make())
        shared.users += 1
        return cast("QdrantClient", shared)


def _release_local(path: str) -> None:
    with _LOCAL_LOCK:
        shared = _LOCAL.get(path)
        if shared is None:
            return
        shared.users -= 1
        if shared.users <= 0:
            del _LOCAL[path]
            shared.client.close()


def point_id(chunk_id: str) -> str:
    """Qdrant point ids must be integers or UUIDs: the chunk id, mapped deterministically."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, chunk_id))


class QdrantBackend(VectorBackend):
    # uint8: Qdrant's UINT8 vectors hold quantize_embeddings' uint8 codes
    DTYPES = ("float16", "float32", "uint8")
    system = System.QDRANT

    def __init__(self, target: Any, *, store_text: bool = True) -> None:
        super().__init__(target, store_text=store_text)
        self.local = target.kind == "qdrant-local"
        self.dim: int | None = None  # the collection's, once set up
        self.dtype: str | None = None
        self.named = False  # the collection has named vectors (dense, sparse, multivector)
        self._client: QdrantClient | None = None

    def _connect(self) -> QdrantClient:
        from qdrant_client import QdrantClient

        if self._client is None:
            if self.local:
                location = self.target.location
                self._client = _local_client(
                    str(Path(location).resolve()), lambda: QdrantClient(path=location)
                )
            else:
                self._client = QdrantClient(
                    url=self.target.location, api_key=self.target.api_key, timeout=60
                )
        return self._client

    def close(self) -> None:
        if self._client is not None:
            if self.local:
                _release_local(str(Path(self.target.location).resolve()))
            else:
                self._client.close()
        self._client = None

    # --- writing ---------------------------------------------------------------------------
    def setup(
        self, model: str, dim: int, dtype: VectorDType | None = None, extras: Extras = NO_EXTRAS
    ) -> None:
        try:
            self._create(dim, dtype, extras)
        except SinkSetupError:
            self.close()
            raise
        except RuntimeError as error:
            self.close()
            if "already accessed" not in str(error):
                raise
            raise SinkSetupError(
                f"Qdrant local mode directory {self.target.location} is open in another "
                "process: local mode allows one process; for several workers run a Qdrant "
                "server (EMBEDFLEET_SINK=qdrant://host:6333)"
            ) from error
        except Exception as error:  # connection refused, TLS, bad API key, ...
            self.close()
            raise SinkSetupError(
                f"cannot set up {self.target.describe()}: {type(error).__name__}: {error}"
            ) from error

    def _create(self, dim: int, dtype: VectorDType | None, extras: Extras) -> None:
        qdrant = self._connect()
        name = self.target.table
        if not qdrant.collection_exists(name):
            _create_collection(qdrant, name, dim, dtype, extras)
        config = qdrant.get_collection(name).config.params
        self.named = isinstance(config.vectors, dict)
        self._check_extras(config, extras)
        vectors = _dense_params(config.vectors)
        size = getattr(vectors, "size", None)
        if size != dim:
            raise self.dim_mismatch("named vectors" if size is None else f"{size}-dim vectors", dim)
        stored_dtype = _dtype_of(vectors)
        if dtype is not None and stored_dtype != dtype:
            raise self.dtype_mismatch(stored_dtype, dtype)
        self.dim = dim
        self.dtype = stored_dtype

    def _check_extras(self, config: Any, extras: Extras) -> None:
        """An existing collection must hold what the model's rows bring (SinkSetupError)."""
        named = config.vectors if isinstance(config.vectors, dict) else {}
        sparse = config.sparse_vectors or {}
        missing = []
        if extras.sparse_dim and SPARSE not in sparse:
            missing.append("a sparse vector 'sparse'")
        multi = named.get(MULTIVECTOR)
        if extras.multivector_dim and getattr(multi, "size", None) != extras.multivector_dim:
            missing.append(f"a {extras.multivector_dim}-dim multivector 'multivector'")
        if extras and DENSE not in named:
            missing.append("a named vector 'dense'")
        if missing:
            raise SinkSetupError(
                f"{self.target.describe()} has no {' or '.join(missing)}, which this model's "
                "rows bring: set EMBEDFLEET_SINK_TABLE to a new collection name"
            )

    def vector_format(self) -> tuple[str, int]:
        qdrant = self._opened()
        config = qdrant.get_collection(self.target.table).config.params
        self.named = isinstance(config.vectors, dict)
        vectors = _dense_params(config.vectors)
        return _dtype_of(vectors), int(getattr(vectors, "size", 0) or 0)

    def upsert(self, results: Sequence[Result]) -> None:
        from qdrant_client import models

        if self._client is None:
            raise RuntimeError("QdrantBackend.setup(model, dim) must run before upsert()")
        if self.dtype == "uint8":  # quantize_embeddings' codes, as stored
            vectors = self.quantized_vectors(results, "uint8", self.dim or 0).tolist()
        else:
            vectors = self.float_vectors(results, np.float32, self.dim).tolist()
        points = [
            models.PointStruct(
                id=point_id(r.id), vector=self._vectors(r, vector), payload=self._payload(r)
            )
            for r, vector in zip(results, vectors, strict=True)
        ]
        # wait=True: the call returns once the points are applied (written to Qdrant's WAL),
        # which is the durability the acknowledgement that follows relies on
        self._client.upsert(self.target.table, points=points, wait=True)

    def _vectors(self, result: Result, dense: list[Any]) -> Any:
        """A point's vector: the dense one, or (named vectors) each the result carries."""
        from qdrant_client import models

        if not self.named:
            return dense
        named: dict[str, Any] = {DENSE: dense}
        if result.sparse is not None and result.sparse.indices.size:
            named[SPARSE] = models.SparseVector(
                indices=result.sparse.indices.tolist(), values=result.sparse.values.tolist()
            )
        if result.multivector is not None and result.multivector.count:
            named[MULTIVECTOR] = result.multivector.floats().tolist()
        return named

    def _payload(self, result: Result) -> dict[str, Any]:
        payload = {
            "id": result.id,
            "job": result.job,
            "model": result.model,
            "truncated": result.truncated,
            # nested, so a meta key called "id" or "job" cannot overwrite ours
            "meta": jsonable_meta(result.meta),
        }
        text = self.stored_text(result)
        if text is not None:
            payload["text"] = text
        return payload

    # --- reading ---------------------------------------------------------------------------
    def _opened(self) -> QdrantClient:
        """The client on an existing collection (a reader must not create one)."""
        if self._client is None:
            if self.local and not Path(self.target.location).is_dir():
                # QdrantClient(path=) would create the directory, empty
                raise VectorDBError(f"no {self.target.describe()}: the directory does not exist")
            try:
                self._connect()
            except RuntimeError as error:  # local mode locks its directory to one process
                raise VectorDBError(
                    f"{self.target.describe()} is open in another process ({error}); local "
                    "mode allows one process at a time: stop the worker, or run a Qdrant server"
                ) from None
        assert self._client is not None
        name = self.target.table
        if not (self._client.collection_exists(name) or name in self._aliases(self._client)):
            self.close()
            raise self.not_written_yet()
        return self._client

    def nearest(self, vector: np.ndarray, k: int = 10) -> list[Hit]:
        if self.vector_format()[0] == "uint8":
            return self._nearest_codes(np.asarray(vector, dtype=np.float32).reshape(-1), k)
        query = np.asarray(vector, dtype=np.float32).reshape(-1).tolist()
        return self._query(query, DENSE if self.named else None, k)

    def nearest_sparse(self, sparse: SparseVector, k: int = 10) -> list[Hit]:
        from qdrant_client import models

        qdrant = self._opened()
        if SPARSE not in (
            qdrant.get_collection(self.target.table).config.params.sparse_vectors or {}
        ):
            raise VectorDBError(f"{self.target.describe()} holds no sparse vectors")
        query = models.SparseVector(
            indices=np.asarray(sparse.indices).tolist(), values=np.asarray(sparse.values).tolist()
        )
        return self._query(query, SPARSE, k)

    def _query(self, query: Any, using: str | None, k: int) -> list[Hit]:
        points = (
            self._opened()
            .query_points(self.target.table, query=query, using=using, limit=k, with_payload=True)
            .points
        )
        return [
            self.hit(p.payload, p.payload.get("meta"), float(p.score))
            for p in points
            if p.payload is not None
        ]

    def _nearest_codes(self, query: np.ndarray, k: int) -> list[Hit]:
        """uint8 codes: Qdrant's own distances would treat them as plain unsigned numbers, not
        quantize_embeddings' buckets, so an exact scan scores every point with the float query
        against its codes (the int8 rescoring step, over the whole collection)."""
        rows = self.export_rows()
        if not rows:
            return []
        scores = rescore_codes(query, np.stack([row.vector for row in rows]))
        best = np.argsort(-scores, kind="stable")[:k]
        return [self.hit(rows[i].as_dict(), rows[i].meta, float(scores[i])) for i in best.tolist()]

    def build_index(self, *, force: bool = False) -> list[str]:
        from qdrant_client import models

        qdrant = self._opened()
        qdrant.update_collection(
            self.target.table,
            optimizers_config=models.OptimizersConfigDiff(indexing_threshold=INDEXING_THRESHOLD_KB),
            hnsw_config=models.HnswConfigDiff(m=16, ef_construct=100),
        )
        if not self.local:  # local mode has no payload indexes (and warns)
            qdrant.create_payload_index(self.target.table, "job", models.PayloadSchemaType.KEYWORD)
        count = qdrant.count(self.target.table).count
        done = [
            f"{self.target.describe()}: {count:,} points; HNSW indexing on (m=16, "
            f"ef_construct=100, threshold {INDEXING_THRESHOLD_KB:,} KB)"
        ]
        if self.local:
            done.append("local mode always searches exactly; a Qdrant server builds the graph")
        else:
            done.append(
                "payload index on job; the server builds the graph in the background "
                "(collection status: yellow until done)"
            )
        return done

    def _scroll_all(
        self, selector: Any, *, with_payload: bool | list[str], with_vectors: bool
    ) -> Iterator[Any]:
        """Every point ``selector`` matches (None: all of them), a page at a time."""
        qdrant = self._opened()
        offset = None
        while True:
            points, offset = qdrant.scroll(
                self.target.table,
                scroll_filter=selector,
                limit=SCROLL_PAGE,
                offset=offset,
                with_payload=with_payload,
                with_vectors=with_vectors,
            )
            yield from points
            if offset is None:
                return

    def job_ids(self, job: str) -> set[str]:
        points = self._scroll_all(_job_filter(job), with_payload=["id"], with_vectors=False)
        return {str((p.payload or {})["id"]) for p in points}

    def delete_ids(self, ids: Sequence[str]) -> None:
        from qdrant_client import models

        points = models.PointIdsList(points=[point_id(chunk_id) for chunk_id in ids])
        # wait=True: applied when it returns, as upserts are
        self._opened().delete(self.target.table, points_selector=points, wait=True)

    def export_rows(self, job: str | None = None) -> list[StoredVector]:
        selector = None if job is None else _job_filter(job)
        found: list[StoredVector] = []
        codes = self.vector_format()[0] == "uint8"
        for p in self._scroll_all(selector, with_payload=True, with_vectors=True):
            payload = p.payload or {}
            vector = np.asarray(p.vector[DENSE] if isinstance(p.vector, dict) else p.vector)
            if codes:
                vector = vector.astype(np.uint8)  # the stored codes, not floats
            found.append(self.stored(payload, payload.get("meta"), vector))
        return sorted(found, key=lambda row: row.id)

    # --- migrations: the reader name is a collection alias -----------------------------------
    def _aliases(self, qdrant: QdrantClient) -> dict[str, str]:
        return {a.alias_name: a.collection_name for a in qdrant.get_aliases().aliases}

    def resolve(self) -> str:
        return self._aliases(self._connect()).get(self.target.table, self.target.table)

    def point_alias(self, alias: str) -> None:
        from qdrant_client import models

        qdrant = self._connect()
        if alias in {c.name for c in qdrant.get_collections().collections}:
            raise VectorDBError(
                f"{alias!r} is a Qdrant collection, not an alias: choose another reader name"
            )
        create = models.CreateAliasOperation(
            create_alias=models.CreateAlias(collection_name=self.target.table, alias_name=alias)
        )
        operations: list[Any] = [create]
        if alias in self._aliases(qdrant):
            # delete and create in one request: Qdrant applies them together, so readers of
            # the alias never find it missing or pointing at both
            delete = models.DeleteAliasOperation(delete_alias=models.DeleteAlias(alias_name=alias))
            operations = [delete, create]
        qdrant.update_collection_aliases(change_aliases_operations=operations)

    def scan_rows(self, after: str | None, limit: int) -> tuple[list[StoredRow], str | None]:
        points, offset = self._opened().scroll(
            self.target.table, limit=limit, offset=after, with_payload=True, with_vectors=False
        )
        rows = [
            StoredRow(**row_fields(p.payload or {}, (p.payload or {}).get("meta"))) for p in points
        ]
        return rows, (None if offset is None else str(offset))

    def count_rows(self) -> int:
        return int(self._opened().count(self.target.table, exact=True).count)

    def drop_table(self) -> None:
        self._connect().delete_collection(self.target.table)


def _create_collection(
    qdrant: QdrantClient, name: str, dim: int, dtype: VectorDType | None, extras: Extras
) -> None:
    """Create the collection for ``dim``-dim vectors (float16 unless ``dtype`` says, float32
    where the server has no float16) and ``extras``, indexing off for the bulk load; another
    worker's made first is taken."""
    from qdrant_client import models
    from qdrant_client.http.exceptions import UnexpectedResponse

    params, vectors_config, sparse_config = _collection_vectors(dim, dtype, extras)
    bulk_load = models.OptimizersConfigDiff(indexing_threshold=0)
    try:
        qdrant.create_collection(
            name,
            vectors_config=vectors_config,
            sparse_vectors_config=sparse_config,
            optimizers_config=bulk_load,
        )
    except UnexpectedResponse as error:
        if qdrant.collection_exists(name):  # another worker was first
            pass
        elif error.status_code == 400 and "datatype" in str(error).lower() and not dtype:
            # servers before 1.9 know no float16 vectors: store float32
            log.warning("Qdrant server has no float16 vectors; storing float32")
            params.datatype = None  # also in vectors_config, which holds params
            qdrant.create_collection(
                name,
                vectors_config=vectors_config,
                sparse_vectors_config=sparse_config,
                optimizers_config=bulk_load,
            )
        else:
            raise
    log.info("created Qdrant collection", collection=name, dim=dim, extras=str(extras))


def _collection_vectors(
    dim: int, dtype: VectorDType | None, extras: Extras
) -> tuple[Any, Any, dict[str, Any] | None]:
    """The dense vectors' params, the vectors config that holds them (named beside the
    multivector where there are extras) and the sparse vectors' config (None: none)."""
    from qdrant_client import models

    stored = {"float32": None, "uint8": models.Datatype.UINT8}.get(
        dtype or "", models.Datatype.FLOAT16
    )
    params = models.VectorParams(size=dim, distance=models.Distance.COSINE, datatype=stored)
    vectors_config: Any = params
    sparse_config: dict[str, Any] | None = None
    if extras:
        vectors_config = {DENSE: params}
        if extras.multivector_dim:
            vectors_config[MULTIVECTOR] = models.VectorParams(
                size=extras.multivector_dim,
                distance=models.Distance.COSINE,
                datatype=models.Datatype.FLOAT16,
                multivector_config=models.MultiVectorConfig(
                    comparator=models.MultiVectorComparator.MAX_SIM
                ),
                hnsw_config=models.HnswConfigDiff(m=0),
            )
        if extras.sparse_dim:
            sparse_config = {SPARSE: models.SparseVectorParams()}
    return params, vectors_config, sparse_config


def _dense_params(vectors: Any) -> Any:
    """The dense vector's params: the unnamed vector's, or the named ``dense``."""
    return vectors.get(DENSE) if isinstance(vectors, dict) else vectors


def _dtype_of(vectors: Any) -> str:
    """The collection's vector dtype: float16, uint8 or (no datatype) float32."""
    from qdrant_client import models

    datatype = getattr(vectors, "datatype", None)
    if datatype == models.Datatype.FLOAT16:
        return "float16"
    if datatype == models.Datatype.UINT8:
        return "uint8"
    return "float32"


def _job_filter(job: str) -> Any:
    """The Qdrant filter of the points one job wrote last (their payload's ``job``)."""
    from qdrant_client import models

    return models.Filter(
        must=[models.FieldCondition(key="job", match=models.MatchValue(value=job))]
    )


def qdrant_fault_kind(error: BaseException) -> FaultKind | None:
    """The kind of an error of Qdrant's client stack (shared/fault_kinds.py): httpx / httpcore
    transport errors (ConnectError, ReadTimeout, RemoteProtocolError, ...) and qdrant_client's
    wrapper of them are transient; the rest (an HTTP status: UnexpectedResponse) is left to the
    common rules."""
    name = type(error).__name__
    if (
        "Timeout" in name
        or "Connect" in name
        or "Network" in name
        or "Protocol" in name
        or name == "ResponseHandlingException"
    ):
        return FaultKind.TRANSIENT
    return None


# the client (qdrant_client) and what it talks through: REST (httpx, httpcore) or gRPC
FAULTS = FaultRules(
    System.QDRANT, ("qdrant_client", "httpx", "httpcore", "grpc"), qdrant_fault_kind
)


def _server_target(url: SinkURL) -> SinkTarget:
    scheme = "https" if url.scheme == "https" else "http"
    credentials, at, host = url.rest.rpartition("@")
    if not host.split("/")[0]:
        raise SinkURLError(
            f"EMBEDFLEET_SINK={url.url!r} names no host, e.g. qdrant://localhost:6333"
        )
    api_key = (credentials.partition(":")[2] or None) if at else None
    hostport = host.split("/")[0]
    if ":" not in hostport.rsplit("]", 1)[-1]:
        hostport += ":6333"  # Qdrant's REST port, not the scheme's 80/443
    return STORE.target(f"{scheme}://{hostport}", url.table, api_key=api_key)


STORE = Store(
    kind="qdrant",
    schemes=("qdrant", "http", "https"),
    forms="qdrant://host:6333 (or http://, https://)",
    describe="Qdrant collection {table!r} at {location}",
    backend=QdrantBackend,
    extra="qdrant",
    needs=("qdrant_client",),
    parse=_server_target,
    faults=FAULTS,
)
# local mode: the same store (backend, extra, fault rules), in-process on a directory
LOCAL_STORE = dataclasses.replace(
    STORE,
    kind="qdrant-local",
    schemes=("qdrant+local",),
    forms="qdrant+local:///path/to/dir",
    describe="Qdrant (local mode) collection {table!r} in {location}",
    local="qdrant",
    parse=None,  # a directory: qdrant+local:///dir
)
