"""Texts in, vectors out, through the fleet: the lane a request rides, backpressure, liveness.

Small requests go to the priority query lane (``Producer.embed_queries``); large ones are sent
to the ingest stream with a ``reply`` so the workers push their vectors back to a list this
gateway drains into one preallocated array (memory bounded by EMBEDFLEET_GATEWAY_MAX_INPUTS).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

import numpy as np
import redis.asyncio as aioredis

from embedfleet.gateway.errors import APIError, overloaded
from embedfleet.gateway.metrics import GatewayMetrics
from embedfleet.producer.client import EmbeddingOptions, Producer, QueryTimeoutError
from embedfleet.shared.protocol import (
    Chunk,
    ProtocolError,
    QueryFailedError,
    decode_result,
)
from embedfleet.shared.settings import Settings
from embedfleet.shared.streams import live_workers

LIVENESS_CACHE_S = 1.0
# Results taken off a reply list per round trip while collecting a large request
COLLECT_PAGE = 512


class FleetState:
    """Is any worker alive? From the workers' heartbeats (``{ns}:workers``), cached a second."""

    def __init__(self, client: aioredis.Redis, settings: Settings) -> None:
        self.client = client
        self.settings = settings
        self._checked_at = 0.0
        self._alive = 0

    async def live_workers(self) -> int:
        now = time.monotonic()
        if now - self._checked_at < LIVENESS_CACHE_S:
            return self._alive
        self._alive = await live_workers(
            self.client, self.settings.keys, self.settings.gateway_worker_idle_ms
        )
        self._checked_at = now
        return self._alive

    async def require_worker(self) -> None:
        if await self.live_workers() == 0:
            keys = self.settings.keys
            raise APIError(
                503,
                "no embedding worker is running (no heartbeat in the last "
                f"{self.settings.gateway_worker_idle_ms} ms); start one with `embedfleet "
                f"worker`. Check: redis-cli ZRANGE {keys.workers_alive} 0 -1 WITHSCORES",
                type="server_error",
                code="no_worker",
                headers={"Retry-After": str(self.settings.gateway_retry_after_s)},
            )


class Embedder:
    def __init__(
        self, settings: Settings, producer: Producer, fleet: FleetState, metrics: GatewayMetrics
    ) -> None:
        self.settings = settings
        self.producer = producer
        self.client = producer.client
        self.keys = settings.keys
        self.fleet = fleet
        self.metrics = metrics

    async def embed(self, texts: Sequence[str], options: EmbeddingOptions) -> np.ndarray:
        """float32 vectors (len(texts), dim) as the workers return them (fp16 on the wire)."""
        await self.fleet.require_worker()
        if len(texts) <= self.settings.gateway_lane_max_inputs:
            return await self._via_query_lane(texts, options)
        return await self._via_ingest(texts, options)

    async def check_backlog(self) -> None:
        """429 while the ingest backlog is over the high-water mark (Producers wait there)."""
        await self._refuse_when_full(
            "ingest backlog",
            self.keys.ingest,
            self.settings.backlog_high_water,
            "EMBEDFLEET_BACKLOG_HIGH_WATER",
        )

    async def _refuse_when_full(
        self, what: str, stream: str, high_water: int, variable: str
    ) -> None:
        """429 (retry after EMBEDFLEET_GATEWAY_RETRY_AFTER_S) while ``stream`` holds
        ``high_water`` entries or more; the message names the ``variable`` that sets it."""
        waiting = await self.client.xlen(stream)
        if waiting >= high_water:
            raise overloaded(
                f"the {what} ({waiting:,} entries) is over the high-water mark "
                f"({variable}={high_water:,}); retry after the Retry-After seconds",
                self.settings.gateway_retry_after_s,
            )

    async def _via_query_lane(self, texts: Sequence[str], options: EmbeddingOptions) -> np.ndarray:
        await self._refuse_when_full(
            "query lane",
            self.keys.query_lane.query,
            self.settings.gateway_lane_high_water,
            "EMBEDFLEET_GATEWAY_LANE_HIGH_WATER",
        )
        self.metrics.inputs.labels("query").inc(len(texts))
        try:
            return await self.producer.embed_queries(
                list(texts), timeout=self.settings.gateway_timeout_s, options=options
            )
        except QueryTimeoutError as error:
            raise _timeout(str(error)) from None
        except QueryFailedError as error:
            raise _rejected(error) from None

    async def _via_ingest(self, texts: Sequence[str], options: EmbeddingOptions) -> np.ndarray:
        await self.check_backlog()
        self.metrics.inputs.labels("ingest").inc(len(texts))
        request = uuid.uuid4().hex
        reply_key = self.keys.reply(request)
        # No job: a one-off request must not show up in `embedfleet status` as a job. Every
        # chunk is answered on the reply list, with its vector or the reason it failed.
        chunks = (
            options.apply(Chunk(id=str(i), text=text, reply=request))
            for i, text in enumerate(texts)
        )
        await self.producer.enqueue(chunks)
        vectors: np.ndarray | None = None
        seen = np.zeros(len(texts), dtype=bool)
        deadline = time.monotonic() + self.settings.gateway_timeout_s
        try:
            while not seen.all():
                page = await self.client.lpop(reply_key, COLLECT_PAGE)
                if not page:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise _timeout(
                            f"{int((~seen).sum())} of {len(texts)} inputs not embedded within "
                            f"EMBEDFLEET_GATEWAY_TIMEOUT_S={self.settings.gateway_timeout_s}"
                        )
                    popped = await self.client.blpop([reply_key], timeout=min(remaining, 5.0))
                    page = [] if popped is None else [popped[1]]
                for payload in page:
                    try:
                        result = decode_result(payload)
                    except QueryFailedError as error:
                        raise _rejected(error) from None
                    except ProtocolError as error:
                        raise APIError(
                            500, f"bad reply from a worker: {error}", type="server_error"
                        ) from None
                    index = int(result.id)
                    if vectors is None:
                        vectors = np.empty((len(texts), result.dim), dtype=np.float32)
                    vectors[index] = result.vector
                    seen[index] = True
        finally:
            await self.client.delete(reply_key)
        assert vectors is not None
        return vectors


def _timeout(message: str) -> APIError:
    return APIError(504, message, type="server_error", code="timeout")


def _rejected(error: QueryFailedError) -> APIError:
    return APIError(400, f"the worker rejected an input: {error}", code="input_rejected")
