"""One round of an enqueue call's writes: each partition's chunks through the enqueue script.

A round is one pipelined round trip (per node, on a cluster, the nodes in parallel), sent again
after a fault until its partitions' replicas confirm it (EMBEDFLEET_MIN_REPLICAS,
producer/confirmed_writes.py). What it tells, per partition: the chunks added, those skipped
(in their job already) and those refused (no room under their tenant's share of
EMBEDFLEET_TENANT_MAX_BACKLOG: the enqueuer sends them again once there is room).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis import exceptions as redis_errors

from embedfleet.producer.backlog_waits import BacklogWaits
from embedfleet.producer.confirmed_writes import Group, write_confirmed
from embedfleet.producer.enqueue import (
    EnqueueCall,
    enqueue_script_command,
    finished_ttl_command,
    register_tenant_command,
    script_counts,
    script_handled,
)
from embedfleet.producer.lane import ProducerLane
from embedfleet.shared.keys import Keys
from embedfleet.shared.protocol import Chunk, encode_chunk

# command index in a partition's pipeline, and the chunks of the script call it is
ScriptCall = tuple[int, list[Chunk]]


class ReplicasNotConfirmedError(redis_errors.ConnectionError):
    """Fewer replicas than EMBEDFLEET_MIN_REPLICAS acknowledged a batch: it is sent again
    (a transient fault, retried with the client's backoff like a dropped connection)."""


@dataclass
class Sent:
    """What became of one partition's chunks in one round: ``added`` (this batch's, a re-send's
    included), ``present`` (skipped: in their job already), ``refused`` (no room under their
    tenant's EMBEDFLEET_TENANT_MAX_BACKLOG share: to be sent again once there is room)."""

    added: int = 0
    present: int = 0
    refused: list[Chunk] = dataclasses.field(default_factory=list)


class PartitionWrites:
    """Sends a round of a batch's chunks, each partition's through the enqueue script."""

    def __init__(self, lane: ProducerLane, waits: BacklogWaits) -> None:
        self.lane = lane
        self.waits = waits  # each tenant's share of a partition, the script's limit

    async def send_round(
        self, waiting: dict[Keys, list[Chunk]], call: EnqueueCall, size: int
    ) -> dict[Keys, Sent]:
        """``waiting``'s chunks, each partition's in one pipelined try, again after a fault
        (a partition's latest try tells all of it: the script counts a chunk this batch added
        before a lost reply as added by it again)."""
        unsent = waiting
        sent: dict[Keys, Sent] = {}

        async def attempt() -> None:
            nonlocal unsent
            unsent, sent_now = await self.send_once(unsent, call)
            sent.update(sent_now)
            if unsent:
                partitions = sorted(k.index for k in unsent)
                raise ReplicasNotConfirmedError(
                    f"fewer than EMBEDFLEET_MIN_REPLICAS={self.lane.settings.min_replicas} "
                    f"replicas confirmed the chunks of partitions {partitions} "
                    "within EMBEDFLEET_MIN_REPLICAS_TIMEOUT_MS: sending them again"
                )

        await self.lane.retry.call(f"enqueue a batch of {size} chunks", attempt)
        return sent

    async def send_once(
        self, by_partition: dict[Keys, list[Chunk]], call: EnqueueCall
    ) -> tuple[dict[Keys, list[Chunk]], dict[Keys, Sent]]:
        """One pipelined round trip (per node, on a cluster, the nodes in parallel): per
        partition, tenant and job (or no job), the enqueue script, whose keys all share the
        partition's slot, adding while the tenant's stream has room under its share of
        EMBEDFLEET_TENANT_MAX_BACKLOG (chunks without a job: no id record, nothing counts
        them; a re-sent one is at worst embedded twice). With EMBEDFLEET_MIN_REPLICAS, WAIT on
        the connection that made each partition's writes, wherever a moving slot sent them
        (producer/confirmed_writes.py). Returns the partitions whose replicas did not confirm
        them (to be sent again), and what became of each partition's chunks."""
        groups: dict[Keys, Group[Keys]] = {}
        scripts_of: dict[Keys, list[ScriptCall]] = {}
        for partition, chunks in by_partition.items():
            commands, scripts_of[partition] = self._commands(partition, chunks, call)
            groups[partition] = Group(partition.ingest, commands)
        settings = self.lane.settings
        written = await write_confirmed(
            self.lane.client, groups, settings.min_replicas, settings.min_replicas_timeout_ms
        )
        sent = {
            partition: _outcome(replies, scripts_of.get(partition, []))
            for partition, replies in written.replies.items()
        }
        return {partition: by_partition[partition] for partition in written.unconfirmed}, sent

    def _commands(
        self, partition: Keys, chunks: list[Chunk], call: EnqueueCall
    ) -> tuple[list[tuple[Any, ...]], list[ScriptCall]]:
        """A partition's pipeline: its tenants registered, a script call per tenant and job,
        each job's finished-TTL and its place in the partition's jobs index; and where in it
        each script call is."""
        settings = self.lane.settings
        commands: list[tuple[Any, ...]] = []
        scripts: list[ScriptCall] = []
        by_job: dict[tuple[str | None, str | None], list[Chunk]] = {}
        for named in sorted({c.tenant for c in chunks if c.tenant is not None}):
            # the tenant's stream in the registry, its group made, before its first entry
            commands.append(register_tenant_command(partition, named))
        for chunk in chunks:
            by_job.setdefault((chunk.tenant, chunk.job), []).append(chunk)
        for (owner, job), job_chunks in by_job.items():
            scripts.append((len(commands), job_chunks))
            commands.append(
                enqueue_script_command(
                    stream=partition.ingest_for(owner),
                    counters=None if job is None else partition.job(job),
                    id_record=None if job is None else partition.job_ids(job),
                    chunks=[(c.id, encode_chunk(c)) for c in job_chunks],
                    id_record_ttl_s=settings.job_ids_ttl_s,
                    call=call,
                    limit=self.waits.share(partition, owner),
                )
            )
            if job is None:
                continue
            finished = finished_ttl_command(
                partition.job(job), settings.job_ids_ttl_s, settings.job_ids_finished_ttl_s
            )
            if finished is not None:
                commands.append(finished)
        jobs = {job for _, job in by_job if job is not None}
        if jobs:
            # Outside the script, but in the partition's slot too (its own jobs index).
            commands.append(("SADD", partition.jobs_index, *jobs))
        return commands, scripts


def _outcome(replies: Sequence[Any], scripts: list[ScriptCall]) -> Sent:
    """What a partition's script calls say became of its chunks."""
    outcome = Sent()
    for index, chunks in scripts:
        reply = replies[index]
        added, again = script_counts(reply)
        handled = script_handled(reply)
        outcome.added += added + again
        outcome.present += handled - added - again
        outcome.refused += chunks[handled:]
    return outcome
