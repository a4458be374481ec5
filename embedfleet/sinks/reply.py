"""Results that go back to whoever asked: the gateway's reply lists, not the vector sink.

A chunk of the interactive or an ingest stream that carries ``reply`` was sent by someone
waiting for its vector (``Producer.embed_texts``, the HTTP gateway's large requests and Batch
API batches). Its result is pushed onto that caller's reply list instead
of the configured sink: a gateway request must not write rows into the user's vector database,
and the gateway must get vectors back whichever sink the fleet writes to.

Like the results stream, the push happens in the same script as the acknowledgement and only for
entries this call really acknowledged, so a redelivered entry is never answered twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis
import redis.asyncio as aioredis

from embedfleet.shared.keys import Keys
from embedfleet.shared.protocol import Result, encode_result
from embedfleet.sinks.sink import (
    Delivery,
    acknowledgement_pipeline,
    queue_acknowledgement_script,
)


def queue_replies(
    pipe: aioredis.client.Pipeline | redis.client.Pipeline,
    keys: Keys,
    deliveries: Sequence[Delivery],
    replies: Sequence[str],
    payloads: Sequence[bytes],
    counter: str,
    ttl_s: int,
) -> None:
    """Acknowledge ``deliveries`` and push each payload to its reply list, in one script call
    per stream; the job counter ``counter`` counts only what was acknowledged here. The one
    writer of answers: the bulk path's (``ReplyListWriter``) and the query stage's, from the
    model thread on a blocking pipeline.

    Job counters and reply lists are those of the stream's own key set (its partition's, or
    the priority streams' for the interactive stream), in the stream's slot, which is where the
    collector (producer/replies.py) looks for them."""
    queue_acknowledgement_script(pipe, keys, deliveries, counter, replies, payloads, ttl_s)


class ReplyListWriter:
    """Writes results of chunks with a ``reply`` to their reply lists, acknowledging them."""

    def __init__(self, client: aioredis.Redis, keys: Keys, ttl_s: int) -> None:
        self.client = client
        self.keys = keys
        self.ttl_s = ttl_s

    async def write(
        self, results: Sequence[Result], deliveries: Sequence[Delivery], replies: Sequence[str]
    ) -> None:
        pipe = acknowledgement_pipeline(self.client, self.keys)
        payloads = [encode_result(result) for result in results]
        queue_replies(pipe, self.keys, deliveries, replies, payloads, "done", self.ttl_s)
        await pipe.execute()
