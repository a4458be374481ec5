"""Enqueueing: the chunks of an enqueue call checked, stamped and sent in batches.

Each chunk is built and checked (producer/chunks.py, the model card where a worker published
one), given its tenant and ``reembed`` mark, and sent ``batch_size`` at a time: each batch after
the backlog waits (producer/backlog_waits.py), in rounds (producer/partition_writes.py) until
every chunk of it was added, found in its job already, or no room came for it in time.

A job remembers its chunk ids for EMBEDFLEET_JOB_IDS_TTL_S after its latest enqueue
(producer/enqueue.py): enqueueing them again adds nothing, unless ``force`` (after their vectors
were lost, say a wiped table); a batch re-sent after a fault still adds each chunk once.

``reembed`` marks every chunk ``reembed`` (the protocol field): the workers run the model for it
even where their vector cache holds its vector (``force`` is another thing: it re-sends ids the
job already has, which the cache may then answer).

``options`` (prompt, dimensions, dtype) apply to every chunk that has none of its own. A
malformed option, or one the served model cannot honour (when a worker has published it),
raises ValueError before anything is sent for that chunk.

``tenant`` (else the producer's, else the tenant map's for the job, else the default; a chunk
that names its own keeps it) goes to its own ingest streams, read by weight
(EMBEDFLEET_TENANT_WEIGHTS). A tenant with EMBEDFLEET_TENANT_MAX_BACKLOG never holds more: the
enqueue script adds entry by entry while there is room (each partition its share of the limit),
and the call waits for room for the rest, giving up after EMBEDFLEET_TENANT_BACKLOG_WAIT_S
without room with TenantBacklogFullError, whose ``added`` is what this call added before.
``backlog_wait_s`` waits that long instead; 0 not at all: the call adds while there is room,
then raises (the gateway's batch runner, which serves other batches meanwhile and sends the rest
from the error's ``handled`` on a later turn).

Entries are never trimmed on add: an undelivered chunk must not be lost. Workers delete entries
once they are acknowledged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator

from embedfleet.producer.backlog_waits import BacklogWaits, TenantBacklogFullError
from embedfleet.producer.chunks import ChunkLike, EmbeddingOptions, as_chunk
from embedfleet.producer.enqueue import EnqueueCall, Enqueued
from embedfleet.producer.lane import ProducerLane
from embedfleet.producer.partition_writes import PartitionWrites
from embedfleet.producer.token_ids import TokenIdMaker
from embedfleet.shared.keys import Keys
from embedfleet.shared.logging import get_logger
from embedfleet.shared.protocol import Chunk

log = get_logger("embedfleet.producer")
# a batch is sent once its images hold this many bytes, whatever its count: a batch is held in
# memory and pipelined to Redis whole, and images run to EMBEDFLEET_MAX_IMAGE_BYTES each
BATCH_IMAGE_BYTES = 96 << 20


class Enqueuer:
    """``Producer.enqueue`` on one lane (the model routed by the facade)."""

    def __init__(self, lane: ProducerLane, waits: BacklogWaits) -> None:
        self.lane = lane
        self.waits = waits
        self.writes = PartitionWrites(lane, waits)

    async def enqueue(
        self,
        chunks: Iterable[ChunkLike],
        *,
        job: str | None,
        batch_size: int,
        on_batch: Callable[[int], None] | None,
        options: EmbeddingOptions | None,
        force: bool,
        tenant: str | None,
        reembed: bool,
        backlog_wait_s: float | None,
        token_ids: bool | None = None,
    ) -> Enqueued:
        """XADD every chunk, ``batch_size`` (or ``BATCH_IMAGE_BYTES`` of images) per pipelined
        round trip; returns how many were added (an ``Enqueued``: an int, with ``present``, the
        chunks skipped because their job already had them with the same payload, and ``chunks``,
        all of them). ``force``, ``reembed``, ``options``, ``tenant`` and ``backlog_wait_s``: the
        module's docstring."""
        lane = self.lane
        await lane.setup()
        settings = lane.settings
        wait_s = settings.tenant_backlog_wait_s if backlog_wait_s is None else backlog_wait_s
        call = EnqueueCall(force=force)
        total = Enqueued()
        batch: list[Chunk] = []
        held = 0  # the batch's image bytes
        # the producer's token ids (producer/token_ids.py): made per batch off the event loop
        with_ids = settings.producer_token_ids if token_ids is None else token_ids
        maker = await lane.token_id_maker() if with_ids else None
        for chunk in self._stamped(chunks, job, options, tenant, reembed):
            batch.append(await lane.checked(chunk))
            held += len(chunk.image) if chunk.image is not None else 0
            if len(batch) >= batch_size or held >= BATCH_IMAGE_BYTES:
                total += await self._send(
                    await _with_ids(maker, batch), on_batch, call, wait_s, total
                )
                batch, held = [], 0
        if batch:
            total += await self._send(await _with_ids(maker, batch), on_batch, call, wait_s, total)
        if total.present:
            log.info(
                "chunks already enqueued in their job were not added again",
                present=total.present,
                added=int(total),
                override="force=True (embedfleet enqueue --force) adds them again",
            )
        return total

    def _stamped(
        self,
        chunks: Iterable[ChunkLike],
        job: str | None,
        options: EmbeddingOptions | None,
        tenant: str | None,
        reembed: bool,
    ) -> Iterator[Chunk]:
        """Each chunk built and checked against the configured limits, with its tenant on the
        wire (the default tenant's as none: its streams are the unnamed ones) and ``reembed``."""
        tenants = self.lane.tenants
        named = tenant if tenant is not None else self.lane.tenant
        by_job: dict[str | None, str | None] = {}
        for item in chunks:
            chunk = as_chunk(item, job, options, self.lane.settings.chunk_limits)
            if chunk.tenant is None:
                if chunk.job not in by_job:
                    by_job[chunk.job] = tenants.wire(tenants.resolve(named, job=chunk.job))
                if by_job[chunk.job] is not None:
                    chunk = dataclasses.replace(chunk, tenant=by_job[chunk.job])
            elif chunk.tenant == tenants.default:
                chunk = dataclasses.replace(chunk, tenant=None)
            if reembed and not chunk.reembed:
                chunk = dataclasses.replace(chunk, reembed=True)
            yield chunk

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
            by_partition.setdefault(self.lane.keys.partition_for(chunk.id), []).append(chunk)
        added, present = 0, 0
        waiting = by_partition
        try:
            await self.waits.wait_for_tenants({chunk.tenant for chunk in batch}, wait_s)
            await self.waits.wait_for_room(by_partition, {chunk.tenant for chunk in batch})
            give_up_at = time.monotonic() + wait_s
            while True:
                sent = await self.writes.send_round(waiting, call, len(batch))
                added += sum(s.added for s in sent.values())
                present += sum(s.present for s in sent.values())
                if on_batch is not None:
                    on_batch(sum(len(waiting[p]) - len(s.refused) for p, s in sent.items()))
                waiting = {p: s.refused for p, s in sent.items() if s.refused}
                if not waiting:
                    break
                if any(s.added for s in sent.values()):  # room came: each entry waits anew
                    give_up_at = time.monotonic() + wait_s
                await self.waits.wait_for_share(waiting, give_up_at, wait_s)
        except TenantBacklogFullError as error:
            error.added = (earlier or Enqueued()) + Enqueued(added, present)
            # every chunk of the earlier batches was dealt with (their added and present),
            # and this batch's up to the first one still waiting
            unsent = {id(chunk) for chunks in waiting.values() for chunk in chunks}
            first_unsent = next((i for i, c in enumerate(batch) if id(c) in unsent), len(batch))
            error.handled = (earlier.chunks if earlier is not None else 0) + first_unsent
            raise
        return Enqueued(added, present)


async def _with_ids(maker: TokenIdMaker | None, batch: list[Chunk]) -> list[Chunk]:
    """The batch with its token ids where ``maker`` makes them (a thread: tokenizing grows with
    the batch and must not hold the event loop)."""
    if maker is None:
        return batch
    return await asyncio.to_thread(maker.attach, batch)
