"""The asyncio client: enqueue chunks in pipelined batches, follow a job, read results back.

``Producer`` is one model's lane (``ProducerLane``, producer/lane.py: its connection, retry,
keys, tenant and model card) and the facade of the calls, routing a call that names another
model to that model's lane (``for_model``). The work is done by its parts, each reading the lane
through it:

- ``Enqueuer`` (producer/enqueuer.py, producer/partition_writes.py): chunks checked, stamped
  and sent in batches through the enqueue script;
- ``BacklogWaits`` (producer/backlog_waits.py): the backlog, the waits for room;
- ``Queries`` (producer/queries.py): requests on the query and interactive streams, with the
  calls for sparse weights, pair scores and several representations in
  producer/representation_calls.py (``RepresentationCalls``, the lane's class Producer extends);
- producer/jobs.py: a job's progress and the wait for its end;
- ``Results`` (producer/results.py): the results streams read back;
- ``DocumentSplitters`` (producer/document_splitters.py): whole documents into chunks.

Every call rides out Redis restarts, failovers and dropped connections through the client's one
``RedisRetry`` (``shared/retry.py``): capped, jittered backoff for at most
``EMBEDFLEET_REDIS_RETRY_S`` (a query: its timeout), then ``RedisUnavailableError``. What is sent
again after a fault is safe to send again (see each call).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from embedfleet.producer.backlog_waits import BacklogWaits
from embedfleet.producer.backlog_waits import TenantBacklogFullError as TenantBacklogFullError
from embedfleet.producer.backlog_waits import TenantRoom as TenantRoom
from embedfleet.producer.chunks import ChunkLike as ChunkLike
from embedfleet.producer.chunks import EmbeddingOptions as EmbeddingOptions
from embedfleet.producer.chunks import as_chunk as as_chunk
from embedfleet.producer.document_splitters import DocumentSplitters
from embedfleet.producer.enqueue import Enqueued
from embedfleet.producer.enqueuer import Enqueuer
from embedfleet.producer.jobs import JobTimeoutError as JobTimeoutError
from embedfleet.producer.jobs import read_progress, wait_for
from embedfleet.producer.lane import CARD_RECHECK_S as CARD_RECHECK_S
from embedfleet.producer.partition_writes import (
    ReplicasNotConfirmedError as ReplicasNotConfirmedError,
)
from embedfleet.producer.queries import QueryTimeoutError as QueryTimeoutError
from embedfleet.producer.representation_calls import RepresentationCalls
from embedfleet.producer.results import Results
from embedfleet.producer.results_reader import ResultsReader
from embedfleet.shared.backlog import PartitionBacklog
from embedfleet.shared.jobs import JobProgress
from embedfleet.shared.keys import Keys
from embedfleet.shared.protocol import Result

if TYPE_CHECKING:
    from embedfleet.producer.documents import Document, DocumentSplitter


class Producer(RepresentationCalls):
    """Enqueue chunks and follow jobs. Built from the same settings as every other part.

    ``async with Producer() as producer: await producer.enqueue([...], job="docs-v1")``
    """

    # Built with the lane's options (``ProducerLane.__init__``, their one declaration); the
    # parts below are made on first use, each reading this lane's keys, connection and retry
    # through it.

    @cached_property
    def _lanes(self) -> dict[Keys, Producer]:
        """``for_model``'s producers, by lane."""
        return {}

    @cached_property
    def _named(self) -> dict[str, Producer]:
        """``for_model``'s producers, by the name they were asked by."""
        return {}

    @cached_property
    def _waits(self) -> BacklogWaits:
        return BacklogWaits(self)

    @cached_property
    def _enqueuer(self) -> Enqueuer:
        return Enqueuer(self, self._waits)

    @cached_property
    def _results(self) -> Results:
        return Results(self)

    @cached_property
    def _splitters(self) -> DocumentSplitters:
        return DocumentSplitters(self)

    async def for_model(self, model: str | None, *, deadline: float | None = None) -> Producer:
        """A producer for ``model``'s lane (``route``), sharing this one's connection and
        retry; this one for None or its own model. Kept, one per lane, and routed once per
        name (``wait_for_job(..., model=)`` asks at every poll)."""
        if model is None:
            return self
        if model in self._named:
            return self._named[model]
        await self.setup(deadline=deadline)
        keys = await self.route(model, deadline=deadline)
        if keys == self.keys:
            lane = self
        elif keys in self._lanes:
            lane = self._lanes[keys]
        else:
            lane = Producer(self.settings, self.client)
            lane.retry = self.retry
            lane.tenant = self.tenant
            lane.keys = keys
            self._lanes[keys] = lane
        self._named[model] = lane
        return lane

    # --- enqueueing ---------------------------------------------------------------------
    async def enqueue(
        self,
        chunks: Iterable[ChunkLike],
        *,
        job: str | None = None,
        batch_size: int = 1000,
        on_batch: Callable[[int], None] | None = None,
        options: EmbeddingOptions | None = None,
        force: bool = False,
        model: str | None = None,
        tenant: str | None = None,
        reembed: bool = False,
        backlog_wait_s: float | None = None,
        token_ids: bool | None = None,
    ) -> Enqueued:
        """XADD every chunk, ``batch_size`` per pipelined round trip; returns how many were
        added (an ``Enqueued``, with ``present``: the chunks their job already had). A job adds
        each chunk id once unless ``force``; ``reembed``, ``options``, ``tenant`` and the waits
        for room (``backlog_wait_s``, ``TenantBacklogFullError``): producer/enqueuer.py.

        ``model``: the model these chunks (and their job) are for (``for_model``); its job's
        progress is that model's: ``wait_for_job(job, model=...)``.

        ``token_ids``: send each chunk's token ids, made here with the tokenizer the workers
        publish, so they do not tokenize (producer/token_ids.py; None:
        EMBEDFLEET_PRODUCER_TOKEN_IDS); TokenIdsUnavailableError where they cannot be made.
        """
        lane = self if model is None else await self.for_model(model)
        return await lane._enqueuer.enqueue(
            chunks,
            job=job,
            batch_size=batch_size,
            on_batch=on_batch,
            options=options,
            force=force,
            tenant=tenant if tenant is not None else self.tenant,
            reembed=reembed,
            backlog_wait_s=backlog_wait_s,
            token_ids=token_ids,
        )

    async def enqueue_documents(
        self,
        documents: Iterable[Document | Mapping[str, Any]],
        *,
        job: str | None = None,
        overlap_tokens: int | None = None,
        prompt_name: str | None = None,
        batch_size: int = 1000,
        on_batch: Callable[[int], None] | None = None,
        force: bool = False,
        tenant: str | None = None,
        reembed: bool = False,
        token_ids: bool | None = None,
    ) -> Enqueued:
        """Split whole documents ({"id", "text", "meta"?} or ``Document``) with the model's own
        tokenizer and enqueue the chunks; returns how many chunks were added (``enqueue``).

        Chunks are ``<id>#<n>``, at most the model's maximum length minus special and prompt
        tokens, overlapping by ``overlap_tokens`` (default EMBEDFLEET_DOCUMENT_OVERLAP_TOKENS),
        with the document's meta plus ``doc``, ``n``, ``start`` and ``end`` (character offsets).
        Needs ``pip install 'embedfleet[documents]'``; see producer/documents.py. ``token_ids``:
        each chunk sent with its token ids (``enqueue``).
        """
        await self.model_card()  # the published maximum and prompts, where a worker ran
        splitter = self.document_splitter(overlap_tokens, prompt_name)
        return await self.enqueue(
            splitter.split_all(documents, job),
            job=job,
            batch_size=batch_size,
            on_batch=on_batch,
            force=force,
            tenant=tenant,
            reembed=reembed,
            token_ids=token_ids,
        )

    def document_splitter(
        self, overlap_tokens: int | None = None, prompt_name: str | None = None
    ) -> DocumentSplitter:
        """The splitter for this producer's model (EMBEDFLEET_MODEL), built once per options:
        its tokenizer from the model's files, its maximum and prompts from the model card once
        :meth:`model_card` has read one, else as the directory declares them."""
        return self._splitters.splitter(overlap_tokens, prompt_name, self._card)

    # --- backlog ------------------------------------------------------------------------
    async def backlog(self) -> int:
        """The bulk backlog as the high-water mark (EMBEDFLEET_BACKLOG_HIGH_WATER) reads it:
        the fullest partition's ingest streams, every tenant's."""
        return await self._waits.backlog()

    async def partition_backlogs(
        self, partitions: Sequence[Keys] | None = None
    ) -> list[PartitionBacklog]:
        """Each partition's ingest streams' lengths, the total and every tenant's
        (shared/backlog.py): one script call per partition, pipelined."""
        return await self._waits.partition_backlogs(partitions)

    async def tenant_backlog(self, tenant: str | None = None) -> int:
        """A tenant's entries waiting or in flight over all partitions (its name, or None for
        the producer's own tenant, else the default)."""
        return await self._waits.tenant_backlog(tenant)

    async def room_for(
        self, tenant: str | None = None, backlogs: Sequence[PartitionBacklog] | None = None
    ) -> TenantRoom:
        """A tenant's backlog against its EMBEDFLEET_TENANT_MAX_BACKLOG (``TenantRoom``: held,
        limit, left, full), the one place it is compared (producer/backlog_waits.py)."""
        return await self._waits.room_for(tenant, backlogs)

    # --- priority queries -------------------------------------------------------------
    async def embed_query(
        self,
        text: str,
        *,
        timeout: float = 10.0,
        options: EmbeddingOptions | None = None,
        model: str | None = None,
    ) -> np.ndarray:
        """Embed one query through the query stream: a float32 vector (the model's dimension,
        or ``options.dimensions``), or int8/uint8 codes / packed bits for those dtypes."""
        return (await self.embed_queries([text], timeout=timeout, options=options, model=model))[0]

    async def embed_queries(
        self,
        texts: Sequence[str],
        *,
        timeout: float = 10.0,
        options: EmbeddingOptions | None = None,
        model: str | None = None,
    ) -> np.ndarray:
        """Embed a few queries now, ahead of any bulk backlog; shape (len(texts), dim).

        The worker uses the model's ``query`` prompt unless ``options`` names another (as
        ``SentenceTransformer.encode_query`` does). The query stream is served between the
        transformer layers of bulk batches: keep requests on it small (the gateway sends at
        most EMBEDFLEET_GATEWAY_LANE_MAX_INPUTS), and send many texts with ``embed_texts``.
        Reply lists, withdrawal on timeout (``QueryTimeoutError``) and Redis faults:
        ``Queries.answers`` (producer/queries.py). ``model``: the model to ask (``for_model``).
        """
        lane = await self.for_model(model, deadline=time.monotonic() + timeout)
        return await lane._queries.embed(texts, "query", timeout, options)

    async def embed_texts(
        self,
        texts: Sequence[str | bytes],
        *,
        options: EmbeddingOptions | None = None,
        timeout: float = 60.0,
        model: str | None = None,
    ) -> np.ndarray:
        """Embed many texts for someone waiting, ahead of any bulk backlog, on the interactive
        stream (bulk-sized batches, read before every ingest stream: producer/queries.py);
        shape (len(texts), dim). The model's ``document`` prompt applies unless ``options``
        names one. An item of bytes is an encoded image (``Chunk.image``: a CLIP or SigLIP
        lane), embedded by the image tower. Timeouts, withdrawal and Redis faults as
        ``embed_queries``; ``model`` too."""
        lane = await self.for_model(model, deadline=time.monotonic() + timeout)
        return await lane._queries.embed(texts, "texts", timeout, options)

    # --- jobs and results ---------------------------------------------------------------
    async def progress(
        self, job: str, *, deadline: float | None = None, model: str | None = None
    ) -> JobProgress:
        """The job's counters, summed over the partitions (each counts its own chunks); of
        ``model``'s lane when named (a job's counters live in its model's keys)."""
        if model is not None:
            lane = await self.for_model(model, deadline=deadline)
            if lane is not self:
                return await lane.progress(job, deadline=deadline)
        else:
            await self.routed(deadline=deadline)
        return await read_progress(self, job, deadline=deadline)

    async def wait_for_job(
        self,
        job: str,
        *,
        timeout: float | None = None,
        interval: float = 0.25,
        on_progress: Callable[[JobProgress], None] | None = None,
        model: str | None = None,
    ) -> JobProgress:
        """Return once every enqueued chunk of ``job`` is embedded or dead-lettered (``model``:
        a job enqueued for that model); ``interval``: the longest wait between two reads of its
        counters (``jobs.wait_for``)."""

        async def read(deadline: float | None) -> JobProgress:
            return await self.progress(job, deadline=deadline, model=model)

        return await wait_for(
            job, read, timeout=timeout, interval=interval, on_progress=on_progress
        )

    def results(
        self,
        *,
        job: str | None = None,
        page: int = 1000,
        consume: bool = False,
        consumer: str | None = None,
    ) -> AsyncIterator[Result]:
        """Every result in the results streams (optionally one job's), oldest first within each
        partition; drained with ``consume`` (``Results.read``, producer/results.py)."""
        return self._results.read(job=job, page=page, consume=consume, consumer=consumer)

    def results_reader(self, *, consumer: str | None = None, page: int = 1000) -> ResultsReader:
        """A consuming reader of the results streams, page by page (``next_page`` /
        ``acknowledge``), for callers that acknowledge only once a page is stored."""
        return self._results.reader(consumer=consumer, page=page)
