"""workers/dead_letter_writer.py against a real Redis: a rejected entry is written to the dead
stream with its reason, detail and whole payload, acknowledged and deleted; a caller waiting on
a reply list is answered with the reason; a payload over the limit keeps a prefix."""

from __future__ import annotations

import msgpack
import redis.asyncio as aioredis

from embedfleet.shared.dead_letters import DeadLetter, DeadReason
from embedfleet.shared.keys import Keys
from embedfleet.shared.protocol import PAYLOAD_FIELD, Chunk, decode_chunk, encode_chunk
from embedfleet.shared.settings import Settings
from embedfleet.sinks import Delivery
from embedfleet.workers.consumer import StreamConsumer, StreamEntry
from embedfleet.workers.dead_letter_writer import DeadLetters, Rejected
from embedfleet.workers.events import WorkerEvents


class Counted(WorkerEvents):
    def __init__(self) -> None:
        self.dead: list[tuple[int, str]] = []

    def dead_lettered(self, *, count: int, reason: str) -> None:
        self.dead.append((count, reason))


def test_a_refused_chunks_payload_decodes_to_the_same_chunk() -> None:
    chunk = Chunk(id="c1", text="hello", job="j", reply="r", tenant="acme")
    rejected = Rejected.chunk(Delivery("ingest", "1-0", "j"), chunk, DeadReason.MODEL, "NaN")
    assert rejected.payload is not None and decode_chunk(rejected.payload) == chunk
    assert (rejected.chunk_id, rejected.job, rejected.reply, rejected.tenant) == (
        "c1",
        "j",
        "r",
        "acme",
    )


async def held(client: aioredis.Redis, keys: Keys, *payloads: bytes) -> list[StreamEntry]:
    """``payloads`` added to the ingest stream and read by a consumer: pending, as a worker that
    is about to dead-letter them holds them."""
    consumer = StreamConsumer(client, keys, "reader")
    await consumer.setup()
    for payload in payloads:
        await client.xadd(keys.ingest, {PAYLOAD_FIELD: payload})
    entries = await consumer.read_ingest(10, block_ms=10)
    await consumer.finish_waiting()
    return entries


async def test_rejected_entries_are_dead_lettered_acknowledged_and_answered(
    settings: Settings, client: aioredis.Redis
) -> None:
    keys = settings.keys
    answered = Chunk(id="waited", text="x", reply="r1")
    first, second = await held(client, keys, encode_chunk(answered), b"y" * 64)
    events = Counted()
    writer = DeadLetters(client, keys, events, reply_ttl_s=60, max_payload_bytes=32)
    await writer.send(
        [
            Rejected.chunk(
                Delivery(first.stream, first.entry_id, None), answered, DeadReason.OPTIONS, "dim"
            ),
            Rejected(second.stream, second.entry_id, DeadReason.NOT_MSGPACK, "bad", b"y" * 64),
        ]
    )
    dead = [DeadLetter.from_fields(i, f) for i, f in await client.xrange(keys.dead)]
    assert [(d.reason, d.detail, d.entry_id) for d in dead] == [
        (DeadReason.OPTIONS, "dim", first.entry_id),
        (DeadReason.NOT_MSGPACK, "bad", second.entry_id),
    ]
    assert dead[0].replayable and decode_chunk(dead[0].payload or b"") == answered
    assert not dead[1].replayable and dead[1].payload_prefix and dead[1].payload_bytes == 64
    assert await client.xlen(keys.ingest) == 0, "acknowledged and deleted"
    (answer,) = await client.lrange(keys.reply("r1"), 0, -1)
    assert msgpack.unpackb(answer)["error"] == "dim"
    assert await client.ttl(keys.reply("r1")) > 0
    assert sorted(events.dead) == [(1, "not_msgpack"), (1, "options")]
