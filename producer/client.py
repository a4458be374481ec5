"""The asyncio client: enqueue chunks in pipelined batches, follow a job, read results back.

Every call rides out Redis restarts, failovers and dropped connections through the client's one
``RedisRetry`` (``shared/retry.py``): capped, jittered backoff for at most
``EMBEDFLEET_REDIS_RETRY_S`` (a query: its timeout), then ``RedisUnavailableError``. What is sent
again after a fault is safe to send again (see each call).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from embedfleet.producer.confirmed_writes import Group, write_confirmed
from embedfleet.producer.enqueue import (
    EnqueueCall,
    Enqueued,
    enqueue_script_command,
    finished_ttl_command,
    register_tenant_command,
    script_counts,
    script_handled,
)
from embedfleet.producer.polling import PollPacer
from embedfleet.producer.replies import Answers, pop_answers
from embedfleet.producer.results_reader import ResultsReader
from embedfleet.shared.backlog import PartitionBacklog, backlog_command, tenant_backlog
from embedfleet.shared.fault_kinds import is_transient
from embedfleet.shared.jobs import JobProgress
from embedfleet.shared.keys import Keys
from embedfleet.shared.logging import get_logger
from embedfleet.shared.model_registry import own_names, resolve_model
from embedfleet.shared.modelcard import ModelCard, read_card
from embedfleet.shared.protocol import (
    DEFAULT_LIMITS,
    OPTION_NAMES,
    PAYLOAD_FIELD,
    REPRESENTATION_OPTION_NAMES,
    Chunk,
    ChunkLimits,
    ProtocolError,
    Result,
    SparseVector,
    chunk_from_mapping,
    decode_result,
    encode_chunk,
    validate_chunk,
)
from embedfleet.shared.redis_conn import (
    connect_client_settings,
    ensure_groups,
    redact_url,
    stream_entries,
)
from embedfleet.shared.retry import (
    LogOutages,
    OutageListener,
    RedisRetry,
    RedisUnavailableError,
    describe,
)
from embedfleet.shared.settings import Settings

if TYPE_CHECKING:
    from embedfleet.producer.documents import Document, DocumentSplitter

log = get_logger("embedfleet.producer")
# How often a client without the model card asks Redis for it again (no worker has started yet)
CARD_RECHECK_S = 1.0
# How late past a query's deadline a round trip may still answer (a BLPOP ends at the deadline
# by itself) before it counts as a hung Redis and is cancelled
REPLY_MARGIN_S = 0.25
ChunkLike = Chunk | Mapping[str, Any]


class ReplicasNotConfirmedError(redis_errors.ConnectionError):
    """Fewer replicas than EMBEDFLEET_MIN_REPLICAS acknowledged a batch: it is sent again
    (a transient fault, retried with the client's backoff like a dropped connection)."""


class TenantBacklogFullError(RuntimeError):
    """A tenant's backlog stayed at its EMBEDFLEET_TENANT_MAX_BACKLOG for
    EMBEDFLEET_TENANT_BACKLOG_WAIT_S (or the call's ``backlog_wait_s``): ``added`` (an
    ``Enqueued``) is what the enqueue call added before it gave up, and the message says how
    many; its other chunks were not added. Enqueueing them all again under the same job adds
    only those (the job skips the others). ``handled``: how many of the call's chunks, from
    its first, were dealt with (added, or in their job already); sending the rest from there
    loses nothing (a chunk after it may have been added too: sent again, its job skips it)."""

    def __init__(self, full: str, added: Enqueued | None = None, handled: int = 0) -> None:
        super().__init__(full)
        self.full = full  # who holds what, and how long the call waited
        self.added = added if added is not None else Enqueued()
        self.handled = handled

    def __str__(self) -> str:
        return (
            f"{self.full}; this call added {int(self.added)} of its chunks, the others were "
            "not added: enqueue them again once there is room (a job skips the chunks it "
            "already has)"
        )


def _waited(wait_s: float) -> str:
    """How long a call waited for room, for TenantBacklogFullError's message."""
    if not wait_s:
        return "(the call does not wait for room)"
    return f"after waiting {wait_s:g}s (EMBEDFLEET_TENANT_BACKLOG_WAIT_S)"


@dataclass
class _Sent:
    """What became of one partition's chunks in one round: ``added`` (this batch's, a re-send's
    included), ``present`` (skipped: in their job already), ``refused`` (no room under their
    tenant's EMBEDFLEET_TENANT_MAX_BACKLOG share: to be sent again once there is room)."""

    added: int = 0
    present: int = 0
    refused: list[Chunk] = dataclasses.field(default_factory=list)


class JobTimeoutError(TimeoutError):
    """wait_for_job gave up; the job is still running and its entries are still queued."""


class QueryTimeoutError(TimeoutError):
    """No worker answered a query in time; the query was withdrawn and nothing is left behind."""


@dataclass(frozen=True)
class EmbeddingOptions:
    """Per-job (or per-query) embedding options; None leaves the chunk's own or the worker's."""

    prompt_name: str | None = None
    prompt: str | None = None
    dimensions: int | None = None
    dtype: str | None = None

    def apply(self, chunk: Chunk) -> Chunk:
        """The chunk with these options filled in where the chunk has none of its own."""
        changes = {
            name: getattr(self, name)
            for name in OPTION_NAMES
            if getattr(self, name) is not None and getattr(chunk, name) is None
        }
        return dataclasses.replace(chunk, **changes) if changes else chunk


def as_chunk(
    item: ChunkLike,
    job: str | None,
    options: EmbeddingOptions | None = None,
    limits: ChunkLimits = DEFAULT_LIMITS,
) -> Chunk:
    """Accept a Chunk or a mapping like one JSONL line: {"id", "text", "meta"?, options?},
    checked by the protocol's one validator with ``limits`` (what the worker would
    dead-letter is refused here, with a ``ValueError``, a ``ProtocolError``, saying why)."""
    if isinstance(item, Chunk):
        chunk = item if job is None or item.job == job else dataclasses.replace(item, job=job)
    else:
        fields = {
            name: item.get(name)
            for name in (
                "id",
                "text",
                "meta",
                "tenant",
                *OPTION_NAMES,
                *REPRESENTATION_OPTION_NAMES,
                "reembed",
            )
        }
        chunk = chunk_from_mapping(fields, limits, job=job or item.get("job"))
    if options is not None:
        chunk = options.apply(chunk)
    try:
        return validate_chunk(chunk, limits)
    except ProtocolError as error:
        raise ProtocolError(f"chunk {chunk.id!r}: {error}", error.code) from None


class Producer:
    """Enqueue chunks and follow jobs. Built from the same settings as every other part.

    ``async with Producer() as producer: await producer.enqueue([...], job="docs-v1")``
    """

    def __init__(
        self,
        settings: Settings | None = None,
        client: aioredis.Redis | None = None,
        *,
        on_outage: OutageListener | None = None,
        first_contact_s: float | None = None,
        model: str | None = None,
        tenant: str | None = None,
    ):
        """``on_outage`` is told once when Redis becomes unreachable and once when it is back
        (default: a log line each); every call waits for it, for at most
        ``EMBEDFLEET_REDIS_RETRY_S``, then raises ``RedisUnavailableError``. With
        ``first_contact_s``, a Redis this client has not reached yet is given up on after that
        long instead (the CLI verbs: a server that was never up is not an outage).

        ``model``: the model this producer's chunks, jobs and queries go to in a namespace
        serving several (shared/model_registry.py), routed at ``setup()`` (``async with``); a
        name no worker registered raises ``UnknownModelError`` there. None: the settings' own
        (``EMBEDFLEET_MODEL_LANE``, else the namespace's default model). Single calls can name
        another: ``enqueue(..., model=...)``, ``embed_queries(..., model=...)``.

        ``tenant``: the tenant this producer's chunks are accounted to and share the fleet as
        (shared/tenants.py), unless a call or a chunk names another; None: what
        EMBEDFLEET_TENANT_MAP says for each chunk's job, else EMBEDFLEET_DEFAULT_TENANT."""
        self.settings = settings or Settings()
        self.tenants = self.settings.tenant_policy
        self.tenant = None if tenant is None else self.tenants.resolve(tenant)
        self.keys: Keys = self.settings.keys
        self.model = model
        self._routed = model is None
        self._lanes: dict[Keys, Producer] = {}  # for_model's producers, by lane
        self._named: dict[str, Producer] = {}  # and by the name they were asked by
        self.client = client or connect_client_settings(self.settings)
        self._owns_client = client is None
        self._ready = False
        self.retry = RedisRetry(
            redact_url(self.settings.effective_redis_url),
            self.settings.redis_retry_s,
            on_outage or LogOutages(),
            first_contact_s,
        )
        self._card: ModelCard | None = None
        self._card_missing_at = float("-inf")
        self._splitters: dict[tuple[int, str | None, bool], DocumentSplitter] = {}

    async def __aenter__(self) -> Producer:
        await self.setup()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def setup(self, *, deadline: float | None = None) -> None:
        """Route to this producer's model (``model=``), then create the consumer groups if no
        worker has yet (at id 0: nothing is skipped)."""
        if not self._routed:
            self.keys = await self.route(self.model, deadline=deadline)
            self._routed = True
        if not self._ready:
            await self.retry.call(
                "create the consumer groups",
                lambda: ensure_groups(self.client, self.keys),
                deadline=deadline,
            )
            self._ready = True

    async def close(self) -> None:
        if self._owns_client:
            await self.client.aclose()

    # --- models -------------------------------------------------------------------------
    async def route(self, model: str | None, *, deadline: float | None = None) -> Keys:
        """The key set of ``model`` in this namespace: the one rule the producer, the gateway
        and the CLI share (``shared/model_registry.route_model``: a registered name, or this
        producer's own model; ``UnknownModelError`` for any other). None: this producer's."""
        if model is None:
            return self.keys
        own = own_names(self.settings, None if self._card is None else self._card.name)
        base = self.settings.keys
        return await self.retry.call(
            "read the registry of models",
            lambda: resolve_model(self.client, base, model, own),
            deadline=deadline,
        )

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

    async def model_card(self, *, deadline: float | None = None) -> ModelCard | None:
        """The facts the workers published about their model (``Keys.model``,
        shared/modelcard.py), or None while no worker ever started in this namespace. Read once,
        then kept (a producer's keys are one model's); while there is none, asked again at most
        every CARD_RECHECK_S, so enqueueing before any worker started is not one read per chunk."""
        now = time.monotonic()
        if self._card is None and now - self._card_missing_at >= CARD_RECHECK_S:
            self._card = await self.retry.call(
                "read the model card",
                lambda: read_card(self.client, self.keys),
                deadline=deadline,
            )
            self._card_missing_at = now
        return self._card

    async def _checked(self, chunk: Chunk, *, deadline: float | None = None) -> Chunk:
        card = await self.model_card(deadline=deadline)
        if card is not None:
            card.check(chunk)
        return chunk

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
    ) -> Enqueued:
        """XADD every chunk, ``batch_size`` per pipelined round trip; returns how many were
        added (an ``Enqueued``: an int, with ``present``, the chunks skipped because their job
        already had them with the same payload, and ``chunks``, all of them).

        A job remembers its chunk ids for EMBEDFLEET_JOB_IDS_TTL_S after its latest enqueue
        (producer/enqueue.py): enqueueing them again adds nothing, unless ``force`` (after
        their vectors were lost, say a wiped table); a batch re-sent after a fault still adds
        each chunk once.

        ``reembed`` marks every chunk ``reembed`` (the protocol field): the workers run the
        model for it even where their vector cache holds its vector (``force`` is another
        thing: it re-sends ids the job already has, which the cache may then answer).

        ``options`` (prompt, dimensions, dtype) apply to every chunk that has none of its own.
        A malformed option, or one the served model cannot honour (when a worker has published
        it), raises ValueError before anything is sent for that chunk.

        ``tenant`` (else the producer's, else the tenant map's for the job, else the default;
        a chunk that names its own keeps it) goes to its own ingest streams, read by weight
        (EMBEDFLEET_TENANT_WEIGHTS). A tenant with EMBEDFLEET_TENANT_MAX_BACKLOG never holds
        more: the enqueue script adds entry by entry while there is room (each partition its
        share of the limit), and the call waits for room for the rest, giving up after
        EMBEDFLEET_TENANT_BACKLOG_WAIT_S without room with TenantBacklogFullError, whose
        ``added`` is what this call added before. ``backlog_wait_s`` waits that long instead;
        0 not at all: the call adds while there is room, then raises (the gateway's batch
        runner, which serves other batches meanwhile and sends the rest from the error's
        ``handled`` on a later turn).

        Entries are never trimmed on add: an undelivered chunk must not be lost. Workers delete
        entries once they are acknowledged.

        ``model``: the model these chunks (and their job) are for (``for_model``); its job's
        progress is that model's: ``wait_for_job(job, model=...)``.
        """
        if model is not None:
            lane = await self.for_model(model)
            return await lane.enqueue(
                chunks,
                job=job,
                batch_size=batch_size,
                on_batch=on_batch,
                options=options,
                force=force,
                tenant=tenant if tenant is not None else self.tenant,
                reembed=reembed,
                backlog_wait_s=backlog_wait_s,
            )
        await self.setup()
        wait_s = self.settings.tenant_backlog_wait_s if backlog_wait_s is None else backlog_wait_s
        call = EnqueueCall(force=force)
        total = Enqueued()
        batch: list[Chunk] = []
        named = tenant if tenant is not None else self.tenant
        by_job: dict[str | None, str | None] = {}
        for item in chunks:
            chunk = as_chunk(item, job, options, self.settings.chunk_limits)
            if chunk.tenant is None:
                if chunk.job not in by_job:
                    by_job[chunk.job] = self.tenants.wire(
                        self.tenants.resolve(named, job=chunk.job)
                    )
                if by_job[chunk.job] is not None:
                    chunk = dataclasses.replace(chunk, tenant=by_job[chunk.job])
            elif chunk.tenant == self.tenants.default:
                chunk = dataclasses.replace(chunk, tenant=None)
            if reembed and not chunk.reembed:
                chunk = dataclasses.replace(chunk, reembed=True)
            batch.append(await self._checked(chunk))
            if len(batch) >= batch_size:
                total += await self._send(batch, on_batch, call, wait_s, total)
                batch = []
        if batch:
            total += await self._send(batch, on_batch, call, wait_s, total)
        if total.present:
            log.info(
                "chunks already enqueued in their job were not added again",
                present=total.present,
                added=int(total),
                override="force=True (embedfleet enqueue --force) adds them again",
            )
        return total

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
    ) -> Enqueued:
        """Split whole documents ({"id", "text", "meta"?} or ``Document``) with the model's own
        tokenizer and enqueue the chunks; returns how many chunks were added (``enqueue``).

        Chunks are ``<id>#<n>``, at most the model's maximum length minus special and prompt
        tokens, overlapping by ``overlap_tokens`` (default EMBEDFLEET_DOCUMENT_OVERLAP_TOKENS),
        with the document's meta plus ``doc``, ``n``, ``start`` and ``end`` (character offsets).
        Needs ``pip install 'embedfleet[documents]'``; see producer/documents.py.
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
        )

    def document_splitter(
        self, overlap_tokens: int | None = None, prompt_name: str | None = None
    ) -> DocumentSplitter:
        """The splitter for this producer's model (EMBEDFLEET_MODEL), built once per options:
        its tokenizer from the model's files, its maximum and prompts from the model card once
        :meth:`model_card` has read one, else as the directory declares them."""
        from embedfleet.producer.documents import DocumentSplitter, SplitLimits
        from embedfleet.shared.model_path import resolve_model_path

        if self.keys.model_lane != self.settings.model_lane:
            model = self.keys.model_lane or "the namespace's default model"
            raise ValueError(
                f"documents for {model!r} are split with that model's tokenizer: use a Producer "
                "whose settings name it (EMBEDFLEET_MODEL_LANE and EMBEDFLEET_MODEL, the "
                "model's directory)"
            )

        overlap = (
            self.settings.document_overlap_tokens if overlap_tokens is None else overlap_tokens
        )
        key = (overlap, prompt_name, self._card is not None)
        if key not in self._splitters:
            limits = None if self._card is None else SplitLimits.of_card(self._card)
            self._splitters[key] = DocumentSplitter(
                resolve_model_path(self.settings.model),
                limits,
                overlap_tokens=overlap,
                prompt_name=prompt_name,
            )
        return self._splitters[key]

    async def _wait_for_room(self, partitions: Iterable[Keys], tenants: set[str | None]) -> None:
        """Backpressure: hold enqueueing while a partition this batch goes to holds more than
        the high-water mark (each partition's streams, every tenant's, are bounded on its own
        node). A tenant of the batch (``tenants``) at its EMBEDFLEET_TENANT_MAX_BACKLOG is
        waited for before, for as long as the call waits (``_wait_for_tenants``)."""
        mark = self.settings.backlog_high_water
        chosen = list(partitions)
        waited_since: float | None = None
        while (backlog := await self._backlog(chosen)) >= mark:
            if waited_since is None:
                waited_since = time.monotonic()
                log.warning(
                    "backlog over the high-water mark: waiting for workers",
                    backlog=backlog,
                    high_water=mark,
                    setting="EMBEDFLEET_BACKLOG_HIGH_WATER",
                )
            await asyncio.sleep(0.5)
        if waited_since is not None:
            log.info(
                "backlog below the mark again", waited_s=round(time.monotonic() - waited_since, 1)
            )

    async def backlog(self) -> int:
        """The bulk backlog as the high-water mark (EMBEDFLEET_BACKLOG_HIGH_WATER) reads it:
        the fullest partition's ingest streams, every tenant's (each partition is bounded on
        its own node)."""
        return await self._backlog(list(self.keys.partitions_keys))

    async def partition_backlogs(
        self, partitions: Sequence[Keys] | None = None
    ) -> list[PartitionBacklog]:
        """Each partition's ingest streams' lengths, the total and every tenant's
        (shared/backlog.py): one script call per partition, pipelined."""
        chosen = list(self.keys.partitions_keys if partitions is None else partitions)

        async def lengths() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for partition in chosen:
                pipe.execute_command(*backlog_command(partition))
            return await pipe.execute()

        replies = await self.retry.call("read the backlog", lengths)
        return [PartitionBacklog.parse(reply) for reply in replies]

    async def tenant_backlog(self, tenant: str | None = None) -> int:
        """A tenant's entries waiting or in flight over all partitions (its name, or None for
        the producer's own tenant, else the default)."""
        name = self.tenants.resolve(tenant if tenant is not None else self.tenant)
        return tenant_backlog(await self.partition_backlogs(), self.tenants.wire(name))

    async def _backlog(self, partitions: list[Keys]) -> int:
        """The fullest of these partitions (all its tenants' streams together)."""
        return max(b.total for b in await self.partition_backlogs(partitions))

    async def _wait_for_tenants(self, tenants: set[str | None], wait_s: float) -> None:
        """Wait while a tenant with EMBEDFLEET_TENANT_MAX_BACKLOG is at it, for at most
        ``wait_s`` (the call's, else EMBEDFLEET_TENANT_BACKLOG_WAIT_S); then
        TenantBacklogFullError."""
        limits = {
            wire: limit
            for wire in tenants
            if (limit := self.tenants.backlog_limit(self.tenants.named(wire))) is not None
        }
        if not limits:
            return
        give_up_at = time.monotonic() + wait_s
        warned = False
        while True:
            backlogs = await self.partition_backlogs()
            full = {
                self.tenants.named(wire): (held, limit)
                for wire, limit in limits.items()
                if (held := tenant_backlog(backlogs, wire)) >= limit
            }
            if not full:
                return
            if time.monotonic() >= give_up_at:
                raise TenantBacklogFullError(
                    "tenant backlog full: "
                    + ", ".join(f"{t} holds {h} of {lim}" for t, (h, lim) in full.items())
                    + " entries (EMBEDFLEET_TENANT_MAX_BACKLOG) "
                    + _waited(wait_s)
                )
            if not warned:
                warned = True
                log.warning(
                    "tenant backlog at its limit: waiting for workers",
                    tenants=sorted(full),
                    setting="EMBEDFLEET_TENANT_MAX_BACKLOG",
                )
            await asyncio.sleep(0.5)

    async def _send(
        self,
        batch: list[Chunk],
        on_batch: Callable[[int], None] | None,
        call: EnqueueCall,
        wait_s: float,
        earlier: Enqueued | None = None,
    ) -> Enqueued:
        """Send one batch, each chunk to its partition, again after a fault: whether or not the
        server applied the lost try, the enqueue script adds and counts each chunk of a job once.
        With EMBEDFLEET_MIN_REPLICAS, a partition whose replicas did not confirm its chunks is
        sent again the same way. Chunks the script found no room for (their tenant at its
        EMBEDFLEET_TENANT_MAX_BACKLOG share in their partition) wait for room and are sent
        again; ``earlier`` (what the call added before this batch) goes into the
        TenantBacklogFullError raised when no room came for ``wait_s`` (the call's, else
        EMBEDFLEET_TENANT_BACKLOG_WAIT_S)."""
        # the batch's own token: an id the call repeats in a later batch is not a re-send
        call = call.for_batch()
        by_partition: dict[Keys, list[Chunk]] = {}
        for chunk in batch:
            by_partition.setdefault(self.keys.partition_for(chunk.id), []).append(chunk)
        added, present = 0, 0
        waiting = by_partition
        try:
            await self._wait_for_tenants({chunk.tenant for chunk in batch}, wait_s)
            await self._wait_for_room(by_partition, {chunk.tenant for chunk in batch})
            give_up_at = time.monotonic() + wait_s
            while True:
                sent = await self._send_round(waiting, call, len(batch))
                added += sum(s.added for s in sent.values())
                present += sum(s.present for s in sent.values())
                if on_batch is not None:
                    on_batch(sum(len(waiting[p]) - len(s.refused) for p, s in sent.items()))
                waiting = {p: s.refused for p, s in sent.items() if s.refused}
                if not waiting:
                    break
                if any(s.added for s in sent.values()):  # room came: each entry waits anew
                    give_up_at = time.monotonic() + wait_s
                await self._wait_for_share(waiting, give_up_at, wait_s)
        except TenantBacklogFullError as error:
            error.added = (earlier or Enqueued()) + Enqueued(added, present)
            # every chunk of the earlier batches was dealt with (their added and present),
            # and this batch's up to the first one still waiting
            unsent = {id(chunk) for chunks in waiting.values() for chunk in chunks}
            first_unsent = next((i for i, c in enumerate(batch) if id(c) in unsent), len(batch))
            error.handled = (earlier.chunks if earlier is not None else 0) + first_unsent
            raise
        return Enqueued(added, present)

    async def _send_round(
        self, waiting: dict[Keys, list[Chunk]], call: EnqueueCall, size: int
    ) -> dict[Keys, _Sent]:
        """``waiting``'s chunks, each partition's in one pipelined try, again after a fault
        (a partition's latest try tells all of it: the script counts a chunk this batch added
        before a lost reply as added by it again)."""
        unsent = waiting
        sent: dict[Keys, _Sent] = {}

        async def attempt() -> None:
            nonlocal unsent
            unsent, sent_now = await self._send_once(unsent, call)
            sent.update(sent_now)
            if unsent:
                raise ReplicasNotConfirmedError(
                    f"fewer than EMBEDFLEET_MIN_REPLICAS={self.settings.min_replicas} replicas "
                    f"confirmed the chunks of partitions {sorted(k.index for k in unsent)} "
                    "within EMBEDFLEET_MIN_REPLICAS_TIMEOUT_MS: sending them again"
                )

        await self.retry.call(f"enqueue a batch of {size} chunks", attempt)
        return sent

    def _backlog_share(self, partition: Keys, tenant: str | None) -> int | None:
        """What ``tenant``'s stream (on the wire: None the default) may hold in ``partition``
        (shared/tenants.py); None: no limit."""
        return self.tenants.backlog_share(
            self.tenants.named(tenant), max(partition.index, 0), self.keys.partitions
        )

    async def _wait_for_share(
        self, waiting: dict[Keys, list[Chunk]], give_up_at: float, wait_s: float
    ) -> None:
        """Until a stream the ``waiting`` chunks go to has room under its tenant's share (the
        script then decides, entry by entry); past ``give_up_at`` (``wait_s`` after the last
        entry added), TenantBacklogFullError."""
        wanted = {(p, c.tenant) for p, chunks in waiting.items() for c in chunks}
        chosen = list(waiting)
        warned = False
        while True:
            backlogs = dict(zip(chosen, await self.partition_backlogs(chosen), strict=True))
            full: list[str] = []
            for partition, tenant in sorted(wanted, key=lambda w: (w[0].index, w[1] or "")):
                share = self._backlog_share(partition, tenant)
                held = backlogs[partition].tenants.get(tenant, 0)
                if share is None or held < share:
                    return
                full.append(self._said_full(partition, tenant, held, share))
            if time.monotonic() >= give_up_at:
                raise TenantBacklogFullError(
                    "tenant backlog full: "
                    + ", ".join(full)
                    + " (EMBEDFLEET_TENANT_MAX_BACKLOG) "
                    + _waited(wait_s)
                )
            if not warned:
                warned = True
                log.warning(
                    "tenant backlog at its limit: waiting for room",
                    full=full,
                    setting="EMBEDFLEET_TENANT_MAX_BACKLOG",
                )
            await asyncio.sleep(0.5)

    def _said_full(self, partition: Keys, tenant: str | None, held: int, share: int) -> str:
        name = self.tenants.named(tenant)
        if not self.keys.partitioned:
            return f"{name} holds {held} of {share} entries"
        limit = self.tenants.backlog_limit(name)
        return (
            f"{name} holds {held} of its {share} in partition {partition.index} (its limit "
            f"{limit} split over {self.keys.partitions} partitions)"
        )

    async def _send_once(
        self, by_partition: dict[Keys, list[Chunk]], call: EnqueueCall
    ) -> tuple[dict[Keys, list[Chunk]], dict[Keys, _Sent]]:
        """One pipelined round trip (per node, on a cluster, the nodes in parallel): per
        partition, tenant and job (or no job), the enqueue script, whose keys all share the
        partition's slot, adding while the tenant's stream has room under its share of
        EMBEDFLEET_TENANT_MAX_BACKLOG (chunks without a job: no id record, nothing counts
        them; a re-sent one is at worst embedded twice). With EMBEDFLEET_MIN_REPLICAS, WAIT on
        the connection that made each partition's writes, wherever a moving slot sent them
        (producer/confirmed_writes.py). Returns the partitions whose replicas did not confirm
        them (to be sent again), and what became of each partition's chunks."""
        groups: dict[Keys, Group[Keys]] = {}
        scripts_of: dict[Keys, list[tuple[int, list[Chunk]]]] = {}  # command index, chunks
        for partition, chunks in by_partition.items():
            commands: list[tuple[Any, ...]] = []
            by_job: dict[tuple[str | None, str | None], list[Chunk]] = {}
            for named in sorted({c.tenant for c in chunks if c.tenant is not None}):
                # the tenant's stream in the registry, its group made, before its first entry
                commands.append(register_tenant_command(partition, named))
            for chunk in chunks:
                by_job.setdefault((chunk.tenant, chunk.job), []).append(chunk)
            for (owner, job), job_chunks in by_job.items():
                scripts_of.setdefault(partition, []).append((len(commands), job_chunks))
                commands.append(
                    enqueue_script_command(
                        stream=partition.ingest_for(owner),
                        counters=None if job is None else partition.job(job),
                        id_record=None if job is None else partition.job_ids(job),
                        chunks=[(c.id, encode_chunk(c)) for c in job_chunks],
                        id_record_ttl_s=self.settings.job_ids_ttl_s,
                        call=call,
                        limit=self._backlog_share(partition, owner),
                    )
                )
                if job is None:
                    continue
                finished = finished_ttl_command(
                    partition.job(job),
                    self.settings.job_ids_ttl_s,
                    self.settings.job_ids_finished_ttl_s,
                )
                if finished is not None:
                    commands.append(finished)
            jobs = {job for _, job in by_job if job is not None}
            if jobs:
                # Outside the script, but in the partition's slot too (its own jobs index).
                commands.append(("SADD", partition.jobs_index, *jobs))
            groups[partition] = Group(partition.ingest, commands)
        written = await write_confirmed(
            self.client,
            groups,
            self.settings.min_replicas,
            self.settings.min_replicas_timeout_ms,
        )
        sent: dict[Keys, _Sent] = {}
        for partition, replies in written.replies.items():
            outcome = _Sent()
            for index, chunks in scripts_of.get(partition, []):
                reply = replies[index]
                added, again = script_counts(reply)
                handled = script_handled(reply)
                outcome.added += added + again
                outcome.present += handled - added - again
                outcome.refused += chunks[handled:]
            sent[partition] = outcome
        return {partition: by_partition[partition] for partition in written.unconfirmed}, sent

    # --- priority queries -------------------------------------------------------------
    async def embed_query(
        self,
        text: str,
        *,
        timeout: float = 10.0,
        options: EmbeddingOptions | None = None,
        model: str | None = None,
    ) -> np.ndarray:
        """Embed one query through the priority lane: a float32 vector (the model's dimension,
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

        The worker pushes each answer onto a reply list this call blocks on (BLPOP: no
        polling). On timeout the queries are withdrawn from the stream and the reply key is
        deleted, so nothing is left behind; a late answer would expire with the key's TTL.

        Redis away (restart, failover, dropped connection) is waited out within ``timeout``;
        after a reconnection the unanswered queries are sent again under the same request id
        (a server that lost them would never answer), so a query may be embedded twice: the
        answers are kept one per index and a spare one expires with the reply key.

        ``model``: the model to ask (``for_model``), else this producer's.
        """
        if model is not None:
            lane = await self.for_model(model, deadline=time.monotonic() + timeout)
            return await lane.embed_queries(texts, timeout=timeout, options=options)
        return await self._request(self.keys.query_lane.query, "queries", texts, timeout, options)

    async def embed_texts(
        self,
        texts: Sequence[str],
        *,
        options: EmbeddingOptions | None = None,
        timeout: float = 60.0,
        model: str | None = None,
    ) -> np.ndarray:
        """Embed many texts for someone waiting, ahead of any bulk backlog; shape
        (len(texts), dim).

        The texts go to the interactive stream (``Keys.interactive``), which workers read
        before every ingest stream, in bulk-sized batches: a request of a thousand texts waits
        for the windows a worker already holds, not for the backlog, and does not slow the
        query stream's few-input answers. The model's ``document`` prompt applies unless
        ``options`` names one. Timeouts, withdrawal and Redis faults as ``embed_queries``;
        ``model`` too.
        """
        if model is not None:
            lane = await self.for_model(model, deadline=time.monotonic() + timeout)
            return await lane.embed_texts(texts, options=options, timeout=timeout)
        return await self._request(
            self.keys.query_lane.interactive, "texts", texts, timeout, options
        )

    async def embed_sparse(
        self,
        texts: Sequence[str],
        *,
        timeout: float = 10.0,
        max_active_dims: int | None = None,
        lane: Literal["query", "texts"] = "query",
    ) -> list[SparseVector]:
        """Sparse (SPLADE) weights of ``texts`` from a fleet serving a SparseEncoder, as
        ``SparseEncoder.encode`` gives them (``max_active_dims``: only the largest that many
        per text). ``lane``: the query stream (few, short texts) or the interactive one.
        Timeouts and Redis faults as :meth:`embed_queries`."""
        stream = self.keys.query_lane.query if lane == "query" else self.keys.query_lane.interactive
        extra = {"representations": ("sparse",), "max_active_dims": max_active_dims}
        answers = await self._answers(stream, lane, texts, timeout, None, extra=extra)
        vectors = [answers.results[index].sparse for index in range(len(texts))]
        if any(vector is None for vector in vectors):
            raise ValueError("the workers answered without sparse weights")
        return [vector for vector in vectors if vector is not None]

    async def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        timeout: float = 10.0,
        lane: Literal["query", "texts"] = "query",
    ) -> np.ndarray:
        """Scores of (``query``, document) for each document, in the documents' order, from a
        fleet serving a cross-encoder: ``CrossEncoder.predict``'s values. Sort them to rank.
        A thousand documents belong on ``lane="texts"`` (bulk-sized batches)."""
        stream = self.keys.query_lane.query if lane == "query" else self.keys.query_lane.interactive
        answers = await self._answers(
            stream, "pairs", [query] * len(documents), timeout, None, pairs=documents
        )
        return np.array(
            [answers.results[index].score for index in range(len(documents))], dtype=np.float32
        )

    async def score_pairs(
        self,
        pairs: Sequence[tuple[str, str]],
        *,
        timeout: float = 10.0,
        lane: Literal["query", "texts"] = "query",
    ) -> np.ndarray:
        """Every label's score of each (text, text) pair from a cross-encoder fleet, shape
        (len(pairs), labels): ``CrossEncoder.predict``'s values (one column for a reranker)."""
        stream = self.keys.query_lane.query if lane == "query" else self.keys.query_lane.interactive
        answers = await self._answers(
            stream, "pairs", [a for a, _ in pairs], timeout, None, pairs=[b for _, b in pairs]
        )
        return np.stack(
            [np.asarray(answers.results[i].vector, np.float32) for i in range(len(pairs))]
        )

    async def embed_representations(
        self,
        texts: Sequence[str],
        representations: Sequence[str],
        *,
        timeout: float = 10.0,
        lane: Literal["query", "texts"] = "query",
        options: EmbeddingOptions | None = None,
        max_active_dims: int | None = None,
        multivector_dtype: str | None = None,
    ) -> list[Result]:
        """Several representations of each text from one forward pass of a model that gives
        them (BGE-M3: ``dense``, ``sparse``, ``multivector``): each text's Result, in order,
        with ``vector`` (dense), ``sparse`` and ``multivector`` (per-token vectors, float16 or
        ``multivector_dtype="int8"`` on the wire) filled as asked. ``lane`` and timeouts as
        :meth:`embed_sparse`; ``options`` shape the dense vector as :meth:`embed_queries`."""
        stream = self.keys.query_lane.query if lane == "query" else self.keys.query_lane.interactive
        extra = {
            "representations": tuple(representations),
            "max_active_dims": max_active_dims,
            "multivector_dtype": multivector_dtype,
        }
        answers = await self._answers(stream, lane, texts, timeout, options, extra=extra)
        return [answers.results[index] for index in range(len(texts))]

    async def _request(
        self,
        stream: str,
        what: str,
        texts: Sequence[str],
        timeout: float,
        options: EmbeddingOptions | None,
    ) -> np.ndarray:
        """Send ``texts`` to ``stream`` under one request id and collect their answers from the
        request's reply list (producer/replies.py), withdrawing them if they come too late."""
        return (await self._answers(stream, what, texts, timeout, options)).array()

    async def _answers(
        self,
        stream: str,
        what: str,
        texts: Sequence[str],
        timeout: float,
        options: EmbeddingOptions | None,
        *,
        pairs: Sequence[str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Answers:
        """:meth:`_request`'s answers, whole (each input's Result); ``pairs``: each text's
        document for a cross-encoder; ``extra``: Chunk fields every input gets."""
        if pairs is not None and len(pairs) != len(texts):
            raise ValueError("one document per query: pairs and texts differ in length")
        if not texts:
            raise ValueError(f"embedding {what} needs at least one text")
        if any(not isinstance(t, str) for t in texts):
            raise ValueError(f"every one of the {what} must be a string")
        if not timeout > 0:  # BLPOP with timeout 0 would wait forever
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout}")
        give_up_at = time.monotonic() + timeout
        request = uuid.uuid4().hex
        reply_key = self.keys.query_lane.reply(request)
        deadline_ms = int((time.time() + timeout) * 1000)
        answers = Answers(len(texts))
        entry_ids: list[bytes] = []
        tries = self.retry.attempts(f"embed {what}", deadline=give_up_at)
        send = True  # at first, and again after a fault: the server may have lost them
        try:
            await self.setup(deadline=give_up_at)
            payloads: list[bytes] = []
            for index, text in enumerate(texts):
                # the worker's own checks, with the configured limits, before anything is sent
                chunk = as_chunk(
                    Chunk(
                        id=f"{request}:{index}",
                        text=text,
                        reply=request,
                        deadline_ms=deadline_ms,
                        pair=pairs[index] if pairs is not None else None,
                        # accounted to the producer's tenant (the query lane has no shares)
                        tenant=None if self.tenant is None else self.tenants.wire(self.tenant),
                        **(extra or {}),
                    ),
                    None,
                    options,
                    self.settings.chunk_limits,
                )
                if options is not None or pairs is not None or extra:
                    chunk = await self._checked(chunk, deadline=give_up_at)
                payloads.append(encode_chunk(chunk))
            while not answers.complete:
                remaining = give_up_at - time.monotonic()
                if remaining <= 0.01:  # BLPOP's timeout 0 would wait for ever
                    break
                # one BLPOP waits at most EMBEDFLEET_BLOCK_MS (the connection's read timeout is
                # sized for it); the round trip as a whole is bounded by the deadline, so a hung
                # Redis is given up on there (a TimeoutError: transient, then past the deadline)
                blocking = min(remaining, self.settings.block_ms / 1000)
                try:
                    async with asyncio.timeout(remaining + REPLY_MARGIN_S):
                        if send:
                            unanswered = answers.unanswered()
                            sent, popped = await self._send_request(
                                stream, [payloads[i] for i in unanswered], reply_key, blocking
                            )
                            entry_ids += sent
                            send = False
                        else:
                            popped = await pop_answers(self.client, reply_key, blocking)
                except Exception as error:
                    send = True
                    await tries.failed(error)
                    continue
                tries.succeeded()
                for payload in popped:
                    failure = answers.take(payload)
                    if failure is not None:
                        raise failure  # the worker's reason for a bad input
        except RedisUnavailableError as error:
            raise QueryTimeoutError(
                f"no answer within {timeout}s for {answers.missing} of {len(texts)} {what}: {error}"
            ) from error
        finally:
            if not answers.complete or answers.failures:
                await self._withdraw(stream, entry_ids, reply_key)
        if not answers.complete:
            raise QueryTimeoutError(
                f"no answer within {timeout}s for {answers.missing} of {len(texts)} "
                f"{what}. Are workers running? Check: redis-cli XINFO GROUPS {stream}"
            )
        return answers

    async def _send_request(
        self, stream: str, payloads: list[bytes], reply_key: str, timeout: float
    ) -> tuple[list[bytes], list[bytes]]:
        """The XADDs and the first BLPOP in one round trip: one round trip for a single query."""
        pipe = self.client.pipeline(transaction=False)
        for payload in payloads:
            pipe.xadd(stream, {PAYLOAD_FIELD: payload})
        pipe.blpop([reply_key], timeout=timeout)
        *entry_ids, popped = await pipe.execute()
        return entry_ids, [] if popped is None else [popped[1]]

    async def _withdraw(self, stream: str, entry_ids: list[bytes], reply_key: str) -> None:
        """Take an unanswered request's entries back, once, within
        EMBEDFLEET_REDIS_CLEANUP_TIMEOUT_S: if Redis is away or hung, the workers skip them
        anyway (they are past their deadline) and the reply key expires. An entry a worker has
        already read is answered onto the deleted key, which then expires."""
        pipe = self.client.pipeline(transaction=True)  # the query lane's keys share a slot
        if entry_ids:
            pipe.xdel(stream, *entry_ids)
        pipe.delete(reply_key)
        try:
            # bounded: the caller's timeout (or cancellation) must hold with Redis hung
            async with asyncio.timeout(self.settings.redis_cleanup_timeout_s):
                await pipe.execute()
        except Exception as error:
            if not is_transient(error):
                raise
            log.info("could not withdraw queries: redis unavailable", error=describe(error))

    def results_reader(self, *, consumer: str | None = None, page: int = 1000) -> ResultsReader:
        """A consuming reader of the results streams, page by page (``next_page`` /
        ``acknowledge``), for callers that acknowledge only once a page is stored."""
        return ResultsReader(
            self.client,
            self.keys,
            self.retry,
            consumer=consumer,
            page=page,
            claim_idle_ms=self.settings.results_claim_idle_ms,
        )

    # --- jobs ---------------------------------------------------------------------------
    async def progress(
        self, job: str, *, deadline: float | None = None, model: str | None = None
    ) -> JobProgress:
        """The job's counters, summed over the partitions (each counts its own chunks); of
        ``model``'s lane when named (a job's counters live in its model's keys)."""
        if model is not None:
            lane = await self.for_model(model, deadline=deadline)
            if lane is not self:
                return await lane.progress(job, deadline=deadline)
        elif not self._routed:
            await self.setup(deadline=deadline)

        async def read() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for partition in self.keys.partitions_keys:
                pipe.hgetall(partition.job(job))
            return await pipe.execute()

        counters = await self.retry.call(f"read job {job!r}'s progress", read, deadline=deadline)
        return JobProgress.summed(job, counters)

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
        a job enqueued for that model).

        ``interval`` is the longest wait between two reads of the job's counters; as the job
        nears its end (by its rate so far) the reads come sooner, down to 10 ms, so that the
        end is seen promptly without polling fast all along (producer/polling.py).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        pacer = PollPacer(longest=interval)
        while True:
            try:
                progress = await self.progress(job, deadline=deadline, model=model)
            except RedisUnavailableError as error:
                if deadline is None or time.monotonic() < deadline:
                    raise  # EMBEDFLEET_REDIS_RETRY_S passed first
                raise JobTimeoutError(
                    f"job {job!r} not finished after {timeout}s: {error}"
                ) from error
            if on_progress is not None:
                on_progress(progress)
            if progress.finished:
                return progress
            if deadline is not None and time.monotonic() > deadline:
                raise JobTimeoutError(
                    f"job {job!r} not finished after {timeout}s: {progress.done} done, "
                    f"{progress.dead} dead of {progress.enqueued}. Are workers running? "
                    "Check with: embedfleet status"
                )
            await asyncio.sleep(
                pacer.delay(time.monotonic(), progress.done + progress.dead, progress.enqueued)
            )

    async def results(
        self,
        *,
        job: str | None = None,
        page: int = 1000,
        consume: bool = False,
        consumer: str | None = None,
    ) -> AsyncIterator[Result]:
        """Every result in the results streams (optionally one job's), oldest first within each
        partition, one partition after the other.

        A chunk enqueued twice (a changed text, a re-sent chunk without a job) has its id
        written twice; callers that need one vector per id keep the last (a chunk id always
        routes to the same partition, so its copies are in one stream).

        ``consume``: drain the streams instead of only reading them (producer/results_reader.py):
        each page is acknowledged and deleted once the loop asks for the next one, several
        readers share the work, and results a crashed reader held are claimed after
        EMBEDFLEET_RESULTS_CLAIM_IDLE_MS. Ends when nothing is left on the streams or pending.
        A consuming read takes every job's results (``job`` must be None); ``consumer`` names
        this reader in the group (default: host, pid and a random suffix).
        """
        if not self._routed:
            await self.setup()
        if consume:
            if job is not None:
                raise ValueError(
                    "a consuming read takes every job's results: filter them yourself, or read "
                    "one job without consuming"
                )
            reader = self.results_reader(consumer=consumer, page=page)
            try:
                async for result in reader.consume():
                    yield result
            finally:
                await reader.close()
            return
        for partition in self.keys.partitions_keys:
            start = "-"
            while True:

                async def read_page(start: str = start, key: str = partition.results) -> object:
                    return await self.client.xrange(key, min=start, count=page)

                # Paged by entry id, so a page read again after a fault is the same page.
                entries = stream_entries(await self.retry.call("read results", read_page))
                if not entries:
                    break
                for _, fields in entries:
                    result = decode_result(fields[PAYLOAD_FIELD])
                    if job is None or result.job == job:
                        yield result
                start = "(" + entries[-1][0].decode()
                if len(entries) < page:
                    break
