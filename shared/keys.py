"""Every Redis key embedfleet touches, in one place (the arq way).

All keys start with one namespace. With one partition (the default) the keys are
``{ns}:ingest``, ``{ns}:results``, ... as they have always been; put a hash tag in the namespace
(``{embedfleet}``) and every key of the deployment lands on one shard of a Redis Cluster.

With ``EMBEDFLEET_PARTITIONS=N > 1`` each partition has its own ingest, results and dead-letter
streams, job counters and jobs index, all under one hash tag of its own
(``{ns}:{p3of6.57}:ingest``), so every multi-key command and Lua script stays inside one slot.
The tags are searched so that partition ``i`` hashes into the middle of the ``i``-th of ``N``
equal shares of the 16384 slots: a cluster whose masters hold equal slot ranges then gets the
partitions spread evenly (plain ``{p0}``..``{p5}`` put 4 of 6 on one master of three). The priority
streams (query stream, the interactive stream, their reply keys and dead letters) have a key
set of their own, ``{ns}:{q}:...``, and so have the gateway's Batch API records, ``{ns}:{b}:...``. A
chunk's partition is ``crc32(utf-8 id) mod N``: any language can route.
"""

from __future__ import annotations

import functools
import re
import zlib
from dataclasses import dataclass, replace

from embedfleet.shared.batch_keys import BatchKeys

DEFAULT_NAMESPACE = "embedfleet"
DEFAULT_GROUP = "workers"
# the group consuming results readers read each results stream through (producer/results_reader.py)
RESULTS_GROUP = "results-readers"
CLUSTER_SLOTS = 16384
MAX_PARTITIONS = 256
PRIORITY_TAG = "q"
# a model lane's name (``model`` in chunks, queries and requests): no ':' or braces, so it can
# neither forge another lane's keys nor add a hash tag
MODEL_LANE_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")
# a tenant's name (``tenant`` in chunks, EMBEDFLEET_TENANT_WEIGHTS, the usage fields): no ':',
# '|' or braces, so it can neither forge another key nor split a usage field
TENANT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# what separates the parts of a usage hash field: ``<counter>|<tenant>|<model>|<job>``
USAGE_SEPARATOR = "|"
# the infix of a named tenant's ingest stream: ``<prefix>:ingest:t:<tenant>``
TENANT_STREAM_INFIX = ":ingest:t:"


class PartitionedKeyError(LookupError):
    """A per-partition key was asked of the fleet-wide key set of a partitioned deployment."""


def _crc16_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) & 0xFFFF if crc & 0x8000 else (crc << 1) & 0xFFFF
        table.append(crc)
    return tuple(table)


_CRC16_TABLE = _crc16_table()


def crc16(data: bytes) -> int:
    """CRC16-CCITT (XMODEM), the hash Redis Cluster maps keys to slots with."""
    crc = 0
    for byte in data:
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16_TABLE[(crc >> 8) ^ byte]
    return crc


def key_slot(key: str | bytes) -> int:
    """The cluster slot of a key, as ``CLUSTER KEYSLOT`` computes it (hash tags included)."""
    data = key.encode() if isinstance(key, str) else key
    start = data.find(b"{")
    if start != -1:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    return crc16(data) % CLUSTER_SLOTS


def slot_range(index: int, count: int) -> tuple[int, int]:
    """The ``index``-th of ``count`` equal shares of the slot space: [first, end)."""
    return index * CLUSTER_SLOTS // count, (index + 1) * CLUSTER_SLOTS // count


@functools.cache
def partition_tag(index: int, count: int) -> str:
    """The hash tag of partition ``index`` of ``count``: its slot lies in the middle half of the
    partition's share of the slot space, so it stays on the intended master even when a
    cluster's slot boundaries are not exactly at the shares' edges."""
    if not 0 <= index < count <= MAX_PARTITIONS:
        raise ValueError(f"partition {index} of {count} does not exist")
    first, end = slot_range(index, count)
    width = end - first
    low, high = first + width // 4, max(first + width // 4 + 1, end - width // 4)
    suffix = 0
    while True:
        tag = f"p{index}of{count}.{suffix}"
        if low <= crc16(tag.encode()) % CLUSTER_SLOTS < high:
            return tag
        suffix += 1


def partition_of(chunk_id: str, count: int) -> int:
    """The partition a chunk id routes to: stable across processes, versions and languages."""
    return 0 if count == 1 else zlib.crc32(chunk_id.encode()) % count


@dataclass(frozen=True)
class Keys(BatchKeys):
    """Key names for one namespace. Build it once from settings and pass it around.

    The fleet's ``Keys`` (``tag`` None) names the keys directly when there is one partition.
    With more, ask it for a partition's key set (``partition(i)``, ``partition_for(id)``,
    ``partitions_keys``) or the priority streams' (``priority_streams``); asking the fleet-wide
    set for a per-partition key raises, so no code path can silently write to an unread key.
    The Batch API's keys (``batch``, ``batches``, ...) come from ``BatchKeys``
    (shared/batch_keys.py).
    """

    namespace: str = DEFAULT_NAMESPACE
    group: str = DEFAULT_GROUP
    partitions: int = 1
    tag: str | None = None  # this key set's hash tag; None for the fleet-wide set
    # the model lane these keys serve (issue 30: several models in one namespace); None = the
    # namespace's default model, whose keys are the namespace's own as they have always been
    model_lane: str | None = None

    def __post_init__(self) -> None:
        if self.model_lane is not None and not MODEL_LANE_PATTERN.fullmatch(self.model_lane):
            raise ValueError(
                f"model lane {self.model_lane!r} is not a valid name: letters, digits and "
                "'.', '_', '/', '-' only, starting with a letter or digit, at most 128"
            )

    # --- the key sets ---------------------------------------------------------------------
    def for_model(self, model_lane: str | None) -> Keys:
        """The key set of one model lane of this namespace: its own streams, groups, job
        counters, model card and heartbeats under ``{ns}:m:<lane>``, partitioned as the
        namespace is. ``None`` is the namespace's default model (the keys without a lane)."""
        return replace(self, model_lane=model_lane, tag=None)

    @property
    def models(self) -> str:
        """Hash of the model lanes served in this namespace (lane -> its model card's key),
        written by each lane's workers at start: what /v1/models lists and the gateway routes
        by. Fleet-wide: one key whatever the lane or partition."""
        return f"{self.namespace}:models"

    def migration(self, table: str) -> str:
        """Hash of the live migration of the vector table ``table`` to another model
        (``embedfleet migrate``, embedfleet/ops/migration.py): the target lane and table, the alias
        readers follow, the copy's cursor (resumable after a crash) and its measured rates.
        While it holds ``dual_write``, every database sink writing ``table`` also enqueues what
        it wrote to the target lane, so new chunks land in both tables. Fleet-wide: one key
        whatever the lane or partition (read with one HMGET per write)."""
        return f"{self.namespace}:migration:{table}"

    @property
    def migration_targets(self) -> str:
        """Hash of a live migration's target table -> its source table (``migration(source)``
        holds the record), written by ``embedfleet migrate start`` and removed by ``finish``:
        a database sink writing the target table finds there whether it copies back to the
        source lane (shared/migrations.py)."""
        return f"{self.namespace}:migration_targets"

    @property
    def table_lanes(self) -> str:
        """Hash of vector table -> the model lane that writes it ('' for the default lane),
        written by ``embedfleet migrate``: ``embedfleet search`` resolves an alias to its table
        and embeds the query with that table's model, so a query never mixes two models."""
        return f"{self.namespace}:tables"

    @property
    def _lane_namespace(self) -> str:
        return (
            self.namespace if self.model_lane is None else f"{self.namespace}:m:{self.model_lane}"
        )

    @property
    def partitioned(self) -> bool:
        return self.partitions > 1

    def partition(self, index: int) -> Keys:
        """Partition ``index``'s keys (the fleet's own keys when there is one partition)."""
        if not self.partitioned:
            if index != 0:
                raise ValueError(f"partition {index} of 1 does not exist")
            return self
        return replace(self, tag=partition_tag(index, self.partitions))

    @functools.cached_property
    def partitions_keys(self) -> tuple[Keys, ...]:
        """Every partition's key set, in partition order."""
        fleet = replace(self, tag=None)
        return tuple(fleet.partition(index) for index in range(self.partitions))

    def partition_for(self, chunk_id: str) -> Keys:
        """The key set of the partition a chunk id routes to."""
        return self.partitions_keys[partition_of(chunk_id, self.partitions)]

    @property
    def priority_streams(self) -> Keys:
        """The query stream, reply keys and the priority streams' dead letters, in one slot."""
        return replace(self, tag=PRIORITY_TAG) if self.partitioned else self

    @property
    def index(self) -> int:
        """This set's partition number (0 with one partition); -1 for the priority streams."""
        if not self.partitioned:
            return 0
        if self.tag == PRIORITY_TAG:
            return -1
        return next(i for i, keys in enumerate(self.partitions_keys) if keys.tag == self.tag)

    def owner_of(self, stream: str) -> Keys:
        """The key set a stream (an ingest stream, a tenant's, or a query stream) belongs to."""
        owner = self._owners.get(stream)
        if owner is not None:
            return owner
        for keys in self.partitions_keys:
            if stream.startswith(keys.prefix + TENANT_STREAM_INFIX):
                return keys
        raise KeyError(stream)

    @functools.cached_property
    def _owners(self) -> dict[str, Keys]:
        owners = {keys.ingest: keys for keys in self.partitions_keys}
        owners[self.priority_streams.query] = self.priority_streams
        owners[self.priority_streams.interactive] = self.priority_streams
        return owners

    @property
    def prefix(self) -> str:
        lane = self._lane_namespace
        return lane if self.tag is None else f"{lane}:{{{self.tag}}}"

    def _key(self, suffix: str) -> str:
        if self.partitioned and self.tag is None:
            raise PartitionedKeyError(
                f"{suffix!r} is a per-partition key with EMBEDFLEET_PARTITIONS={self.partitions}: "
                "take it from keys.partition(i), keys.partition_for(chunk_id) "
                "or keys.priority_streams"
            )
        return f"{self.prefix}:{suffix}"

    # --- the keys of one set ----------------------------------------------------------------
    @property
    def ingest(self) -> str:
        """Stream of bulk chunks, read by workers through the consumer group."""
        return self._key("ingest")

    def ingest_for(self, tenant: str | None) -> str:
        """The ingest stream of one tenant in this key set (issue 30's fair share): the default
        tenant's (``None``) is the plain ``ingest`` stream, as it has always been (what any
        language's XADD writes to); a named tenant's is ``<prefix>:ingest:t:<tenant>``, in the
        same hash slot, registered in ``tenants`` by the producer that first writes to it."""
        if tenant is None:
            return self.ingest
        if not TENANT_PATTERN.fullmatch(tenant):
            raise ValueError(f"tenant {tenant!r} is not a valid name")
        return self._key(f"ingest:t:{tenant}")  # the infix is TENANT_STREAM_INFIX

    def tenant_of(self, stream: str) -> str | None:
        """The named tenant whose ingest stream ``stream`` is; None for any other stream (the
        plain ingest stream is the default tenant's)."""
        at = stream.rfind(TENANT_STREAM_INFIX)
        return None if at < 0 else stream[at + len(TENANT_STREAM_INFIX) :]

    @property
    def tenants(self) -> str:
        """Set of the named tenants that have an ingest stream in this key set (the registry
        the workers read their streams from; written with the group by register_tenant.lua).
        Members stay when a stream empties: an empty stream costs a reader one XLEN."""
        return self._key("tenants")

    @property
    def usage(self) -> str:
        """Hash of the accounting counters of what this key set's entries used, written by the
        acknowledgement script with the job counters: fields
        ``<counter>|<tenant>|<model>|<job>`` (counter: ``chunks``, ``tokens``, ``model_us``,
        ``dead``, ``expired``; tenant empty = the default tenant, job empty = no job)."""
        return self._key("usage")

    def tenant_rate(self, tenant: str) -> str:
        """Hash of ``tenant``'s token bucket over the whole lane (fields ``tokens``, ``at_us``;
        EMBEDFLEET_TENANT_TOKEN_RATE), which every worker reserves its reads from through
        token_rate.lua; it expires once full again. One key for every partition (the script
        touches only it: any slot)."""
        return f"{self._lane_namespace}:tenantrate:{tenant}"

    @property
    def query(self) -> str:
        """Stream of priority single queries, read before every bulk batch."""
        return self._key("query")

    @property
    def interactive(self) -> str:
        """Stream of the inputs of large interactive requests (the gateway's requests over
        EMBEDFLEET_GATEWAY_LANE_MAX_INPUTS inputs): read by the bulk reader before any ingest
        stream, so a request someone waits on never queues behind a bulk backlog, while the
        query stream keeps its few-input answers ahead of it. In the priority streams' key set: its
        entries answer on reply keys of that set (``priority_streams.reply``), in the same slot."""
        return self._key("interactive")

    @property
    def results(self) -> str:
        """Stream of embedding results (msgpack, fp16 vectors) written by the Redis sink."""
        return self._key("results")

    @property
    def results_group(self) -> str:
        """Consumer group the consuming results readers (``embedfleet results --consume``,
        ``Producer.results(consume=True)``) read every results stream through; each result they
        acknowledge is deleted from the stream."""
        return RESULTS_GROUP

    @property
    def dead(self) -> str:
        """Dead-letter stream: entries that could not be embedded, with a readable reason."""
        return self._key("dead")

    def job(self, job_id: str) -> str:
        """Hash of a job's counters: ``enqueued``, ``done``, ``dead`` (per partition)."""
        return self._key(f"job:{job_id}")

    def job_ids(self, job_id: str) -> str:
        """Hash of the chunk ids a job has enqueued (id -> digest of the payload sent, then the
        token of the enqueue batch that added it: each batch of an enqueue call has its own, the
        same for every re-send of that batch).

        The enqueue script reads it so that a re-sent chunk is added and counted once. Its own
        prefix (not ``job:<job>:ids``) so that no job name can collide with another's counters.
        """
        return self._key(f"jobids:{job_id}")

    @property
    def vector_cache(self) -> str:
        """Hash of the vector cache (issue 31): content key -> the stored result, packed
        (shared/vector_cache.py). Per partition, so each partition's chunks are looked up in
        their own slot; bounded by EMBEDFLEET_VECTOR_CACHE_MB (its store script,
        shared/scripts/vector_cache_put.lua)."""
        return self._key("vcache")

    @property
    def vector_cache_lru(self) -> str:
        """Sorted set of the vector cache's content keys by their last use (unix ms): the
        store script evicts from its low end past the bound or the idle TTL."""
        return self._key("vcache:lru")

    @property
    def vector_cache_stats(self) -> str:
        """Hash of the vector cache's counters: ``hits``, ``misses``, ``tokens_saved`` (the
        hits' tokens, not computed), ``bytes`` (held now) and ``evicted``."""
        return self._key("vcache:stats")

    def replayed(self, dead_id: str) -> str:
        """What a dead-letter replay leaves for a while (the replaying command's token and the
        new entry's id), so that a replay whose reply was lost can be sent again exactly."""
        return self._key(f"replayed:{dead_id}")

    def reply(self, request_id: str) -> str:
        """List a request's caller collects its answers from (producer/replies.py); it expires
        if the caller has gone. Queries and interactive requests use the priority streams'; a chunk
        of the ingest stream with a ``reply`` (a Batch API batch) answers on its partition's."""
        return self._key(f"reply:{request_id}")

    @property
    def jobs_index(self) -> str:
        """Set of known job ids, so ``embedfleet status`` can list them (per partition)."""
        return self._key("jobs")

    @property
    def model(self) -> str:
        """Hash a worker writes at start: the model card (shared/modelcard.py: name, dim,
        max_length, normalize, prompts, ...), the one source producers and the gateway read the
        model's facts from. One for the fleet, partitions or not (a single key: any slot)."""
        return f"{self._lane_namespace}:model"

    @property
    def tokenizer(self) -> str:
        """String a lane's workers write at start beside the model card: the model's
        ``tokenizer.json``, zlib-compressed (shared/model_registry.py), so a gateway counts and
        checks tokens for every model of the namespace without the models' files."""
        return f"{self._lane_namespace}:tokenizer"

    def calibration(self, model: str, variant: str) -> str:
        """int8/uint8 calibration ranges of ``model`` for one dimension variant (JSON; ``384``,
        ``64``, ``64-raw``): written once, by the first worker that needs them or from
        ``EMBEDFLEET_CALIBRATION_FILE``, then shared (workers/calibration.py)."""
        return f"{self.namespace}:calibration:{model}:{variant}"

    @property
    def workers_alive(self) -> str:
        """Sorted set of worker consumer names scored by their last heartbeat (unix ms): what
        the gateway reads to say, in a timeout's message and on /readyz, that no worker is
        alive (it enqueues all the same: KEDA starts one). (XINFO CONSUMERS cannot tell:
        before Redis 7.2 a consumer that has read nothing yet is not listed at all.)"""
        return f"{self._lane_namespace}:workers"


CHART_PARTITIONS = 64  # the Helm chart carries the tags of up to this many partitions


def chart_tag_table() -> str:
    """The Helm chart's ``files/partition-tags.json`` (Helm templates cannot search CRC16
    tags): for each partition count 2..64, every partition's hash tag. A test checks it."""
    import json

    table = {
        str(count): [partition_tag(index, count) for index in range(count)]
        for count in range(2, CHART_PARTITIONS + 1)
    }
    return json.dumps(table, separators=(",", ":")) + "\n"


if __name__ == "__main__":
    print(chart_tag_table(), end="")
