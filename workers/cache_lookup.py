"""The vector cache's look-up for a window: the chunks it holds a vector for skip the model.

The bulk reader (``Intake``) looks a window's chunks up once, on the event loop, between the
tokenizer thread's two passes (decode, then tokenize): one round trip per key set. A chunk sent
with ``reembed`` is not looked up but counted as a miss; a vector of a text cut to fit is not
reused where cutting is refused (EMBEDFLEET_TRUNCATE=false). Redis failing here costs only the
cache: every chunk is embedded. The store itself, its keys and counters: shared/vector_cache.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

from embedfleet.shared.fault_kinds import System
from embedfleet.shared.keys import Keys
from embedfleet.shared.logging import get_logger
from embedfleet.shared.protocol import Chunk, Result
from embedfleet.shared.vector_cache import CacheCounts, CachedVector, VectorCache
from embedfleet.sinks import Delivery
from embedfleet.workers.decode import Accepted
from embedfleet.workers.events import WorkerEvents
from embedfleet.workers.outages import transient_or_raise

log = get_logger("embedfleet.worker")


async def look_up(
    cache: VectorCache,
    keys: Keys,
    events: WorkerEvents,
    accepted: Sequence[Accepted],
    content_keys: Sequence[str | None],
    *,
    truncate: bool,
) -> dict[int, CachedVector]:
    """The chunks ``cache`` holds a usable vector for, by position in ``accepted`` (their
    ``content_keys``: None, not cached). The hits and misses are counted: the key set's and
    each job's counters, and the worker's ``events``."""
    if not cache.enabled or not accepted:
        return {}
    by_owner: dict[Keys, list[int]] = {}
    for position, item in enumerate(accepted):
        with contextlib.suppress(KeyError):  # (a stream of no key set: not looked up)
            by_owner.setdefault(keys.owner_of(item.delivery.stream), []).append(position)
    hits: dict[int, CachedVector] = {}
    for owner, positions in by_owner.items():
        wanted = [
            p for p in positions if content_keys[p] is not None and not accepted[p].chunk.reembed
        ]
        try:
            found = await cache.lookup(owner, [content_keys[p] or "" for p in wanted])
        except Exception as error:
            transient_or_raise(error, System.REDIS)
            log.warning("vector cache not read: embedding the window", error=str(error))
            found = [None] * len(wanted)
        hits.update(usable_hits(wanted, found, truncate=truncate))
        per_job = counts_per_job([accepted[p].chunk for p in positions], positions, hits)
        total = sum(per_job.values(), CacheCounts())
        events.vector_cache_checked(
            hits=total.hits, misses=total.misses, tokens_saved=total.tokens_saved
        )
        try:
            await cache.count(owner, per_job)
        except Exception as error:
            transient_or_raise(error, System.REDIS)
            log.warning("vector cache counters not updated", error=str(error))
    return hits


def usable_hits(
    positions: Sequence[int], found: Sequence[CachedVector | None], *, truncate: bool
) -> dict[int, CachedVector]:
    """The entries found that a chunk may take, by its position: a vector of a text cut to fit
    is not reused where cutting is refused."""
    return {
        position: entry
        for position, entry in zip(positions, found, strict=True)
        if entry is not None and (truncate or not entry.result.truncated)
    }


def counts_per_job(
    chunks: Sequence[Chunk], positions: Sequence[int], hits: Mapping[int, CachedVector]
) -> dict[str | None, CacheCounts]:
    """One key set's look-up counted per job (``chunks[i]`` is at ``positions[i]``): a hit,
    with the tokens its vector saves, or a miss."""
    per_job: dict[str | None, CacheCounts] = {}
    for chunk, position in zip(chunks, positions, strict=True):
        entry = hits.get(position)
        counts = CacheCounts(1, 0, entry.tokens) if entry else CacheCounts(0, 1, 0)
        per_job[chunk.job] = per_job.get(chunk.job, CacheCounts()) + counts
    return per_job


def answered(
    accepted: Sequence[Accepted], hits: Mapping[int, CachedVector]
) -> list[tuple[Chunk, Delivery, Result]]:
    """The hits as the window holds them: each chunk, its entry, and the result made from the
    stored vector (the chunk's own id, job, meta and text)."""
    return [
        (accepted[p].chunk, accepted[p].delivery, entry.for_chunk(accepted[p].chunk))
        for p, entry in sorted(hits.items())
    ]
