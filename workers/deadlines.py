"""Deadline expiry: a chunk whose caller's deadline has passed is acknowledged, not embedded.

A caller that sets ``deadline_ms`` (a gateway request, ``Producer.embed_query(timeout=)``) has
gone once it passes: answering would only leave a reply list to expire. The bulk reader
(``Intake``) and the query stage both set such entries aside here, once per read, and
acknowledge them counted as ``expired``.
"""

from __future__ import annotations

from collections.abc import Sequence

from redis.asyncio.client import Pipeline

from embedfleet.shared.keys import Keys
from embedfleet.sinks import Delivery, queue_acknowledgements
from embedfleet.workers.decode import Accepted


def split_expired(accepted: list[Accepted], now_ms: float) -> tuple[list[Accepted], list[Delivery]]:
    """``accepted`` less the chunks past their deadline at ``now_ms`` (unix ms), and the
    entries of those. One pass over the read, nothing copied when none has expired."""
    expired = [
        a.delivery
        for a in accepted
        if a.chunk.deadline_ms is not None and a.chunk.deadline_ms < now_ms
    ]
    if not expired:
        return accepted, expired
    kept = [a for a in accepted if a.chunk.deadline_ms is None or a.chunk.deadline_ms >= now_ms]
    return kept, expired


async def acknowledge_expired(pipe: Pipeline, keys: Keys, expired: Sequence[Delivery]) -> None:
    """Acknowledge (and delete) entries nobody waits for any more through ``pipe``, counted as
    expired (the key set's counter, and each job's)."""
    if not expired:
        return
    queue_acknowledgements(pipe, keys, expired, counter="expired")
    await pipe.execute()
