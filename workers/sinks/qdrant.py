"""Qdrant: points upserted by a deterministic id, fp16 vectors, metadata in the payload.

Production points at a Qdrant server (``qdrant://host:6333``, ``https://…`` for Qdrant Cloud
with the API key as the URL's password). ``qdrant+local:///path`` runs the client's local mode
in-process, for tests and single-process use: it takes a file lock on the directory, so only one
process at a time can open it, and it searches by brute force.

Qdrant point ids must be UUIDs or integers, so a point's id is ``uuid5(NAMESPACE_URL, chunk id)``
and the chunk id itself is kept in the payload. A new collection starts with HNSW indexing off
(``indexing_threshold=0``, Qdrant's advice for bulk loads); ``embedfleet index`` turns it on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import redis.asyncio as aioredis
from embedfleet.shared.keys import Keys
from embedfleet.shared.logging import get_logger
from embedfleet.shared.protocol import Result
from embedfleet.shared.vectordb import meta_from_json, meta_to_json, point_id
from embedfleet.workers.sinks.base import DatabaseSink, SinkSetupError

if TYPE_CHECKING:
    from qdrant_client import QdrantClient

log = get_logger("embedfleet.sink")


def open_client(location: str, *, local: bool, api_key: str | None = None) -> QdrantClient:
    from qdrant_client import QdrantClient

    if local:
        return QdrantClient(path=location)
    return QdrantClient(url=location, api_key=api_key, timeout=60)


def payload_of(result: Result) -> dict[str, Any]:
    return {
        "id": result.id,
        "job": result.job,
        "model": result.model,
        "truncated": result.truncated,
        # nested, so a meta key called "id" or "job" cannot overwrite ours
        "meta": meta_from_json(meta_to_json(result.meta)),
    }


class QdrantSink(DatabaseSink):
    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        location: str,
        collection: str,
        *,
        local: bool = False,
        api_key: str | None = None,
    ) -> None:
        super().__init__(client, keys)
        self.location = location
        self.collection = collection
        self.local = local
        self.api_key = api_key
        self._qdrant: QdrantClient | None = None

    async def setup(self, model: str, dim: int) -> None:
        try:
            self._qdrant = await self._blocking(self._open_and_create, dim)
        except SinkSetupError:
            raise
        except RuntimeError as error:
            if "already accessed" not in str(error):
                raise
            raise SinkSetupError(
                f"Qdrant local mode directory {self.location} is open in another process: local "
                "mode allows one process; for several workers run a Qdrant server "
                "(EMBEDFLEET_SINK=qdrant://host:6333)"
            ) from error
        except Exception as error:  # connection refused, TLS, bad API key, ...
            raise SinkSetupError(
                f"cannot set up Qdrant collection {self.collection!r} at {self.location}: "
                f"{type(error).__name__}: {error}"
            ) from error

    def _open_and_create(self, dim: int) -> QdrantClient:
        from qdrant_client import models
        from qdrant_client.http.exceptions import UnexpectedResponse

        qdrant = open_client(self.location, local=self.local, api_key=self.api_key)
        if not qdrant.collection_exists(self.collection):
            params = models.VectorParams(
                size=dim, distance=models.Distance.COSINE, datatype=models.Datatype.FLOAT16
            )
            bulk_load = models.OptimizersConfigDiff(indexing_threshold=0)
            try:
                qdrant.create_collection(
                    self.collection, vectors_config=params, optimizers_config=bulk_load
                )
            except UnexpectedResponse as error:
                if qdrant.collection_exists(self.collection):  # another worker was first
                    pass
                elif error.status_code == 400 and "datatype" in str(error).lower():
                    # servers before 1.9 know no float16 vectors: store float32
                    log.warning("Qdrant server has no float16 vectors; storing float32")
                    params.datatype = None
                    qdrant.create_collection(
                        self.collection, vectors_config=params, optimizers_config=bulk_load
                    )
                else:
                    raise
            log.info("created Qdrant collection", collection=self.collection, dim=dim)
        vectors = qdrant.get_collection(self.collection).config.params.vectors
        size = getattr(vectors, "size", None)
        if size != dim:
            qdrant.close()
            raise SinkSetupError(
                f"Qdrant collection {self.collection!r} has "
                f"{'named vectors' if size is None else f'{size}-dim vectors'}, the model makes "
                f"{dim}-dim vectors: set EMBEDFLEET_SINK_TABLE to a new collection name, or "
                "delete the old collection"
            )
        return qdrant

    async def _upsert(self, results: list[Result]) -> None:
        if self._qdrant is None:
            raise RuntimeError("QdrantSink.setup(model, dim) must run before write()")
        await self._blocking(self._upsert_points, self._qdrant, results)

    def _upsert_points(self, qdrant: QdrantClient, results: list[Result]) -> None:
        from qdrant_client import models

        vectors = np.stack([np.asarray(r.vector, dtype=np.float32) for r in results]).tolist()
        points = [
            models.PointStruct(id=point_id(r.id), vector=vector, payload=payload_of(r))
            for r, vector in zip(results, vectors, strict=True)
        ]
        # wait=True: the call returns once the points are applied (written to Qdrant's WAL),
        # which is the durability the acknowledgement that follows relies on
        qdrant.upsert(self.collection, points=points, wait=True)

    async def close(self) -> None:
        if self._qdrant is not None:
            await self._blocking(self._qdrant.close)
            self._qdrant = None
        await super().close()
