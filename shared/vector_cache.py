"""The vector cache: stored vectors by content key, in Redis, bounded (issue 31).

Before a chunk reaches the model, the worker looks its content key (shared/content_key.py) up
in its key set's cache (``Keys.vector_cache``, one per partition: the chunk's own slot). On a
hit it writes the row and the result from the stored vector, through the same sink and the same
acknowledgement as an embedded chunk, so job counters, dead letters and the result's bytes do
not change; only the model is skipped. A miss is stored once embedded, before its write.

Why Redis and not the database sink's own rows: the check must work for every sink (the
results stream, Parquet and the three databases alike), and for a chunk whose id changed (a
document moved, a chunk renumbered) as for one re-sent under its old id; it is one pipelined
round trip per window read, on the server the worker already talks to, with no schema change to
existing tables and no read from a database that may be slow or far. Its cost is memory, which
the store script bounds itself (EMBEDFLEET_VECTOR_CACHE_MB over all partitions, least recently
used evicted first, and EMBEDFLEET_VECTOR_CACHE_TTL_S of idleness): a server's maxmemory
policy alone would not do on a shared server, where it evicts other keys too, or none.

An entry is the result as the results stream carries it (``encode_result``, with an empty id
and no job or meta) and the chunk's token count (what a hit saves), in one msgpack map:
``{"t": tokens, "r": result}``.

Counters (``Keys.vector_cache_stats`` per key set, and each job's counters hash): ``hits``,
``misses``, ``tokens_saved``; they are statistics, counted when the chunk is looked up, so a
chunk redelivered after a crash may count twice (``done`` and ``dead`` stay exact).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import msgpack
import redis.asyncio as aioredis

from embedfleet.shared import scripts
from embedfleet.shared.keys import Keys
from embedfleet.shared.protocol import (
    Chunk,
    DenseResults,
    Result,
    decode_result,
    encode_result,
    encode_results,
)

PUT_SCRIPT = scripts.load("vector_cache_put")  # shared/scripts/vector_cache_put.lua
# the job counter fields (beside enqueued, done, dead) and the cache's own counter fields
HITS, MISSES, TOKENS_SAVED = "cache_hits", "cache_misses", "tokens_saved"
STATS_FIELDS = {"hits": HITS, "misses": MISSES, "tokens_saved": TOKENS_SAVED}


@dataclass(frozen=True)
class CachedVector:
    """A cache entry: the result as stored (no id, job or meta) and its chunk's token count."""

    result: Result
    tokens: int

    def for_chunk(self, chunk: Chunk) -> Result:
        """The result ``chunk`` gets from this entry: its own id, job, meta and text."""
        return dataclasses.replace(
            self.result, id=chunk.id, job=chunk.job, meta=chunk.meta, text=chunk.row_text
        )


# what an entry leaves out of the result: the row's own fields, which a hit takes from its chunk
_NOT_STORED: dict[str, object] = {"id": "", "job": None, "meta": None, "text": None}


def pack_entry(result: Result, tokens: int) -> bytes:
    # the result with those fields cleared, as dataclasses.replace would make it, copied by its
    # __dict__: replace runs __init__ over every field again, the most of this function's cost
    # (issue 43); Result has no __post_init__ to skip
    bare = object.__new__(Result)
    bare.__dict__.update(result.__dict__, **_NOT_STORED)
    return msgpack.packb({"t": int(tokens), "r": encode_result(bare)}, use_bin_type=True)


def pack_entries(results: Sequence[Result], tokens: Sequence[int]) -> list[bytes]:
    """``pack_entry`` of each result with its chunk's token count, byte for byte; a batch's
    DenseResults packed from its columns (issue 53): its rows' bare results are the columns'
    payloads with an empty id, no job and no meta, no Result made per row."""
    if not isinstance(results, DenseResults):
        return [pack_entry(result, count) for result, count in zip(results, tokens, strict=True)]
    bare = DenseResults(
        [_BARE_CHUNK] * len(results),
        results.vectors,
        results.truncated,
        model=results.model,
        dtype=results.dtype,
        with_meta=False,
    )
    return [
        msgpack.packb({"t": int(count), "r": payload}, use_bin_type=True)
        for count, payload in zip(tokens, encode_results(bare), strict=True)
    ]


# the row fields of a bare result (_NOT_STORED's): an empty id, no job, no meta
_BARE_CHUNK = Chunk("")


def unpack_entry(data: bytes) -> CachedVector | None:
    """The entry, or None for one that cannot be read (then the chunk is embedded again)."""
    try:
        fields = msgpack.unpackb(data, raw=False, max_bin_len=len(data), max_str_len=len(data))
        return CachedVector(decode_result(fields["r"]), int(fields["t"]))
    except Exception:
        return None


@dataclass(frozen=True)
class CacheCounts:
    """Hits, misses and tokens saved, of one look-up or summed over key sets."""

    hits: int = 0
    misses: int = 0
    tokens_saved: int = 0

    def __add__(self, other: CacheCounts) -> CacheCounts:
        return CacheCounts(
            self.hits + other.hits,
            self.misses + other.misses,
            self.tokens_saved + other.tokens_saved,
        )

    @property
    def hit_ratio(self) -> float | None:
        looked_up = self.hits + self.misses
        return None if not looked_up else self.hits / looked_up


@dataclass(frozen=True)
class CacheState:
    """The fleet's vector cache, as ``embedfleet status`` shows it (shared/fleet.py)."""

    counts: CacheCounts
    held_bytes: int  # what the entries take, as the store script counts them
    evicted: int

    @classmethod
    def summed(cls, replies: Iterable[Mapping[bytes | str, bytes | str]]) -> CacheState:
        values: dict[str, int] = {}
        for reply in replies:
            for key, value in reply.items():
                name = key.decode() if isinstance(key, bytes) else key
                values[name] = values.get(name, 0) + int(value)
        counts = CacheCounts(*(values.get(name, 0) for name in STATS_FIELDS))
        return cls(counts, values.get("bytes", 0), values.get("evicted", 0))

    def as_dict(self) -> dict[str, int | float | None]:
        ratio = self.counts.hit_ratio
        return {
            "hits": self.counts.hits,
            "misses": self.counts.misses,
            "tokens_saved": self.counts.tokens_saved,
            "hit_ratio": None if ratio is None else round(ratio, 4),
            "bytes": self.held_bytes,
            "evicted": self.evicted,
        }


class VectorCache:
    """One worker's access to the cache of each key set it reads (its partitions, the priority
    streams'). ``enabled`` is False with EMBEDFLEET_VECTOR_CACHE_MB=0: nothing is looked up."""

    def __init__(self, client: aioredis.Redis, keys: Keys, max_mb: int, ttl_s: int) -> None:
        self.client = client
        self.keys = keys
        # the bound is the fleet's; each partition's cache holds its share
        self.bound_bytes = max_mb * 1_000_000 // max(1, keys.partitions)
        self.ttl_ms = ttl_s * 1000
        self.enabled = max_mb > 0

    async def lookup(self, owner: Keys, content_keys: Sequence[str]) -> list[CachedVector | None]:
        """Each key's entry (None: a miss), in order; the hits' last use moves to now. One
        round trip."""
        if not content_keys:
            return []
        now = _now_ms()
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(owner.vector_cache, list(content_keys))
        # XX: only members already there, i.e. the hits (a miss is stored after it is written)
        pipe.zadd(owner.vector_cache_lru, dict.fromkeys(content_keys, now), xx=True)
        found, _ = await pipe.execute()
        return [None if data is None else unpack_entry(data) for data in found]

    async def count(self, owner: Keys, per_job: Mapping[str | None, CacheCounts]) -> None:
        """Add one look-up's counts to the key set's counters and to each job's."""
        total = CacheCounts()
        pipe = self.client.pipeline(transaction=False)
        for job, counts in per_job.items():
            total += counts
            if job is not None:
                _increments(pipe, owner.job(job), counts, STATS_FIELDS)
        _increments(pipe, owner.vector_cache_stats, total, {k: k for k in STATS_FIELDS})
        await pipe.execute()

    async def store(self, owner: Keys, entries: Sequence[tuple[str, bytes]]) -> int:
        """Store (content key, packed entry) pairs in the key set's cache, evicting past its
        bound; returns how many entries were evicted."""
        if not entries:
            return 0
        args: list[str | bytes | int] = [_now_ms(), self.bound_bytes, self.ttl_ms]
        for key, value in entries:
            args += [key, value]
        keys = (owner.vector_cache, owner.vector_cache_lru, owner.vector_cache_stats)
        evicted = await self.client.execute_command("EVAL", PUT_SCRIPT, 3, *keys, *args)
        return int(evicted)


def _increments(
    pipe: aioredis.client.Pipeline, key: str, counts: CacheCounts, fields: Mapping[str, str]
) -> None:
    for attribute, name in fields.items():
        value = getattr(counts, attribute)
        if value:
            pipe.hincrby(key, name, value)


def _now_ms() -> int:
    return int(time.time() * 1000)


async def clear(client: aioredis.Redis, keys: Keys) -> int:
    """Drop every key set's cache (its entries, order and counters); how many entries went."""
    dropped = 0
    for owner in cache_key_sets(keys):
        dropped += int(await client.hlen(owner.vector_cache))
        await client.unlink(owner.vector_cache, owner.vector_cache_lru, owner.vector_cache_stats)
    return dropped


def cache_key_sets(keys: Keys) -> list[Keys]:
    """The key sets that hold a vector cache: each partition's, and with partitions the priority
    streams' (the gateway's large requests, read from its interactive stream)."""
    sets = list(keys.partitions_keys)
    if keys.partitioned:
        sets.append(keys.priority_streams)
    return sets
