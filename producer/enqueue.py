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

Chunks without a job have no counter that a re-send could put off, and are added without a
record (the script with the stream as its only key): a re-sent one is at worst embedded twice,
and the sinks upsert by id.

Each record also holds the token of the batch that added it (one per batch of an enqueue
call, the same for every re-send of that batch), so the script can tell the caller the truth:
``added`` now, ``again`` (this same batch added them before a reply was lost: added by this
call all the same) and the rest, already in the job before (an id repeated in the input with
the same payload, in this batch or an earlier one, is one of those: added once, and the call
says the repeat was skipped). ``force`` (``enqueue --force``) adds ids the job already has,
for a re-embed after their vectors were lost (a wiped table): the records then hold the batch's
token, so a re-send of the batch still adds each chunk once.

The tenant's backlog limit (EMBEDFLEET_TENANT_MAX_BACKLOG, its share in the partition:
``TenantPolicy.backlog_share``) is checked by the same script, entry by entry, where it adds
them: concurrent producers cannot pass it between a check and an add. The script stops at the
first chunk the stream has no room for and says how many it dealt with; the producer sends the
rest again once there is room (``Producer.enqueue``); so does the limit for chunks without
a job.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from embedfleet.shared import scripts
from embedfleet.shared.jobs import IDS_TTL_AFTER_DONE_FIELD
from embedfleet.shared.keys import Keys
from embedfleet.shared.protocol import PAYLOAD_FIELD

ENQUEUE_SCRIPT = scripts.load("enqueue")
REGISTER_TENANT_SCRIPT = scripts.load("register_tenant")

if PAYLOAD_FIELD != b"m":  # the script writes the field by name
    raise RuntimeError("ENQUEUE_SCRIPT must write the protocol's payload field")


def payload_digest(payload: bytes) -> bytes:
    """8 bytes that tell a re-send of the same payload from a changed one (not a security hash)."""
    return hashlib.blake2b(payload, digest_size=8).digest()


def new_call_token() -> bytes:
    """The token one enqueue batch writes into the id records it adds (8 bytes; each batch of a
    call has its own: ``EnqueueCall.for_batch``)."""
    return secrets.token_bytes(8)


@dataclass(frozen=True)
class EnqueueCall:
    """What one ``Producer.enqueue`` call passes to the script calls of a batch: ``token`` is
    the batch's (``for_batch``), written into the id records it adds, so that a re-send of the
    batch is told from an id repeated in another batch of the call."""

    token: bytes = field(default_factory=new_call_token)
    force: bool = False

    def for_batch(self) -> EnqueueCall:
        """The same call with a token of a new batch's own."""
        return EnqueueCall(force=self.force)


def enqueue_script_command(
    *,
    stream: str,
    counters: str | None,
    id_record: str | None,
    chunks: Sequence[tuple[str, bytes]],
    id_record_ttl_s: int,
    call: EnqueueCall,
    limit: int | None = None,
) -> tuple[str | bytes | int, ...]:
    """The script call (EVAL and its arguments) for ``chunks`` (id, encoded payload) of one job
    (``counters`` and ``id_record`` None: chunks without a job), adding to ``stream`` while it
    holds fewer than ``limit`` entries (None: no limit).

    Its reply is ``[added, again, handled]`` (``shared/scripts/enqueue.lua``); read it with
    :func:`script_counts` and :func:`script_handled`."""
    args: list[str | bytes | int] = [
        id_record_ttl_s,
        call.token,
        int(call.force),
        -1 if limit is None else limit,
    ]
    for chunk_id, payload in chunks:
        args += [chunk_id, payload_digest(payload), payload]
    if counters is None or id_record is None:
        return ("EVAL", ENQUEUE_SCRIPT, 1, stream, *args)
    return ("EVAL", ENQUEUE_SCRIPT, 3, stream, counters, id_record, *args)


def register_tenant_command(partition: Keys, tenant: str) -> tuple[str | int, ...]:
    """The script call that lists a named tenant's stream in the partition's registry and
    makes its consumer group (shared/scripts/register_tenant.lua); sent before the tenant's
    chunks in each batch's pipeline. Its reply is 0 or 1 (not an enqueue script's pair)."""
    return (
        "EVAL",
        REGISTER_TENANT_SCRIPT,
        2,
        partition.tenants,
        partition.ingest_for(tenant),
        tenant,
        partition.group,
    )


def finished_ttl_command(
    counters: str, id_record_ttl_s: int, finished_ttl_s: int
) -> tuple[str | int, ...] | None:
    """The HSET that tells the workers' acknowledgement script (acknowledge.lua) to give the
    job's id record ``finished_ttl_s`` (EMBEDFLEET_JOB_IDS_FINISHED_TTL_S) once the job has
    finished; None when that would not shorten its life. Sent after the job's enqueue script,
    in the partition's slot (the job's counters hash)."""
    if not finished_ttl_s or (id_record_ttl_s and finished_ttl_s >= id_record_ttl_s):
        return None
    return ("HSET", counters, IDS_TTL_AFTER_DONE_FIELD, finished_ttl_s)


def script_counts(reply: Sequence[int]) -> tuple[int, int]:
    """(added now, added by this same batch before a lost reply) from the script's reply."""
    added, again, _ = reply
    return int(added), int(again)


def script_handled(reply: Sequence[int]) -> int:
    """How many of the script's chunks, from the first, it dealt with: the rest found the
    stream at the tenant's limit and are to be sent again once there is room."""
    return int(reply[2])


def queue_enqueue(
    pipe: aioredis.client.Pipeline,
    *,
    stream: str,
    counters: str,
    id_record: str,
    chunks: Sequence[tuple[str, bytes]],
    id_record_ttl_s: int,
    call: EnqueueCall | None = None,
) -> None:
    """Queue one script call on ``pipe`` (see :func:`enqueue_script_command`; by default a call of
    its own that skips ids the job already has)."""
    pipe.execute_command(
        *enqueue_script_command(
            stream=stream,
            counters=counters,
            id_record=id_record,
            chunks=chunks,
            id_record_ttl_s=id_record_ttl_s,
            call=call or EnqueueCall(),
        )
    )


class Enqueued(int):
    """What ``Producer.enqueue`` did: the int is how many chunks this call added to the ingest
    stream (each will be embedded); ``present`` how many it skipped because their job already
    had them, with the same payload, from an earlier enqueue (``enqueue --force`` adds them
    again). Chunks without a job are always added."""

    present: int

    def __new__(cls, added: int = 0, present: int = 0) -> Enqueued:
        self = super().__new__(cls, added)
        self.present = present
        return self

    @property
    def added(self) -> int:
        return int(self)

    @property
    def chunks(self) -> int:
        """Every chunk the call was given: added or already present."""
        return int(self) + self.present

    def __add__(self, other: object) -> Enqueued:
        if isinstance(other, Enqueued):
            return Enqueued(int(self) + int(other), self.present + other.present)
        return NotImplemented

    def __repr__(self) -> str:
        return f"Enqueued(added={int(self)}, present={self.present})"
