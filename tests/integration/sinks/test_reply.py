"""Answers to their reply lists (embedfleet/sinks/reply.py) on a real Redis server: each result
pushed to its own list, its entry acknowledged and counted once, a second write of the same
delivery (a redelivered entry) pushing nothing."""

from __future__ import annotations

import numpy as np
import redis.asyncio as aioredis

from embedfleet.shared.protocol import Result, decode_result
from embedfleet.shared.settings import Settings
from embedfleet.sinks.reply import ReplyListWriter
from embedfleet.sinks.sink import Delivery


async def test_each_answer_goes_to_its_reply_list_once(
    settings: Settings, client: aioredis.Redis
) -> None:
    keys = settings.keys
    stream = keys.ingest
    await client.xgroup_create(stream, keys.group, id="0", mkstream=True)
    ids = [await client.xadd(stream, {"c": str(n)}) for n in range(2)]
    await client.xreadgroup(keys.group, "w1", {stream: ">"})
    deliveries = [Delivery(stream, entry.decode(), "job-1") for entry in ids]
    results = [
        Result(id=f"r:{n}", model="m", vector=np.array([n, 1], dtype=np.float16)) for n in range(2)
    ]
    replies = ["req-a", "req-b"]  # the chunks' reply names: lists under the key set's prefix
    writer = ReplyListWriter(client, keys, ttl_s=60)
    await writer.write(results, deliveries, replies)
    await writer.write(results, deliveries, replies)  # redelivered: already acknowledged
    for n, reply in enumerate(replies):
        payloads = await client.lrange(keys.reply(reply), 0, -1)
        assert len(payloads) == 1 and decode_result(payloads[0]).id == f"r:{n}"
        assert 0 < await client.ttl(keys.reply(reply)) <= 60
    assert (await client.xpending(stream, keys.group))["pending"] == 0
    assert await client.hget(keys.job("job-1"), "done") == b"2"
