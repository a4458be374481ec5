"""Every Redis key embedfleet touches, in one place (the arq way).

All keys start with one namespace. Put a Redis Cluster hash tag in it (``{embedfleet}``) and every
key of a deployment lands on one shard, so the multi-key pipelines (write result + XACK + progress)
stay legal on a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_NAMESPACE = "embedfleet"
DEFAULT_GROUP = "workers"


@dataclass(frozen=True)
class Keys:
    """Key names for one namespace. Build it once from settings and pass it around."""

    namespace: str = DEFAULT_NAMESPACE
    group: str = DEFAULT_GROUP

    @property
    def ingest(self) -> str:
        """Stream of bulk chunks, read by workers through the consumer group."""
        return f"{self.namespace}:ingest"

    @property
    def query(self) -> str:
        """Stream of priority single queries, read before every bulk batch."""
        return f"{self.namespace}:query"

    @property
    def results(self) -> str:
        """Stream of embedding results (msgpack, fp16 vectors) written by the Redis sink."""
        return f"{self.namespace}:results"

    @property
    def dead(self) -> str:
        """Dead-letter stream: entries that could not be embedded, with a readable reason."""
        return f"{self.namespace}:dead"

    def job(self, job_id: str) -> str:
        """Hash of a job's counters: ``enqueued``, ``done``, ``dead``."""
        return f"{self.namespace}:job:{job_id}"

    def job_ids(self, job_id: str) -> str:
        """Hash of the chunk ids a job has enqueued (id -> digest of the payload sent).

        The enqueue script reads it so that a re-sent chunk is added and counted once. Its own
        prefix (not ``job:<job>:ids``) so that no job name can collide with another's counters.
        """
        return f"{self.namespace}:jobids:{job_id}"

    def reply(self, request_id: str) -> str:
        """List a query's caller blocks on (BLPOP); it expires if the caller has gone."""
        return f"{self.namespace}:reply:{request_id}"

    @property
    def jobs_index(self) -> str:
        """Set of known job ids, so ``embedfleet status`` can list them."""
        return f"{self.namespace}:jobs"

    @property
    def model(self) -> str:
        """Hash a worker writes at start: the model it serves (name, dim, normalize, prompts,
        max_length), so producers and the gateway can check options before enqueueing."""
        return f"{self.namespace}:model"

    def calibration(self, model: str, variant: str) -> str:
        """int8/uint8 calibration ranges of ``model`` for one dimension variant (JSON; ``384``,
        ``64``, ``64-raw``): written once, by the first worker that needs them or from
        ``EMBEDFLEET_CALIBRATION_FILE``, then shared (workers/calibration.py)."""
        return f"{self.namespace}:calibration:{model}:{variant}"
