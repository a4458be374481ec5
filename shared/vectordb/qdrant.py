"""Qdrant: points upserted by a deterministic id, fp16 vectors, the row in the payload.

Production points at a Qdrant server (``qdrant://host:6333``, ``https://…`` for Qdrant Cloud
with the API key as the URL's password). ``qdrant+local:///path`` runs the client's local mode
in-process, for tests and single-process use: it takes a file lock on the directory, so only one
process at a time can open it, and it searches by brute force.

Qdrant point ids must be UUIDs or integers, so a point's id is ``uuid5(NAMESPACE_URL, chunk id)``
and the chunk id itself is kept in the payload. A new collection starts with HNSW indexing off
(``indexing_threshold=0``, Qdrant's advice for bulk loads); ``embedfleet index`` turns it on.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from embedfleet.shared.logging import get_logger
from embedfleet.shared.vectordb.backend import (
    SinkSetupError,
    VectorBackend,
    VectorDBError,
    meta_from_json,
    meta_to_json,
    rescore_codes,
)

if TYPE_CHECKING:
    from qdrant_client import QdrantClient

    from embedfleet.shared.protocol import Result
    from embedfleet.shared.vectordb.backend import Hit, StoredVector, VectorDType

log = get_logger("embedfleet.sink")
# Qdrant's default: segments larger than this many KB of vectors get an HNSW graph.
INDEXING_THRESHOLD_KB = 20_000
SCROLL_PAGE = 1000


def point_id(chunk_id: str) -> str:
    """Qdrant point ids must be integers or UUIDs: the chunk id, mapped deterministically."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, chunk_id))


class QdrantBackend(VectorBackend):
    # uint8: Qdrant's UINT8 vectors hold quantize_embeddings' uint8 codes
    DTYPES = ("float16", "float32", "uint8")

    def __init__(self, target: Any, *, store_text: bool = True) -> None:
        super().__init__(target, store_text=store_text)
        self.local = target.kind == "qdrant-local"
        self.dim: int | None = None  # the collection's, once set up
        self.dtype: str | None = None
        self._client: QdrantClient | None = None

    def _connect(self) -> QdrantClient:
        from qdrant_client import QdrantClient

        if self._client is None:
            if self.local:
                self._client = QdrantClient(path=self.target.location)
            else:
                self._client = QdrantClient(
                    url=self.target.location, api_key=self.target.api_key, timeout=60
                )
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        self._client = None

    # --- writing ---------------------------------------------------------------------------
    def setup(self, model: str, dim: int, dtype: VectorDType | None = None) -> None:
        try:
            self._create(dim, dtype)
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

    def _create(self, dim: int, dtype: VectorDType | None) -> None:
        from qdrant_client import models
        from qdrant_client.http.exceptions import UnexpectedResponse

        qdrant = self._connect()
        name = self.target.table
        if not qdrant.collection_exists(name):
            stored = {"float32": None, "uint8": models.Datatype.UINT8}.get(
                dtype or "", models.Datatype.FLOAT16
            )
            params = models.VectorParams(size=dim, distance=models.Distance.COSINE, datatype=stored)
            bulk_load = models.OptimizersConfigDiff(indexing_threshold=0)
            try:
                qdrant.create_collection(name, vectors_config=params, optimizers_config=bulk_load)
            except UnexpectedResponse as error:
                if qdrant.collection_exists(name):  # another worker was first
                    pass
                elif error.status_code == 400 and "datatype" in str(error).lower() and not dtype:
                    # servers before 1.9 know no float16 vectors: store float32
                    log.warning("Qdrant server has no float16 vectors; storing float32")
                    params.datatype = None
                    qdrant.create_collection(
                        name, vectors_config=params, optimizers_config=bulk_load
                    )
                else:
                    raise
            log.info("created Qdrant collection", collection=name, dim=dim)
        vectors = qdrant.get_collection(name).config.params.vectors
        size = getattr(vectors, "size", None)
        if size != dim:
            raise self.dim_mismatch("named vectors" if size is None else f"{size}-dim vectors", dim)
        stored_dtype = _dtype_of(vectors)
        if dtype is not None and stored_dtype != dtype:
            raise self.dtype_mismatch(stored_dtype, dtype)
        self.dim = dim
        self.dtype = stored_dtype

    def vector_format(self) -> tuple[str, int]:
        qdrant = self._connect()
        if not qdrant.collection_exists(self.target.table):
            raise self.not_written_yet()
        vectors = qdrant.get_collection(self.target.table).config.params.vectors
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
            models.PointStruct(id=point_id(r.id), vector=vector, payload=self._payload(r))
            for r, vector in zip(results, vectors, strict=True)
        ]
        # wait=True: the call returns once the points are applied (written to Qdrant's WAL),
        # which is the durability the acknowledgement that follows relies on
        self._client.upsert(self.target.table, points=points, wait=True)

    def _payload(self, result: Result) -> dict[str, Any]:
        payload = {
            "id": result.id,
            "job": result.job,
            "model": result.model,
            "truncated": result.truncated,
            # nested, so a meta key called "id" or "job" cannot overwrite ours
            "meta": meta_from_json(meta_to_json(result.meta)),
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
        if not self._client.collection_exists(self.target.table):
            self.close()
            raise self.not_written_yet()
        return self._client

    def nearest(self, vector: np.ndarray, k: int = 10) -> list[Hit]:
        if self.vector_format()[0] == "uint8":
            return self._nearest_codes(np.asarray(vector, dtype=np.float32).reshape(-1), k)
        query = np.asarray(vector, dtype=np.float32).reshape(-1).tolist()
        points = (
            self._opened()
            .query_points(self.target.table, query=query, limit=k, with_payload=True)
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

    def job_ids(self, job: str) -> set[str]:
        from qdrant_client import models

        qdrant = self._opened()
        selector = models.Filter(
            must=[models.FieldCondition(key="job", match=models.MatchValue(value=job))]
        )
        found: set[str] = set()
        offset = None
        while True:
            points, offset = qdrant.scroll(
                self.target.table,
                scroll_filter=selector,
                limit=SCROLL_PAGE,
                offset=offset,
                with_payload=["id"],
                with_vectors=False,
            )
            found.update(str((p.payload or {})["id"]) for p in points)
            if offset is None:
                return found

    def delete_ids(self, ids: Sequence[str]) -> None:
        from qdrant_client import models

        points = models.PointIdsList(points=[point_id(chunk_id) for chunk_id in ids])
        # wait=True: applied when it returns, as upserts are
        self._opened().delete(self.target.table, points_selector=points, wait=True)

    def export_rows(self, job: str | None = None) -> list[StoredVector]:
        from qdrant_client import models

        qdrant = self._opened()
        selector = (
            None
            if job is None
            else models.Filter(
                must=[models.FieldCondition(key="job", match=models.MatchValue(value=job))]
            )
        )
        found: list[StoredVector] = []
        codes = self.vector_format()[0] == "uint8"
        offset = None
        while True:
            points, offset = qdrant.scroll(
                self.target.table,
                scroll_filter=selector,
                limit=SCROLL_PAGE,
                offset=offset,
                with_payload=True,
                with_vectors=True,
            )
            for p in points:
                payload = p.payload or {}
                vector = np.asarray(p.vector)
                if codes:
                    vector = vector.astype(np.uint8)  # the stored codes, not floats
                found.append(self.stored(payload, payload.get("meta"), vector))
            if offset is None:
                return sorted(found, key=lambda row: row.id)


def _dtype_of(vectors: Any) -> str:
    """The collection's vector dtype: float16, uint8 or (no datatype) float32."""
    from qdrant_client import models

    datatype = getattr(vectors, "datatype", None)
    if datatype == models.Datatype.FLOAT16:
        return "float16"
    if datatype == models.Datatype.UINT8:
        return "uint8"
    return "float32"
