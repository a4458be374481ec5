"""Enqueue-and-count in one Lua script: a chunk re-sent within its job is added and counted once.

A pipelined batch whose reply was lost (a dropped connection, a restarted server) may or may not
have been applied, and the client cannot tell which: it can only send the batch again. With
plain XADD + HINCRBY the job's ``enqueued`` counter would then count those chunks twice, and
``wait_for_job`` would wait for ever for entries that were never there. The script records each
chunk id a job has enqueued, with a digest of the payload sent, and adds an entry (and counts
it) only for an id the job has not seen with that payload:

- the same id with the same payload (a re-sent batch, a re-run of the same file): nothing;
- the same id with a changed payload (new text or meta): added and counted again, so the new
  text is embedded and, the sinks upserting by id, replaces the old vector. The job then
  counts both entries, and its ``done`` counter counts both acknowledgements: it finishes.

The script touches exactly the keys it is given in ``KEYS[]`` (the ingest stream, the job's
counters, the job's id record), so on Redis Cluster it only needs them to share a slot: with
partitions, each partition's keys share one hash tag and the producer calls the script once
per partition with that partition's keys. Nothing here assumes a single ingest stream.

Chunks without a job have no counter that a re-send could put off, and are added with a plain
XADD: a re-sent one is at worst embedded twice, and the sinks upsert by id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import redis.asyncio as aioredis

from embedfleet.shared import scripts
from embedfleet.shared.jobs import IDS_TTL_AFTER_DONE_FIELD
from embedfleet.shared.protocol import PAYLOAD_FIELD

ENQUEUE_SCRIPT = scripts.load("enqueue")

if PAYLOAD_FIELD != b"m":  # the script writes the field by name
    raise RuntimeError("ENQUEUE_SCRIPT must write the protocol's payload field")


def payload_digest(payload: bytes) -> bytes:
    """8 bytes that tell a re-send of the same payload from a changed one (not a security hash)."""
    return hashlib.blake2b(payload, digest_size=8).digest()


def queue_enqueue(
    pipe: aioredis.client.Pipeline,
    *,
    stream: str,
    counters: str,
    id_record: str,
    chunks: Sequence[tuple[str, bytes]],
    id_record_ttl_s: int,
    finished_ttl_s: int = 0,
) -> None:
    """Queue one script call on ``pipe`` for ``chunks`` (id, encoded payload) of one job.

    Its reply in the pipeline's results is how many entries were really added
    (``shared/scripts/enqueue.lua``). ``finished_ttl_s`` (EMBEDFLEET_JOB_IDS_FINISHED_TTL_S)
    is then written to the job's counters hash, after the script: the workers' acknowledgement
    script gives the id record that TTL once the job has finished."""
    args: list[str | bytes | int] = [id_record_ttl_s]
    for chunk_id, payload in chunks:
        args += [chunk_id, payload_digest(payload), payload]
    pipe.eval(ENQUEUE_SCRIPT, 3, stream, counters, id_record, *args)
    if finished_ttl_s and (id_record_ttl_s == 0 or finished_ttl_s < id_record_ttl_s):
        pipe.hset(counters, IDS_TTL_AFTER_DONE_FIELD, finished_ttl_s)
