"""Writing entries to the dead-letter stream: with a reason, acknowledged, never dropped."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
from embedfleet.shared.keys import Keys
from embedfleet.shared.logging import get_logger
from embedfleet.shared.protocol import dead_letter_fields, encode_query_error
from embedfleet.workers.events import WorkerEvents
from embedfleet.workers.sinks import Delivery, queue_acknowledgements

log = get_logger("embedfleet.worker")


@dataclass(frozen=True)
class Rejected:
    """One entry that will not be embedded, and why."""

    stream: str
    entry_id: str
    reason: str
    payload: bytes | None = None
    chunk_id: str | None = None
    job: str | None = None
    reply: str | None = None
    deliveries: int = 1


class DeadLetters:
    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        events: WorkerEvents,
        reply_ttl_s: int,
        job_reply_ttl_s: int | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.events = events
        self.reply_ttl_s = reply_ttl_s
        # ingest chunks with a reply (gateway jobs) keep their list as long as their results
        self.job_reply_ttl_s = job_reply_ttl_s or reply_ttl_s

    async def _send(self, keys: Keys, rejected: Sequence[Rejected]) -> None:
        pipe = self.client.pipeline(transaction=True)
        for item in rejected:
            pipe.xadd(
                keys.dead,
                dead_letter_fields(
                    reason=item.reason,
                    stream=item.stream,
                    entry_id=item.entry_id,
                    payload=item.payload,
                    chunk_id=item.chunk_id,
                    job=item.job,
                    deliveries=item.deliveries,
                ),
            )
            if item.reply is not None and item.chunk_id is not None:
                reply_key = keys.reply(item.reply)
                pipe.rpush(reply_key, encode_query_error(item.chunk_id, item.reason))
                ingest = item.stream != self.keys.query_lane.query
                pipe.expire(reply_key, self.job_reply_ttl_s if ingest else self.reply_ttl_s)
        deliveries = [Delivery(item.stream, item.entry_id, item.job) for item in rejected]
        queue_acknowledgements(pipe, keys, deliveries, counter="dead")
        await pipe.execute()

    async def send(self, rejected: Sequence[Rejected]) -> None:
        """XADD each to its partition's dead stream and XACK + XDEL its entry, in one MULTI/EXEC
        per partition.

        A rejected query also answers its caller with the reason, so nobody waits for a
        timeout to learn that their text was empty.
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
                reason=item.reason,
            )
        for reason, count in Counter(item.reason for item in rejected).items():
            self.events.dead_lettered(count=count, reason=reason)
