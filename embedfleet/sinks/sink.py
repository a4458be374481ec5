"""The sink interface, and the acknowledgement every sink ends a write with.

The acknowledgement belongs to the sink because only the sink knows when a write is durable.
For the Redis results stream, write and acknowledgement happen in one MULTI/EXEC round trip.
A database sink upserts first and acknowledges after the database has committed: if the worker
dies in between, the entries are redelivered and upserted again under the same ids, so the
database never holds a duplicate and never misses a vector.
"""

from __future__ import annotations

import abc
import asyncio
import operator
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import KW_ONLY, dataclass, field
from typing import TypeVar

import msgpack
import redis
import redis.asyncio as aioredis

from embedfleet.shared import scripts
from embedfleet.shared.fault_kinds import System
from embedfleet.shared.keys import Keys
from embedfleet.shared.migrations import dual_writes_of, queue_copies
from embedfleet.shared.protocol import Result
from embedfleet.sinks.backend import (
    NO_EXTRAS,
    Extras,
    SinkSetupError,
    VectorBackend,
    VectorDType,
)

T = TypeVar("T")
__all__ = [
    "DatabaseSink",
    "Delivery",
    "Sink",
    "SinkSetupError",
    "latest_per_id",
    "queue_acknowledgements",
]


@dataclass(frozen=True)
class Delivery:
    """A stream entry being answered: where it came from, so it can be acknowledged."""

    stream: str
    entry_id: str
    job: str | None
    # accounting (issue 30): the chunk's tenant (None: its stream's, else the default), the
    # worker's model, the tokens embedded and the model time they took, in microseconds
    tenant: str | None = None
    model: str = ""
    tokens: int = 0
    model_us: int = 0
    # a live migration's copy (its entry carries shared/migrations.py's COPIED_FROM): written,
    # never copied again, so a dual write that goes both ways does not send it back
    copy: bool = False

    def accounted(self, model: str, tokens: int, model_us: int) -> Delivery:
        """This delivery with what its acknowledgement accounts: ``Delivery(stream, entry_id,
        job, tenant, model, tokens, model_us, copy)``, the same object, made by copying the
        fields' dict: a frozen dataclass's __init__ sets each field through
        object.__setattr__, which cost 1.7 µs a text on the worker's event loop, this 0.7
        (issue 53). Delivery has no __post_init__ or __slots__ for this to skip."""
        fields = self.__dict__.copy()
        fields["model"], fields["tokens"], fields["model_us"] = model, tokens, model_us
        made = object.__new__(Delivery)
        object.__setattr__(made, "__dict__", fields)
        return made


class Sink(abc.ABC):
    """The sink interface: write results and acknowledge their entries, durably, together.

    The worker's owner calls ``setup(model, dim)`` once after the model loads, the worker calls
    ``write`` per micro-batch, and ``close`` on shutdown. ``write`` raising means nothing was
    acknowledged; what the worker does next depends on the kind of fault (shared/fault_kinds.py):
    waits out an outage, splits the batch to isolate a refused row, or exits. A sink only
    raises its library's own errors and says which system it is (``system``), so a builtin
    ``TimeoutError`` is filed under the right database.
    """

    system: System = System.UNKNOWN

    def stalled(self) -> str | None:
        """What is wrong when a call to the database has outlived its bound (the worker's
        /healthz turns red on it: only a restart frees a connection the server no longer
        answers), else None. The Redis sink's calls are bounded by the connection itself."""
        return None

    async def setup(  # noqa: B027 - optional hook
        self, model: str, dim: int, extras: Extras = NO_EXTRAS
    ) -> None:
        """Create the collection/table if missing, with the model's dimension (and the sparse
        and per-token vectors of a multi-representation model, ``extras``)."""

    @abc.abstractmethod
    async def write(self, results: Sequence[Result], deliveries: Sequence[Delivery]) -> None:
        """Store ``results`` and only then acknowledge ``deliveries`` (same order, same length)."""

    def holding(self) -> Iterable[Delivery]:
        """The deliveries written to this sink and not yet acknowledged. A sink that
        acknowledges after ``write`` returns (the Parquet sink, per stored shard) holds them
        meanwhile, however long its store is down, and the worker keeps renewing their leases
        until they leave this set: an entry the worker let go idle would be claimed back,
        embedded again every reclaim period and dead-lettered for an outage. Default: none
        (``write`` acknowledges before it returns)."""
        return ()

    def holds(self, stream: str, entry_id: str) -> bool:
        """Whether ``holding()`` has this entry (asked per entry the reclaimer claims)."""
        return False

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the default sink has nothing of its own."""


# XACK + XDEL + job counter + the answer, for what this call really acknowledged
ACK_SCRIPT = scripts.load("acknowledge")  # shared/scripts/acknowledge.lua


def queue_acknowledgement_script(
    pipe: aioredis.client.Pipeline | redis.client.Pipeline,
    keys: Keys,
    deliveries: Sequence[Delivery],
    counter: str,
    replies: Sequence[str],
    payloads: Sequence[bytes],
    reply_ttl_s: int = 0,
) -> None:
    """One acknowledge.lua call per stream of ``deliveries``: each entry acknowledged, counted
    in ``counter`` of its job and in the key set's usage (tenant, model, tokens, model time:
    the delivery's), and its payload ('' for none) pushed to its reply list ('' for
    none: to the results stream), only if this call acknowledged it.

    EVAL by name, not pipe.eval(): redis-py's blocking cluster pipeline (the query stage's answers
    on a Redis Cluster) implements no eval(), and routes EVAL by its keys."""
    if not len(deliveries) == len(replies) == len(payloads):
        raise ValueError(
            f"{len(deliveries)} deliveries, {len(replies)} replies, {len(payloads)} payloads"
        )
    for stream, rows in _rows_by_stream(deliveries):
        owner = keys.owner_of(stream)  # its partition's key set, or the priority streams'
        if rows is None:  # every entry is of this stream (a batch's usual case)
            entries = _entries_argument(keys, stream, deliveries, replies, payloads)
        else:
            entries = _entries_argument(
                keys,
                stream,
                [deliveries[row] for row in rows],
                [replies[row] for row in rows],
                [payloads[row] for row in rows],
            )
        pipe.execute_command(
            "EVAL",
            ACK_SCRIPT,
            3,
            stream,
            owner.results,
            owner.usage,
            owner.group,
            counter,
            owner.job(""),
            owner.reply(""),
            str(reply_ttl_s),
            owner.job_ids(""),
            entries,
        )


_STREAM, _ENTRY_ID, _MODEL, _TOKENS, _MODEL_US = (
    operator.attrgetter(name) for name in ("stream", "entry_id", "model", "tokens", "model_us")
)


def _rows_by_stream(deliveries: Sequence[Delivery]) -> list[tuple[str, list[int] | None]]:
    """Each stream of ``deliveries`` in order of first appearance, with the rows of its entries
    (None: all of them, the one stream of the batch)."""
    streams = list(map(_STREAM, deliveries))
    if len(set(streams)) <= 1:
        return [(streams[0], None)] if streams else []
    by_stream: dict[str, list[int]] = {}
    for row, stream in enumerate(streams):
        by_stream.setdefault(stream, []).append(row)
    return list(by_stream.items())


# the values acknowledge.lua reads per entry (its ARGV[7])
ENTRY_VALUES = 8


def _entries_argument(
    keys: Keys,
    stream: str,
    deliveries: Sequence[Delivery],
    replies: Sequence[str],
    payloads: Sequence[bytes],
) -> bytes:
    """acknowledge.lua's ARGV[7] for entries of ``stream``: eight values per entry (entry id,
    job or '', reply, payload, tenant, model, tokens, model microseconds) as one msgpack array,
    bytes as msgpack's raw strings (Redis's cmsgpack refuses the bin types; a Lua string holds
    any bytes). Built column by column into one flat list (issue 53: no list per entry)."""
    # the chunk's own tenant, else its stream's ('': the default tenant's stream)
    stream_tenant = keys.tenant_of(stream) or ""
    flat: list[str | bytes | int] = [""] * (ENTRY_VALUES * len(deliveries))
    flat[0::ENTRY_VALUES] = map(_ENTRY_ID, deliveries)
    flat[1::ENTRY_VALUES] = [delivery.job or "" for delivery in deliveries]
    flat[2::ENTRY_VALUES] = replies
    flat[3::ENTRY_VALUES] = payloads
    flat[4::ENTRY_VALUES] = [delivery.tenant or stream_tenant for delivery in deliveries]
    flat[5::ENTRY_VALUES] = map(_MODEL, deliveries)
    flat[6::ENTRY_VALUES] = map(int, map(_TOKENS, deliveries))
    flat[7::ENTRY_VALUES] = map(int, map(_MODEL_US, deliveries))
    return msgpack.packb(flat, use_bin_type=False)


def queue_acknowledgements(
    pipe: aioredis.client.Pipeline | redis.client.Pipeline,
    keys: Keys,
    deliveries: Sequence[Delivery],
    counter: str,
    payloads: Sequence[bytes] | None = None,
) -> None:
    """XACK and XDEL the entries (acknowledged entries must not pile up) and count per job;
    with ``payloads``, XADD each entry's result to the results stream, only if it was acked.

    Deleting only delivered, acknowledged entries keeps the group's lag exact, which KEDA reads.
    Works on an asyncio or a blocking pipeline (the query stage replies from the model thread).
    """
    no_replies = [""] * len(deliveries)  # the answers, if any, go to the results stream
    answers = payloads if payloads is not None else [b""] * len(deliveries)
    queue_acknowledgement_script(pipe, keys, deliveries, counter, no_replies, answers)


def acknowledgement_pipeline(client: aioredis.Redis, keys: Keys) -> aioredis.client.Pipeline:
    """MULTI/EXEC with one partition. With several, a plain pipeline: a cluster runs a
    transaction only within one slot, and each stream's script is atomic on its own (a batch
    acknowledged in part is written again and its acknowledged part counted once)."""
    return client.pipeline(transaction=not keys.partitioned)


def latest_per_id(results: Sequence[Result]) -> list[Result]:
    """One result per id, the last one written winning.

    A batch can hold an id twice (a chunk re-sent before the first copy was read); an upsert
    statement that meets the same key twice is refused by LanceDB and PostgreSQL alike.
    """
    latest = {result.id: result for result in results}
    return list(latest.values())


# A database call's bound, in statement timeouts: its statements (a COPY and an upsert), and
# as long again for connecting and the round trips
CALL_BOUND_STATEMENTS = 3


@dataclass(eq=False)
class DatabaseSink(Sink):
    """A sink that upserts into a vector database through its backend, then acknowledges.

    The database's own code (layout, SQL, client) is in its ``embedfleet.sinks`` backend module;
    this class only runs it. The blocking client libraries run on one dedicated thread
    (``_blocking``), so the worker's event loop keeps reading and a client is never used from
    two threads at once. ``dtype`` is what the vectors are stored as (None: the backend's
    default, float16 where the database has it).
    """

    client: aioredis.Redis
    keys: Keys
    backend: VectorBackend
    _: KW_ONLY
    dtype: VectorDType | None = None
    # which database a builtin TimeoutError or OSError of this sink came from (the backend's)
    system: System = field(init=False)
    _thread: ThreadPoolExecutor | None = field(default=None, init=False)
    # when the call now running on the sink's thread began (None: none is)
    _call_started: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.system = self.backend.system

    @property
    def call_bound_s(self) -> float | None:
        """How long one call may run: its statements (a COPY and an upsert, each under the
        statement timeout) and as long again for connecting and the round trips; None without
        a statement bound."""
        timeout = self.backend.statement_timeout_s
        return None if timeout is None else CALL_BOUND_STATEMENTS * timeout

    def stalled(self) -> str | None:
        started, bound = self._call_started, self.call_bound_s
        if started is None or bound is None:
            return None
        running = time.monotonic() - started
        if running <= bound:
            return None
        return (
            f"a {self.system} call has run for {running:.1f}s, past its bound of {bound:g}s "
            f"({CALL_BOUND_STATEMENTS} x EMBEDFLEET_SINK_STATEMENT_TIMEOUT_S): the database no "
            "longer answers this connection"
        )

    async def setup(self, model: str, dim: int, extras: Extras = NO_EXTRAS) -> None:
        if self.dtype is not None and self.dtype not in self.backend.DTYPES:
            raise SinkSetupError(
                f"EMBEDFLEET_OUTPUT_DTYPE={self.dtype}: {self.backend.target.describe()} stores "
                f"{', '.join(self.backend.DTYPES)} vectors natively, not {self.dtype}; choose "
                "one of those, or another sink (the Redis sink carries every dtype)"
            )
        await self._blocking(self.backend.setup, model, dim, self.dtype, extras)

    async def write(self, results: Sequence[Result], deliveries: Sequence[Delivery]) -> None:
        if len(results) != len(deliveries):
            raise ValueError("one delivery per result")
        rows = latest_per_id(results)
        if rows:
            await self._blocking(self.backend.upsert, rows)
        # a live migration of this table (shared/migrations.py): read after the upsert, so a
        # row the migration's scan may have missed is copied to the other model's lane
        duals = (
            await dual_writes_of(self.client, self.keys, self.backend.target.table) if rows else []
        )
        pipe = acknowledgement_pipeline(self.client, self.keys)
        if duals:
            # the latest delivery of each id decides, as latest_per_id does
            was_copy = {result.id: d.copy for result, d in zip(results, deliveries, strict=True)}
            copies = {row_id for row_id, copy in was_copy.items() if copy}
            for dual in duals:
                queue_copies(pipe, dual, rows, copies)
        queue_acknowledgements(pipe, self.keys, deliveries, counter="done")
        await pipe.execute()

    async def _blocking(self, function: Callable[..., T], *args: object) -> T:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sink")
        return await asyncio.get_running_loop().run_in_executor(
            self._thread, self._timed, function, *args
        )

    def _timed(self, function: Callable[..., T], *args: object) -> T:
        """``function(*args)`` on the sink's thread, its start kept for ``stalled``."""
        self._call_started = time.monotonic()
        try:
            return function(*args)
        finally:
            self._call_started = None

    async def close(self) -> None:
        await self._blocking(self.backend.close)
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
