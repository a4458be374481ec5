"""Queue settings: the Redis connection, the key names, the partitions and the replicas' WAIT."""

from __future__ import annotations

import os
import socket
from typing import ClassVar, Self

from pydantic import Field, field_validator, model_validator

from embedfleet.shared.keys import DEFAULT_GROUP, DEFAULT_NAMESPACE, MAX_PARTITIONS
from embedfleet.shared.redis_url import split_cluster_url
from embedfleet.shared.settings.section import Section


def _default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class QueueSettings(Section):
    """Where the queue is (Redis) and how its keys are named and partitioned."""

    title: ClassVar[str] = "Queue: Redis, keys and partitions"

    redis_url: str | None = None
    """Redis/Valkey URL (`redis://`, `rediss://` for TLS, `user:password@` for ACL). Unset:
    `embedfleet demo` starts an embedded server; other verbs use redis://localhost:6379/0."""
    namespace: str = DEFAULT_NAMESPACE
    """Prefix of every key. Use a hash tag such as `{embedfleet}` on Redis Cluster."""
    group: str = DEFAULT_GROUP
    """Consumer group the workers read through."""
    consumer: str = Field(default_factory=_default_consumer_name)
    """This worker's consumer name in the group (default: hostname-pid)."""
    redis_cluster: bool = False
    """Talk to a Redis Cluster (redis-py's cluster client: MOVED/ASK and failovers are followed). A
    `redis+cluster://` or `rediss+cluster://` URL does the same."""
    partitions: int = Field(default=1, ge=1, le=MAX_PARTITIONS)
    """Partitions of the queue, each with its own streams in one hash slot, spread over a cluster's
    slots; a chunk goes to partition crc32(id) mod N. 1 = the single-node keys. Every producer,
    worker and `embedfleet status` of a deployment must agree."""
    partition_set: str = ""
    """Partitions this worker reads, e.g. `0,2,4-5` (pinning); empty = all."""
    min_replicas: int = Field(default=0, ge=0)
    """Producers confirm each batch with `WAIT <n>` and re-send one that fewer replicas
    acknowledged, so a failover right after an enqueue loses nothing. 0 = off."""
    min_replicas_timeout_ms: int = Field(default=2000, ge=1)
    """How long one `WAIT` for the replicas may take."""
    redis_retry_s: float = Field(default=300.0, gt=0)
    """How long the client (`Producer`, `enqueue`, `results`, `query`, `search`, `status --watch`,
    `dead`) keeps retrying while Redis is unreachable (restart, failover, dropped connection), with
    the workers' capped, jittered backoff, before it gives up with an error that names the server.
    Queries stop at their own timeout."""
    redis_connect_s: float = Field(default=5.0, gt=0)
    """How long a CLI verb waits for a Redis it has not reached yet before it stops with an error
    that names the server: a server that was never up is a wrong URL or a server not started, not
    an outage to ride out. Once the verb has reached Redis, outages are ridden out for
    `EMBEDFLEET_REDIS_RETRY_S`. The `Producer` library waits `EMBEDFLEET_REDIS_RETRY_S` in both
    cases unless given `first_contact_s`."""
    redis_socket_timeout_s: float = Field(default=5.0, gt=0)
    """How late a Redis reply may come, beyond the longest blocking time the connection's commands
    ask for (`XREADGROUP BLOCK` of EMBEDFLEET_BLOCK_MS, a query's BLPOP, which waits at most that
    long per call, `WAIT` of EMBEDFLEET_MIN_REPLICAS_TIMEOUT_MS), before the connection is dropped
    and the call fails as a transient fault, retried like an outage: a hung server (a stopped
    process, a blackholed failover, a stalled fork) is never waited on for ever. A caller with a
    deadline (a query's timeout, a gateway request) gives up at its deadline, whichever is first."""
    redis_cleanup_timeout_s: float = Field(default=0.5, gt=0)
    """How long the clean-up after a query that timed out or was cancelled (withdrawing its
    entries, deleting its reply key) may wait on Redis; past it the workers skip the entries
    (they are past their deadline) and the reply key expires, so the caller's timeout holds."""

    @field_validator("namespace", "group")
    @classmethod
    def _no_spaces(cls, value: str) -> str:
        if not value or any(ch.isspace() for ch in value):
            raise ValueError("must be non-empty and contain no whitespace")
        return value

    @field_validator("partition_set")
    @classmethod
    def _partition_list(cls, value: str) -> str:
        parse_partition_set(value, MAX_PARTITIONS)  # the syntax; the range is checked below
        return value

    @model_validator(mode="after")
    def _partitions_agree(self) -> Self:
        if self.partitions > 1 and ("{" in self.namespace or "}" in self.namespace):
            raise ValueError(
                "EMBEDFLEET_NAMESPACE must not hold a hash tag when EMBEDFLEET_PARTITIONS > 1: "
                "each partition brings its own (a tag in the namespace would put them all in "
                "one slot)"
            )
        try:
            parse_partition_set(self.partition_set, self.partitions)
        except ValueError as error:
            raise ValueError(f"EMBEDFLEET_PARTITION_SET: {error}") from None
        return self

    @property
    def read_partitions(self) -> list[int]:
        """The partitions this worker reads (EMBEDFLEET_PARTITION_SET, or all)."""
        return parse_partition_set(self.partition_set, self.partitions) or list(
            range(self.partitions)
        )

    @property
    def cluster(self) -> bool:
        """Whether to use the cluster client (the setting or the URL's scheme says so)."""
        return split_cluster_url(self.effective_redis_url, self.redis_cluster)[1]

    @property
    def effective_redis_url(self) -> str:
        return self.redis_url or "redis://localhost:6379/0"


def parse_partition_set(value: str, partitions: int) -> list[int]:
    """``0,2,4-5`` → [0, 2, 4, 5]; each must be below ``partitions``."""
    chosen: set[int] = set()
    for part in filter(None, (item.strip() for item in value.split(","))):
        first, _, last = part.partition("-")
        try:
            low, high = int(first), int(last or first)
        except ValueError:
            raise ValueError(f"{part!r} is not a partition number or range like 4-5") from None
        if not 0 <= low <= high < partitions:
            raise ValueError(
                f"partition {part} does not exist: EMBEDFLEET_PARTITIONS={partitions} numbers "
                f"them 0 to {partitions - 1}"
            )
        chosen.update(range(low, high + 1))
    return sorted(chosen)
