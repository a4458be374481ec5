"""Texts in, vectors out, through the fleet: the request stream a request rides, backpressure,
liveness.

Small requests go to the priority query stream (``Producer.embed_queries``); large ones to the
interactive stream (``Producer.embed_texts``), which workers read before any bulk backlog. Both
are the client's own calls, so the gateway enqueues and collects answers exactly as any client
does (producer/replies.py), on one Redis, with partitions, or on a Redis Cluster.

A request is enqueued whether or not a worker is alive: with the chart's scale-to-zero, what
the gateway enqueues is what KEDA counts to start the first worker, and the request waits for
it within EMBEDFLEET_GATEWAY_TIMEOUT_S. Only the timeout's message says that no worker was alive.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import numpy as np
import redis.asyncio as aioredis

from embedfleet.gateway.errors import APIError, input_rejected, overloaded, retry_later
from embedfleet.gateway.metrics import GatewayMetrics
from embedfleet.gateway.timing_headers import TokenCounter, fleet_call
from embedfleet.producer.client import EmbeddingOptions, Producer, QueryTimeoutError
from embedfleet.producer.queries import RequestStream
from embedfleet.shared.model_registry import model_label
from embedfleet.shared.protocol import QueryFailedError, Result, SparseVector
from embedfleet.shared.redis_conn import redis_deadline
from embedfleet.shared.retry import RedisUnavailableError
from embedfleet.shared.settings import Settings
from embedfleet.shared.streams import live_workers

LIVENESS_CACHE_S = 1.0
T = TypeVar("T")


class WorkerHeartbeats:
    """How many workers are alive, from their heartbeats (``{ns}:workers``), cached a second.

    Informative only: nothing the gateway enqueues waits on it (TEI's /health, which means
    "the model can answer", is the one route that answers 503 without a worker)."""

    def __init__(self, client: aioredis.Redis, settings: Settings) -> None:
        self.client = client
        self.settings = settings
        self._checked_at = 0.0
        self._alive = 0

    async def live_workers(self) -> int:
        now = time.monotonic()
        if now - self._checked_at < LIVENESS_CACHE_S:
            return self._alive
        async with redis_deadline(
            self.settings.gateway_redis_timeout_s, "read the workers' heartbeats"
        ):
            self._alive = await live_workers(
                self.client, self.settings.keys, self.settings.gateway_worker_idle_ms
            )
        self._checked_at = now
        return self._alive

    def none_alive(self) -> str:
        """What to tell a caller while no worker has a recent heartbeat."""
        return (
            "no embedding worker is running (no heartbeat in the last "
            f"{self.settings.gateway_worker_idle_ms} ms); with scale-to-zero one is starting, "
            "else start one with `embedfleet worker`. Check: redis-cli ZRANGE "
            f"{self.settings.keys.workers_alive} 0 -1 WITHSCORES"
        )

    async def require_worker(self) -> None:
        if await self.live_workers() == 0:
            raise retry_later(
                503, self.none_alive(), "no_worker", self.settings.gateway_retry_after_s
            )


class Embedder:
    def __init__(
        self,
        settings: Settings,
        producer: Producer,
        workers: WorkerHeartbeats,
        metrics: GatewayMetrics,
    ) -> None:
        self.settings = settings
        self.producer = producer
        self.client = producer.client
        self.keys = settings.keys
        self.workers = workers
        self.metrics = metrics
        # the ``model`` label of the gateway's input counter: the lane's name, else the
        # default model's served name
        self.model = model_label(settings)
        # how the model counts the tokens of texts (TEI's x-compute-tokens header): set by the
        # Gateway view that owns this embedder, which has the model's tokenizer and card
        self.count_tokens: TokenCounter | None = None

    async def embed(self, inputs: Sequence[str | bytes], options: EmbeddingOptions) -> np.ndarray:
        """float32 vectors (len(inputs), dim) as the workers return them (fp16 on the wire).
        An input of bytes is an encoded image (gateway/images.py): a request holding one rides
        the interactive stream whatever its size (the query stage embeds texts alone)."""
        texts = [item for item in inputs if isinstance(item, str)]
        images = len(texts) < len(inputs)

        async def call(stream: RequestStream, timeout: float) -> np.ndarray:
            if stream == "query":
                return await self.producer.embed_queries(texts, timeout=timeout, options=options)
            return await self.producer.embed_texts(list(inputs), timeout=timeout, options=options)

        only: RequestStream | None = "texts" if images else None
        return await self._through_stream(len(inputs), call, texts, only=only)

    async def embed_sparse(
        self, texts: Sequence[str], max_active_dims: int | None = None
    ) -> list[SparseVector]:
        """Sparse weights of ``texts`` (a fleet serving a SparseEncoder), on the same request
        streams."""

        async def call(stream: RequestStream, timeout: float) -> list[SparseVector]:
            return await self.producer.embed_sparse(
                list(texts), timeout=timeout, max_active_dims=max_active_dims, lane=stream
            )

        return await self._through_stream(len(texts), call, texts)

    async def rerank(
        self, query: str, documents: Sequence[str], *, raw_scores: bool = False
    ) -> np.ndarray:
        """Scores of (``query``, document) per document, in order (a cross-encoder fleet;
        ``raw_scores``: its logits, before its activation)."""

        async def call(stream: RequestStream, timeout: float) -> np.ndarray:
            return await self.producer.rerank(
                query, list(documents), timeout=timeout, lane=stream, raw_scores=raw_scores
            )

        return await self._through_stream(
            len(documents), call, [query] * len(documents) + list(documents)
        )

    async def embed_representations(
        self, texts: Sequence[str], representations: Sequence[str], *, token_states: bool = False
    ) -> list[Result]:
        """Each text's Result with ``representations`` (a multi-head fleet), same request streams;
        ``token_states``: with every token's last hidden state (a dense fleet), on the query
        stream whatever the count: a worker's bulk path may pack its batches (the varlen layout),
        which give the pooled vectors alone."""

        async def call(stream: RequestStream, timeout: float) -> list[Result]:
            return await self.producer.embed_representations(
                list(texts),
                representations,
                timeout=timeout,
                lane=stream,
                token_states=token_states,
            )

        only: RequestStream | None = "query" if token_states else None
        return await self._through_stream(len(texts), call, texts, only=only)

    async def score_pairs(
        self, pairs: Sequence[tuple[str, str | None]], *, raw_scores: bool = False
    ) -> np.ndarray:
        """Every label's score per (text, text) pair (a cross-encoder fleet; ``(text, None)``:
        the text classified alone; ``raw_scores``: the logits), same request streams."""

        async def call(stream: RequestStream, timeout: float) -> np.ndarray:
            return await self.producer.score_pairs(
                list(pairs), timeout=timeout, lane=stream, raw_scores=raw_scores
            )

        texts = [text for pair in pairs for text in pair if text is not None]
        return await self._through_stream(len(pairs), call, texts)

    async def _through_stream(
        self,
        count: int,
        call: Callable[[RequestStream, float], Awaitable[T]],
        texts: Sequence[str],
        *,
        only: RequestStream | None = None,
    ) -> T:
        """``call`` on the request stream ``count`` inputs ride (``only``: that stream whatever
        the count), refused (429) while that stream is full; a timeout or a worker's refusal as
        the gateway's errors. ``texts``: every text the call sends (a pair's two), for the
        request's timing headers (gateway/timing_headers.py)."""
        with fleet_call(texts, self.count_tokens) as timed:
            return await self._stream_call(count, call, timed.sending, only)

    async def _stream_call(
        self,
        count: int,
        call: Callable[[RequestStream, float], Awaitable[T]],
        sending: Callable[[], None],
        only: RequestStream | None = None,
    ) -> T:
        priority = self.keys.priority_streams
        settings = self.settings
        chosen: RequestStream
        by_count = count <= settings.gateway_lane_max_inputs
        if only == "query" or (only is None and by_count):
            label, key, chosen = "query", priority.query, "query"
            # "query lane": the 429 message's wording, which clients may match, stays as it was
            bound = ("query lane", settings.gateway_lane_high_water, "GATEWAY_LANE_HIGH_WATER")
        else:
            # the interactive stream is bounded like a backlog; the bulk backlog itself does
            # not hold a request up, so it does not refuse one either
            label, key, chosen = "interactive", priority.interactive, "texts"
            bound = ("interactive stream", settings.backlog_high_water, "BACKLOG_HIGH_WATER")
        what, high_water, variable = bound
        async with redis_deadline(settings.gateway_redis_timeout_s, f"read the {what}'s length"):
            waiting = await self.client.xlen(key)
        self.metrics.tei.queue_size.set(waiting)  # TEI's te_queue_size: the stream's backlog
        await self._refuse_when_full(what, waiting, high_water, f"EMBEDFLEET_{variable}")
        self.metrics.inputs.labels(label, self.model).inc(count)
        sending()
        try:
            return await call(chosen, self.settings.gateway_timeout_s)
        except QueryTimeoutError as error:
            if isinstance(error.__cause__, RedisUnavailableError):
                # Redis unreachable or hung, not a slow fleet: 503 with Retry-After
                # (errors.redis_error_handler), in the route's envelope
                raise error.__cause__ from None
            message = str(error)
            if await self.workers.live_workers() == 0:
                message += "; " + self.workers.none_alive()
            raise _timeout(message) from None
        except QueryFailedError as error:
            raise input_rejected(error) from None

    async def _refuse_when_full(
        self, what: str, waiting: int, high_water: int, variable: str
    ) -> None:
        """429 (retry after EMBEDFLEET_GATEWAY_RETRY_AFTER_S) while ``waiting`` entries are
        ``high_water`` or more; the message names the ``variable`` that sets it."""
        if waiting >= high_water:
            raise overloaded(
                f"the {what} ({waiting:,} entries) is over the high-water mark "
                f"({variable}={high_water:,}); retry after the Retry-After seconds",
                self.settings.gateway_retry_after_s,
            )


def _timeout(message: str) -> APIError:
    return APIError(504, message, type="server_error", code="timeout")
