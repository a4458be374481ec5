"""Writing entries to the dead-letter stream: with a reason code, acknowledged, never dropped.

Each dead letter keeps the entry's whole payload when it fits
``EMBEDFLEET_DEAD_PAYLOAD_MAX_BYTES``, so ``embedfleet dead replay`` can put it back once its
cause is fixed (shared/dead_letters.py describes the fields).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from embedfleet.shared.dead_letters import DeadReason, dead_letter_fields
from embedfleet.shared.keys import Keys
from embedfleet.shared.logging import get_logger
from embedfleet.shared.protocol import Chunk, encode_chunk, encode_query_error
from embedfleet.sinks import Delivery
from embedfleet.sinks.reply import queue_replies
from embedfleet.workers.events import WorkerEvents

log = get_logger("embedfleet.worker")


@dataclass(frozen=True)
class Rejected:
    """One entry that will not be embedded: the reason code, and the detail for a person.

    Its fields are its dead letter's (``dead_letter``), but for ``reply`` and ``tenant``, which
    its error answer and its accounting use.
    """

    stream: str
    entry_id: str
    reason: DeadReason
    detail: str
    payload: bytes | None = None
    chunk_id: str | None = None
    job: str | None = None
    reply: str | None = None
    deliveries: int = 1
    tenant: str | None = None  # the chunk's, where its payload says (accounting)

    @classmethod
    def chunk(cls, delivery: Delivery, chunk: Chunk, reason: DeadReason, detail: str) -> Rejected:
        """A decoded chunk refused later (model, sink): its payload is the chunk re-encoded,
        which decodes to the same chunk, so a replay sends exactly what was sent."""
        return cls(
            delivery.stream,
            delivery.entry_id,
            reason,
            detail,
            payload=encode_chunk(chunk),
            chunk_id=chunk.id,
            job=chunk.job,
            reply=chunk.reply,
            tenant=chunk.tenant,
        )

    def dead_letter(self, max_payload_bytes: int) -> dict[str, str | bytes]:
        """This entry's fields in the dead-letter stream (shared/dead_letters.py)."""
        return dead_letter_fields(
            reason=self.reason,
            detail=self.detail,
            stream=self.stream,
            entry_id=self.entry_id,
            payload=self.payload,
            max_payload_bytes=max_payload_bytes,
            chunk_id=self.chunk_id,
            job=self.job,
            deliveries=self.deliveries,
        )


def _error_answer(item: Rejected) -> tuple[str, bytes]:
    """The reply list (its key's suffix) and the error ``item`` answers its caller with; ("",
    b"") when nobody waits for it (a payload without a reply list would go to the results)."""
    if not item.reply or item.chunk_id is None:
        return "", b""
    return item.reply, encode_query_error(item.chunk_id, item.detail)


@dataclass(eq=False)
class DeadLetters:
    client: aioredis.Redis
    keys: Keys
    events: WorkerEvents
    reply_ttl_s: int
    max_payload_bytes: int
    # ingest chunks with a reply (gateway jobs) keep their list as long as their results
    job_reply_ttl_s: int | None = None
    # the worker's model name, which its dead letters are accounted under (set once loaded)
    model: str = ""

    def __post_init__(self) -> None:
        self.job_reply_ttl_s = self.job_reply_ttl_s or self.reply_ttl_s

    async def _send(self, keys: Keys, rejected: Sequence[Rejected]) -> None:
        job_reply_ttl_s = self.job_reply_ttl_s
        assert job_reply_ttl_s is not None  # defaulted to reply_ttl_s in __post_init__
        pipe = self.client.pipeline(transaction=True)
        for item in rejected:
            pipe.xadd(
                keys.dead,
                # redis-py types `fields` as Dict[FieldT, EncodableT]: dict is invariant, so no
                # dict[str, str | bytes] matches, although it is what XADD takes
                item.dead_letter(self.max_payload_bytes),  # type: ignore[arg-type]
            )
        # The error answer goes with the acknowledgement, in its script (the one writer of
        # answers): pushed only for entries this call acknowledged. An entry withdrawn under
        # the worker (an ended batch, a request that timed out: acknowledged and deleted by the
        # gateway) or finished by another worker gets none, so its reply list is not made
        # again, to live for a reply TTL with nobody to read it. Per reply lifetime: the query
        # stream's replies are read at once, ingest replies (gateway jobs) as their results.
        by_ttl: dict[int, list[Rejected]] = {}
        for item in rejected:
            ingest = item.stream != self.keys.priority_streams.query
            by_ttl.setdefault(job_reply_ttl_s if ingest else self.reply_ttl_s, []).append(item)
        for ttl_s, items in by_ttl.items():
            deliveries = [
                Delivery(item.stream, item.entry_id, item.job, tenant=item.tenant, model=self.model)
                for item in items
            ]
            replies, payloads = zip(*(_error_answer(item) for item in items), strict=True)
            queue_replies(pipe, keys, deliveries, replies, payloads, "dead", ttl_s)
        await pipe.execute()

    async def send(self, rejected: Sequence[Rejected]) -> None:
        """XADD each to its partition's dead stream and XACK + XDEL its entry, in one MULTI/EXEC
        per partition.

        A rejected query also answers its caller with the reason, so nobody waits for a
        timeout to learn that their text was empty: in the acknowledgement's script, only if it
        acknowledged the entry (one withdrawn meanwhile has nobody waiting for it).
        """
        if not rejected:
            return
        by_owner: dict[Keys, list[Rejected]] = {}
        for item in rejected:
            by_owner.setdefault(self.keys.owner_of(item.stream), []).append(item)
        # One MULTI per partition: a cluster runs a transaction only within one slot.
        for owner, items in by_owner.items():
            await self._send(owner, items)
        for item in rejected:
            log.warning(
                "dead-lettered",
                stream=item.stream,
                entry_id=item.entry_id,
                id=item.chunk_id,
                reason=item.reason.value,
                detail=item.detail,
            )
        for reason, count in Counter(item.reason for item in rejected).items():
            self.events.dead_lettered(count=count, reason=reason.value)
