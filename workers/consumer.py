"""Reading from the streams through the consumer group, queries first."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from embedfleet.shared.keys import Keys
from embedfleet.shared.protocol import PAYLOAD_FIELD
from embedfleet.shared.redis_conn import ensure_groups


@dataclass(frozen=True)
class StreamEntry:
    """One entry read from a stream; ``payload`` is None when the entry has no ``m`` field."""

    stream: str
    entry_id: str
    payload: bytes | None
    fields: dict[bytes, bytes]


class StreamConsumer:
    """One consumer in the group. Reads the query stream first, then the ingest stream in bulk."""

    def __init__(self, client: aioredis.Redis, keys: Keys, consumer: str) -> None:
        self.client = client
        self.keys = keys
        self.consumer = consumer

    async def setup(self) -> None:
        await ensure_groups(self.client, self.keys)

    async def read(
        self, count: int, block_ms: int, *, include_ingest: bool = True
    ) -> list[StreamEntry]:
        """Whatever is waiting: queries without blocking, then bulk; block only when both are empty.

        The blocking read names both streams, so a query arriving while the worker is idle
        wakes it at once: no polling loop, no sleep.
        """
        queries = await self._read({self.keys.query: ">"}, count, block_ms=None)
        if queries:
            return queries
        if not include_ingest:
            return await self._read({self.keys.query: ">"}, count, block_ms=block_ms)
        bulk = await self._read({self.keys.ingest: ">"}, count, block_ms=None)
        if bulk:
            return bulk
        return await self._read({self.keys.query: ">", self.keys.ingest: ">"}, count, block_ms)

    async def read_stream(self, stream: str, count: int, block_ms: int | None) -> list[StreamEntry]:
        """New entries of one stream; blocks up to ``block_ms`` when there are none."""
        return await self._read({stream: ">"}, count, block_ms)

    async def _read(
        self, streams: dict[str, str], count: int, block_ms: int | None
    ) -> list[StreamEntry]:
        response = await self.client.xreadgroup(
            self.keys.group, self.consumer, streams, count=count, block=block_ms
        )
        entries: list[StreamEntry] = []
        # Query stream first when a blocking read returns both.
        for stream_name, stream_entries in sorted(
            response or [], key=lambda item: as_str(item[0]) != self.keys.query
        ):
            stream = as_str(stream_name)
            for entry_id, fields in stream_entries:
                fields = fields or {}
                entries.append(
                    StreamEntry(
                        stream=stream,
                        entry_id=as_str(entry_id),
                        payload=fields.get(PAYLOAD_FIELD),
                        fields=fields,
                    )
                )
        return entries


def as_str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
