"""The worker loop: read → decode → tokenize → sort and batch → encode → write + ack.

Three bulk tasks joined by bounded queues (Infinity's shape), so Redis I/O, tokenization and
the forward pass overlap while memory stays bounded:

    reader   (workers/intake.py) XREADGROUP (and reclaimed entries); on the
             tokenizer thread decode and validate; look each chunk's content key
             up in the vector cache (shared/vector_cache.py: a hit's result is
             made from the stored vector and skips the model); on the tokenizer
             thread again tokenize the rest, sort by length, plan batches by
             token budget and collate them into host buffers; dead-letter bad
             input (on the event loop)                                          → windows
    compute  launch each batch on the model thread (workers/bulk.py: padded or
             varlen; on CUDA batch i+1 is queued before batch i is collected);
             on a CPU queries get in between transformer layers (or, through the
             frozen and int8 copies, between batches), and batches are sized from
             a cost model of each path so that a query waits at most one slice
             (workers/cost_model.py); before a batch,
             the interactive stream's new entries (large requests someone waits
             on) are read and encoded first                                     → encoded
    writer   fp16 results to the sink, XACK in the same round trip (workers/write.py)

Beside them: the query lane (workers/queries.py) and the reclaimer (workers/reclaim.py).

Shutdown (arq's two modes): ``drain()`` stops reading and lets in-flight work finish and be
acknowledged; cancelling ``run()`` aborts at once and leaves entries pending for others.

The stages run in one ``asyncio.TaskGroup``: when one fails, the worker drains what the stages
after it can still finish, then ``run()`` raises and the process exits non-zero for its
supervisor to restart it. Nothing half-alive keeps holding entries.

Faults (shared/fault_kinds.py): transient ones (Redis or the database away) are waited out by each
stage with capped backoff and show on /readyz; a row the database refuses is isolated by
splitting its batch and dead-lettered alone; a fault that is permanent for the worker ends
``run()`` with a ``WorkerFault`` naming the setting to fix.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from embedfleet.shared.dead_letters import DeadReason
from embedfleet.shared.fault_kinds import System
from embedfleet.shared.keys import Keys
from embedfleet.shared.logging import get_logger
from embedfleet.shared.model_registry import register_model
from embedfleet.shared.modelcard import publish_card
from embedfleet.shared.settings import Settings
from embedfleet.shared.vector_cache import VectorCache
from embedfleet.sinks import Delivery, Sink
from embedfleet.workers.batcher import PlannedBatch
from embedfleet.workers.bulk import BulkBatch, BulkForward, LaunchAhead, Launched, resolve_layout
from embedfleet.workers.calibration import Calibration, CalibrationStore
from embedfleet.workers.consumer import StreamConsumer, StreamEntry
from embedfleet.workers.cost_model import BulkPath, Shape, SliceClock, SliceCost, SliceLimit
from embedfleet.workers.dead_letter_writer import DeadLetters, Rejected
from embedfleet.workers.device_faults import (
    DeviceFault,
    Recovery,
    free_device_memory,
    is_device_fault,
    is_out_of_memory,
    oom_retry_pause_s,
    recovery,
)
from embedfleet.workers.events import ForwardingEvents, WorkerEvents
from embedfleet.workers.heartbeat import run_heartbeat
from embedfleet.workers.intake import Intake, Prepared, Window, first_set
from embedfleet.workers.memory import TrimTimer, release_free_memory
from embedfleet.workers.model.encoder import EncodeBatch, Encoder, Tokenized
from embedfleet.workers.model.precision import BULK_PROBE_TEXTS, PROBE_TEXTS
from embedfleet.workers.outages import (
    Outages,
    RideOut,
    ride_out,
    transient_or_raise,
)
from embedfleet.workers.output import Outputs
from embedfleet.workers.queries import QueryLane
from embedfleet.workers.reclaim import InFlight, Reclaimer
from embedfleet.workers.write import Encoded, Writer

log = get_logger("embedfleet.worker")
# The bulk stages feed each other through bounded queues: a stage's upstream may be blocked on
# handing it work, so when the stage fails only the others are waited for.
_UPSTREAM = {"compute": ("reader",), "writer": ("reader", "compute")}
_END = None  # queue sentinel: the stage before has finished
SLICE_MS_AUTO = {"cpu": 100.0, "cuda": 20.0}
# The speed seed's probe batches (_seed_speed): a bulk-shaped batch, a small one (the fixed
# cost) and one of long texts (attention's cost per pair of tokens), so the cost model tells
# its three terms apart before the first window is planned.
SEED_SMALL_TEXTS = 8
SEED_LONG_TEXTS = 4
# The compute stage looks for interactive entries before a bulk batch at most this often: a
# request then waits about one batch, and a short-batch GPU pays one read per interval, not per
# batch.
URGENT_CHECK_S = 0.05


@dataclass
class InFlightBatch:
    """A launched batch with what the worker needs to finish it (or retry it)."""

    window: Window
    planned: PlannedBatch
    launched: Launched
    oom_retries: int
    query_seconds: float  # queries served inside the launch (not bulk time)
    path: BulkPath = "eager"
    slice_seconds: float = 0.0  # the launch's longest stretch between query boundaries (CPU)


@dataclass
class WorkerStats:
    """Counters a run reports; the benchmark and the metrics read them."""

    texts: int = 0  # results written (embedded or answered by the vector cache)
    embedded: int = 0  # texts that went through the model in bulk batches
    real_tokens: int = 0
    padded_tokens: int = 0
    batches: int = 0
    dead_letters: int = 0
    # the vector cache: chunks answered from it, chunks embedded, the hits' tokens not computed
    cache_hits: int = 0
    cache_misses: int = 0
    tokens_saved: int = 0
    model_seconds: float = 0.0
    started_at: float = field(default_factory=time.perf_counter)

    @property
    def padding_waste(self) -> float:
        return 0.0 if not self.padded_tokens else 1 - self.real_tokens / self.padded_tokens

    @property
    def model_busy_fraction(self) -> float:
        elapsed = time.perf_counter() - self.started_at
        return 0.0 if elapsed <= 0 else min(1.0, self.model_seconds / elapsed)


class _StatsEvents(ForwardingEvents):
    """Keeps WorkerStats current and forwards every event to the user's listener."""

    def __init__(self, stats: WorkerStats, listener: WorkerEvents) -> None:
        super().__init__(listener)
        self.stats = stats

    def batch_encoded(
        self, *, texts: int, real_tokens: int, padded_tokens: int, seconds: float
    ) -> None:
        self.stats.batches += 1
        self.stats.embedded += texts
        self.stats.real_tokens += real_tokens
        self.stats.padded_tokens += padded_tokens
        self.stats.model_seconds += seconds
        super().batch_encoded(
            texts=texts, real_tokens=real_tokens, padded_tokens=padded_tokens, seconds=seconds
        )
        self.listener.model_busy(fraction=self.stats.model_busy_fraction)

    def results_written(self, *, texts: int, seconds: float) -> None:
        self.stats.texts += texts
        super().results_written(texts=texts, seconds=seconds)

    def dead_lettered(self, *, count: int, reason: str) -> None:
        self.stats.dead_letters += count
        super().dead_lettered(count=count, reason=reason)

    def vector_cache_checked(self, *, hits: int, misses: int, tokens_saved: int) -> None:
        self.stats.cache_hits += hits
        self.stats.cache_misses += misses
        self.stats.tokens_saved += tokens_saved
        super().vector_cache_checked(hits=hits, misses=misses, tokens_saved=tokens_saved)


class Worker:
    def __init__(
        self,
        settings: Settings,
        encoder: Encoder,
        client: aioredis.Redis,
        sink: Sink,
        events: WorkerEvents | None = None,
    ) -> None:
        self.settings = settings
        self.keys: Keys = settings.keys
        self.encoder = encoder
        self.client = client
        self.sink = sink
        self.listener = events or WorkerEvents()
        self.stats = WorkerStats()
        self.events: WorkerEvents = _StatsEvents(self.stats, self.listener)
        self.consumer = StreamConsumer(
            client,
            self.keys,
            settings.consumer,
            partitions=settings.read_partitions,
            policy=settings.tenant_policy,
        )
        # what the reclaimer renews: the entries being computed, and those the sink holds
        # written and not yet acknowledged (a Parquet shard's, also while its store is down)
        self.in_flight = InFlight(sink)
        self.dead_letters = DeadLetters(
            client,
            self.keys,
            self.events,
            settings.reply_ttl_s,
            settings.dead_payload_max_bytes,
            settings.job_reply_ttl_s,
            model=encoder.name,
        )
        self.outages = Outages(self.events)
        self._stopping = asyncio.Event()
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.calibrations = CalibrationStore(
            client, self.keys, encoder.name, settings.calibration_file
        )
        self.outputs = Outputs(settings, encoder, self.calibrations)
        # stored vectors by content key (shared/vector_cache.py): a hit skips the model
        self.vector_cache = VectorCache(
            client, self.keys, settings.vector_cache_mb, settings.vector_cache_ttl_s
        )
        # the write stage: results to the sink (or reply lists), acknowledged (workers/write.py)
        self.writer = Writer(
            settings,
            client,
            sink,
            self.outputs,
            self.vector_cache,
            self.dead_letters,
            self.in_flight,
            self.outages,
            self.events,
            self.on_model_thread,
        )
        # the longest stretch of each bulk forward a query could not get into (model thread)
        self.slice_clock = SliceClock()
        self.queries = QueryLane(
            settings,
            encoder,
            client,
            self._model_thread,
            self.dead_letters,
            self.events,
            self.outputs,
            self.on_model_thread,
            self.outages,
            slice_clock=self.slice_clock,
        )
        # EMBEDFLEET_READ_COUNT / TOKEN_BUDGET / MAX_BATCH, -1 resolved for this device
        self.batching = settings.batching(encoder.device.type)
        self.reclaimer = Reclaimer(
            settings,
            client,
            self.in_flight,
            self.dead_letters,
            self.events,
            self.outages,
            # one claim takes at most one read's worth, as this worker's device reads
            read_count=self.batching.read_count,
        )
        # the intake stage: entries read and opened as windows (workers/intake.py)
        self.intake = Intake(
            settings,
            encoder,
            client,
            self.consumer,
            self.outputs,
            self.vector_cache,
            self.dead_letters,
            self.in_flight,
            self.outages,
            self.events,
            self.batching.read_count,
            self._tokenizer_thread,
            self._prepare,
            self._stopping,
        )
        self._stage_tasks: dict[str, asyncio.Task[None]] = {}
        # each bulk path's slice time, fitted from every bulk forward; sizes batches to the slice
        self.slice_costs: dict[BulkPath, SliceCost] = {}
        # set once the compute stage can take windows (graph settled, speed seeded): nothing is
        # read, and so held from other workers, before
        self._bulk_ready = asyncio.Event()
        self._trim_timer = TrimTimer()
        # the bulk lane's layout and launches (workers/bulk.py); made in run(), on the model
        # thread, since varlen probes its kernels there
        self.bulk: BulkForward | None = None
        self._ahead: LaunchAhead[InFlightBatch] = LaunchAhead(ahead=False)
        # waits for copy backs off the event loop and off the model thread (CUDA only)
        self._collect_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="collect")
        # when the compute stage next looks for interactive entries (_jump_the_queue)
        self._next_urgent_check = 0.0
        # a bulk batch's time (from launch to the next), seconds: paces the reader
        self._batch_s = 0.0

    @property
    def model_thread(self) -> ThreadPoolExecutor:
        """The one thread that runs the model; health probes must run their forward pass here."""
        return self._model_thread

    def drain(self) -> None:
        """Stop reading; what was read is finished and acknowledged, then run() returns."""
        self._stopping.set()

    @property
    def slice_seconds(self) -> float:
        """The longest stretch of bulk compute a query may wait behind, which bulk batches are
        sized to (``_slice_limit``); 0 = no limit.

        No limit where queries are served concurrently (the CUDA query lane: its own model copy
        and stream, its own thread, never at a bulk layer boundary): a query does not wait on
        bulk layers there, so capping batches would only cost throughput. Bulk batches then use
        the full token budget whatever EMBEDFLEET_SLICE_MS says."""
        if self.encoder.serves_queries_concurrently:
            return 0.0
        configured = self.settings.slice_ms
        if configured < 0:
            configured = SLICE_MS_AUTO.get(self.encoder.device.type, 100.0)
        return configured / 1000

    async def on_model_thread(self, function: Callable[[], Calibration]) -> Calibration:
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, function)

    async def publish_model(self) -> None:
        """What this namespace's workers serve (the model card at Keys.model): the one source
        the gateway and producers read the model's dimension, maximum, normalisation and
        prompts from. The card's revision (hashing the model directory, the first time) is
        made off the event loop. Then its name in the namespace's registry of models
        (``{ns}:models``: a model lane's name, or the default model's served name) with its
        tokenizer, so the gateway lists and routes to it (shared/model_registry.py)."""
        card = await asyncio.to_thread(lambda: self.outputs.card)
        await publish_card(self.client, self.keys, card)
        await register_model(
            self.client,
            self.keys,
            self.settings.model_lane or card.name,
            tokenizer_json(self.encoder.spec.transformer_dir),
        )

    async def run(self) -> None:
        """Run until drained. Raises when a stage failed (after draining what it could):
        ``WorkerFault`` for a fault that names its setting, else the stage's error."""
        self.outputs.check_settings()
        # A worker started before its Redis waits for it, as it would for an outage later.
        ride = RideOut("creating the consumer group", self.outages, self.events)
        await ride_out(ride, System.REDIS, self.consumer.setup)
        await ride_out(ride, System.REDIS, self.publish_model)
        self.stats.started_at = time.perf_counter()
        windows: asyncio.Queue[Window | None] = asyncio.Queue(maxsize=1)
        encoded: asyncio.Queue[Encoded | None] = asyncio.Queue(maxsize=4)
        query_stream = self.keys.query_lane.query
        # what the reclaimer scans, asked each period: tenants registered later are covered too
        streams: Callable[[], list[str]] = (
            (lambda: [query_stream]) if self.settings.query_only else self.consumer.streams
        )
        log.info(
            "worker started",
            consumer=self.settings.consumer,
            model=self.encoder.name,
            device=str(self.encoder.device),
            query_only=self.settings.query_only,
            partitions=self.settings.read_partitions,
            dtype=str(self.encoder.dtype).removeprefix("torch."),
            slice_ms=round(self.slice_seconds * 1000),
        )
        if not self.settings.query_only:
            self.bulk = await asyncio.get_running_loop().run_in_executor(
                self._model_thread, self._make_bulk
            )
            self._ahead = LaunchAhead(ahead=self.bulk.asynchronous)
        # One forward pass before the first timed batch: the slice cost model (_seed_speed)
        # must not learn from cold kernels, lazy allocations and first-shape dispatch.
        try:
            await asyncio.get_running_loop().run_in_executor(self._model_thread, self._warm_up)
        except Exception as error:
            if is_device_fault(error):
                raise DeviceFault(f"CUDA error in the warm-up forward pass: {error}") from error
            log.warning("warm-up forward pass failed; going on", error=str(error))
        stages: dict[str, Coroutine[Any, Any, None]] = {
            "queries": self.queries.run(self._stopping),
            "reclaim": self.reclaimer.run(self._stopping, self._deliver_reclaimed, streams),
            "heartbeat": run_heartbeat(
                self.client, self.keys, self.settings.consumer, self._stopping
            ),
        }
        if not self.settings.query_only:
            stages["reader"] = self.intake.run(windows, self._bulk_ready)
            stages["compute"] = self._compute_loop(windows, encoded)
            stages["writer"] = self.writer.run(encoded)
        try:
            async with asyncio.TaskGroup() as group:
                for name, coroutine in stages.items():
                    self._stage_tasks[name] = group.create_task(
                        self._stage(name, coroutine), name=f"worker-{name}"
                    )
        except ExceptionGroup as failed:
            errors = failed.exceptions
            raise errors[0] if len(errors) == 1 else failed from None
        finally:
            self._model_thread.shutdown(wait=False, cancel_futures=True)
            self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
            self._collect_thread.shutdown(wait=False, cancel_futures=True)
        log.info("worker stopped", texts=self.stats.texts, dead_letters=self.stats.dead_letters)

    async def _stage(self, name: str, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run one stage; if it fails, drain the stages that can still finish, then raise
        (the TaskGroup then cancels whatever is still running)."""
        try:
            await coroutine
        except Exception as error:
            log.error(
                "worker stage failed: draining what the others can finish, then exiting",
                stage=name,
                error=f"{type(error).__name__}: {error}",
            )
            self.drain()
            if isinstance(error, DeviceFault):
                # The device is unusable: nothing more can be computed here, and the
                # reclaimer must not keep renewing leases on entries this worker will never
                # finish. Stop at once; a healthy worker reclaims them.
                raise
            # Stages before this one may be blocked handing it work; the others can finish.
            upstream = _UPSTREAM.get(name, ())
            finishing = [
                task
                for other, task in self._stage_tasks.items()
                if other != name and other not in upstream
            ]
            if finishing:
                await asyncio.wait(finishing, timeout=self.settings.drain_timeout_s)
            raise

    async def _deliver_reclaimed(self, stream: str, entries: list[StreamEntry]) -> None:
        if stream == self.keys.query_lane.query:
            await self.queries.accept(entries)
        else:
            await self.intake.hold_reclaimed(stream, entries)

    def _prepare(self, window: Window) -> list[Prepared]:
        """The window's batches, planned and collated."""
        assert self.bulk is not None
        lengths = [t.length for t in window.tokens]
        plans = self.bulk.plan(
            lengths, self.batching.token_budget, self.batching.max_batch, self._slice_limit()
        )
        return [
            Prepared(planned, self.bulk.collate([window.tokens[p] for p in planned.positions]))
            for planned in plans
        ]

    # --- compute ----------------------------------------------------------------------
    def _make_bulk(self) -> BulkForward:
        """On the model thread: the bulk lane for EMBEDFLEET_LAYOUT (varlen installs its
        attention in the model, which still runs padded batches as before)."""
        layout = resolve_layout(self.settings.layout, self.encoder)
        bulk = BulkForward(self.encoder, layout)
        log.info(
            "bulk layout",
            layout=layout,
            kernel=bulk.packer.kernel if bulk.packer else None,
            launch_ahead=bulk.asynchronous,
        )
        return bulk

    def _warm_up(self) -> None:
        """The encoder's warm-up, then one batch through the bulk lane's own path (varlen
        kernels, pinned buffers and events get their first call here, not in a timed batch)."""
        self.encoder.warm_up()
        if self.bulk is None or self.bulk.layout != "varlen":
            return
        try:
            tokens = self.encoder.tokenize(list(PROBE_TEXTS[:4]))
            self.bulk.launch(self.bulk.collate(tokens)).vectors()
        except Exception as error:
            if is_device_fault(error) or self.settings.layout == "varlen":
                raise
            # a kernel that passed its probe but fails in the model: better padded batches
            # than every text dead-lettered as a model error
            log.warning("varlen layout failed its warm-up batch; padded batches", error=str(error))
            self.bulk = BulkForward(self.encoder, "padded")

    def _bulk_frozen(self) -> bool:
        """Bulk batches through the frozen, pre-packed copy: where it was kept (CPU) and the
        model computes in bf16/fp16, whose eager linear layers measured several times slower
        than the frozen graph's (docs/BENCHMARKS.md, Throughput II). In float32 the two are
        even, and eager keeps its layer boundaries for queries. Padded batches only."""
        return (
            self.settings.frozen_bulk
            and self.encoder.has_query_graph
            and self.encoder.computes_in_reduced_precision
            and (self.bulk is None or self.bulk.layout == "padded")
        )

    def _bulk_path(self) -> BulkPath:
        """The forward path bulk batches take now: each has its own cost model."""
        if self.bulk is not None and self.bulk.layout == "varlen":
            return "varlen"
        if self._bulk_frozen():
            return "int8" if self.encoder.computes_in_int8 else "frozen"
        return "eager"

    def _slice_cost(self, path: BulkPath) -> SliceCost:
        if path not in self.slice_costs:
            self.slice_costs[path] = SliceCost(path)
        return self.slice_costs[path]

    def _slice_limit(self) -> SliceLimit | None:
        """What a batch planned now may cost, so that its longest slice fits in the slice
        target (None where queries do not wait on bulk work, see ``slice_seconds``, or before
        anything was measured): a query then waits at most one slice. A slice is one
        transformer layer of an eager batch, the whole batch through the frozen or int8 copy
        (no layer boundaries); workers/cost_model.py predicts it per path and batch shape.
        Called on the tokenizer thread: it reads the path's model, never makes one."""
        cost = self.slice_costs.get(self._bulk_path())
        return None if cost is None else cost.limit(self.slice_seconds)

    def _launch_timed(
        self, batch: BulkBatch, *, frozen: bool, half: bool = False
    ) -> tuple[Launched, float, float]:
        """On the model thread: launch one batch with the slice clock running; returns it, its
        longest stretch between query boundaries (the whole pass through a frozen copy) and the
        seconds of queries served at its layer boundaries. Where the launch only queues the
        work (CUDA) the clock times nothing: the device's time, shared among the layers a query
        could get between, stands in once collected.

        The queries' time is read here, on the model thread, around the launch itself: read on
        the event loop it also took in queries the model thread served just before the launch
        (queued ahead of it), which made a short batch's time negative."""
        assert self.bulk is not None
        serving_before = self.queries.serving_seconds
        self.slice_clock.start()
        try:
            launched = self.bulk.launch(batch, frozen=frozen, half=half)
        finally:
            longest = self.slice_clock.stop()
        return launched, longest, self.queries.serving_seconds - serving_before

    def _slice_seconds(self, launched: Launched, clocked: float, frozen: bool) -> float:
        """A collected batch's longest slice: clocked on a CPU; on CUDA its device time over
        the layers a query could get between (hooks fire at launch there)."""
        if launched.copied is None:
            return clocked
        return launched.seconds / (1 if frozen else max(1, self.encoder.layer_count))

    async def _compute_loop(
        self, windows: asyncio.Queue[Window | None], encoded: asyncio.Queue[Encoded | None]
    ) -> None:
        try:
            # Bulk batches start once the query lane has settled the graph they run through
            # (the frozen or int8 copy, which can take a minute to compile), not eager before
            # it; the model's busy share counts from then. A drain (the lane failed) ends the
            # wait too: what was read is then finished without the graph.
            await first_set(self.queries.ready, self._stopping)
            self.events.forward_path_chosen(path=self.encoder.forward_path)
            await self._seed_speed()
            self._bulk_ready.set()
            self.stats.started_at = time.perf_counter()
            while (window := await self.intake.next_window(windows)) is not _END:
                await self._hand_on_cached(window, encoded)
                for index, prepared in enumerate(window.batches):
                    self.intake.pace_reads(windows, len(window.batches) - index, self._batch_s)
                    started = time.monotonic()
                    await self._jump_the_queue(encoded)
                    await self._encode(window, prepared.planned, encoded, batch=prepared.batch)
                    self._batch_s = time.monotonic() - started
                # (an empty window is how the reader wakes this stage for interactive windows)
                await self._jump_the_queue(encoded)
                if windows.empty():
                    # nothing to launch behind the batch in flight: collect it now rather than
                    # hold its results until the next window comes
                    await self._collect_in_flight(encoded)
                # on the model thread, between windows, on a timer: keeps RSS flat
                # (workers/memory.py)
                if self._trim_timer.due():
                    await asyncio.get_running_loop().run_in_executor(
                        self._model_thread, release_free_memory
                    )
            await self._jump_the_queue(encoded, read=False)  # what the reader left there
            await self._collect_in_flight(encoded)
        finally:
            await encoded.put(_END)

    async def _jump_the_queue(
        self, encoded: asyncio.Queue[Encoded | None], *, read: bool = True
    ) -> None:
        """Before a bulk batch: interactive entries (large requests someone waits on) are
        encoded now, ahead of the bulk windows this worker already holds (this one's rest,
        and at most one more read near its end: Intake.pace_reads), so a request waits for one
        bulk batch, not for those windows. First the windows the reader opened from them
        (``Intake.urgent``); then, at most every URGENT_CHECK_S, one non-blocking read of the
        stream, for entries that came while the reader waits for the compute stage to want a
        window. A Redis fault on that read is left to the reader and the reclaimer: entries read
        and not held are redelivered after their lease."""
        while not self.intake.urgent.empty():
            await self._encode_window(self.intake.urgent.get_nowait(), encoded)
        now = time.monotonic()
        if not read or self._stopping.is_set() or now < self._next_urgent_check:
            return
        self._next_urgent_check = now + URGENT_CHECK_S
        try:
            entries = await self.consumer.read_stream(
                self.consumer.interactive_stream, self.batching.read_count, None
            )
            if not entries:
                return
            self.events.entries_read(stream=entries[0].stream, count=len(entries))
            window, rejected = await self.intake.open_window(entries)
            await self.intake.dead_letter(rejected)
            await self.intake.drop_expired(window.expired)
        except Exception as error:
            fault = transient_or_raise(error, System.REDIS)
            log.warning("interactive entries left for the reader", error=fault.detail)
            return
        if window.chunks or window.cached:
            self.in_flight.hold(window.held)
            await self._encode_window(window, encoded)

    async def _encode_window(self, window: Window, encoded: asyncio.Queue[Encoded | None]) -> None:
        await self._hand_on_cached(window, encoded)
        for prepared in window.batches:
            await self._encode(window, prepared.planned, encoded, batch=prepared.batch)

    async def _hand_on_cached(self, window: Window, encoded: asyncio.Queue[Encoded | None]) -> None:
        """The window's chunks the vector cache answered go to the writer as they are: their
        results are ready, no model runs for them."""
        if not window.cached:
            return
        chunks = [chunk for chunk, _, _ in window.cached]
        deliveries = [delivery for _, delivery, _ in window.cached]
        results = [result for _, _, result in window.cached]
        empty = np.zeros((0, 0), dtype=np.float32)
        await encoded.put(Encoded(chunks, deliveries, [], empty, cached=results))

    async def _seed_speed(self) -> None:
        """Time probe batches of three shapes through the bulk path before the first window is
        read, and seed the path's cost model with them (workers/cost_model.py).

        A window's batches are planned when it is opened, with the limit known then: without a
        measured cost the first windows would get the whole token budget, batches several
        times the query slice. Each probe runs twice and the faster counts (a graph's first
        call at a new shape is slower). Any error here is left for the first real batch to
        meet (and handle: split on out-of-memory, exit on a device fault)."""
        if self.slice_seconds <= 0 or self.bulk is None or self._stopping.is_set():
            return
        loop = asyncio.get_running_loop()
        bulk = self.bulk
        long_text = max(PROBE_TEXTS, key=len)  # over the model's maximum: truncated to it
        probes = [
            list(BULK_PROBE_TEXTS),
            list(BULK_PROBE_TEXTS[:SEED_SMALL_TEXTS]),
            [long_text] * SEED_LONG_TEXTS,
        ]
        path, frozen = self._bulk_path(), self._bulk_frozen()
        samples: list[tuple[Shape, float]] = []
        try:
            for texts in probes:
                tokens = await loop.run_in_executor(
                    self._tokenizer_thread, self.encoder.tokenize, texts
                )
                batch = await loop.run_in_executor(self._tokenizer_thread, bulk.collate, tokens)
                times = []
                for _ in range(2):
                    launched, clocked, _ = await loop.run_in_executor(
                        self._model_thread,
                        functools.partial(self._launch_timed, batch, frozen=frozen),
                    )
                    await loop.run_in_executor(self._collect_thread, launched.vectors)
                    times.append(self._slice_seconds(launched, clocked, frozen))
                samples.append((self._shape(path, [t.length for t in tokens]), min(times)))
        except Exception as error:
            log.warning(
                "speed probe batch failed; the first batches are not sliced", error=str(error)
            )
            return
        cost = self._slice_cost(path)
        cost.seed(samples)
        log.info(
            "bulk slice cost seeded",
            path=path,
            slice_ms=round(self.slice_seconds * 1000, 1),
            probe_ms=[round(seconds * 1000, 1) for _, seconds in samples],
            fitted=str(cost.cost),
        )

    @staticmethod
    def _shape(path: BulkPath, lengths: list[int]) -> Shape:
        """A batch's shape as its path computes it: packed rows for varlen, padded otherwise."""
        if path == "varlen":
            return Shape.packed(lengths)
        return Shape.padded(len(lengths), max(lengths))

    async def _encode(
        self,
        window: Window,
        planned: PlannedBatch,
        encoded: asyncio.Queue[Encoded | None],
        oom_retries: int = 0,
        batch: BulkBatch | None = None,
    ) -> None:
        """Launch one batch; then collect the batch launched before it (on CUDA it ran
        meanwhile; on CPU the launch was the computation and it is this one)."""
        assert self.bulk is not None
        loop = asyncio.get_running_loop()
        if batch is None:  # a retried or split batch: collated again, off the event loop
            tokens = [window.tokens[p] for p in planned.positions]
            batch = await loop.run_in_executor(self._tokenizer_thread, self.bulk.collate, tokens)
        self.events.batch_started(texts=len(planned.positions), padded_tokens=planned.padded_tokens)
        chunks = [window.chunks[p] for p in planned.positions]
        if isinstance(batch, EncodeBatch):  # a multi-head model: the heads its chunks want
            batch.heads = self.outputs.heads_for(chunks)
        path, frozen = self._bulk_path(), self._bulk_frozen()
        launch = functools.partial(
            self._launch_timed,
            batch,
            frozen=frozen,
            half=self.outputs.full_float16(chunks),
        )
        try:
            launched, clocked, query_seconds = await loop.run_in_executor(
                self._model_thread, launch
            )
        except Exception as error:
            await self._on_model_error(window, planned, encoded, error, oom_retries)
            return
        collect = self._ahead.push(
            InFlightBatch(
                window,
                planned,
                launched,
                oom_retries,
                query_seconds,
                path=path,
                slice_seconds=clocked,
            )
        )
        if collect is not None:
            await self._collect(collect, encoded)

    async def _collect_in_flight(self, encoded: asyncio.Queue[Encoded | None]) -> None:
        if (in_flight := self._ahead.pop()) is not None:
            await self._collect(in_flight, encoded)

    async def _collect(
        self, in_flight: InFlightBatch, encoded: asyncio.Queue[Encoded | None]
    ) -> None:
        """Wait for a launched batch's vectors and hand them to the writer."""
        window, planned, launched = in_flight.window, in_flight.planned, in_flight.launched
        try:
            if launched.done:
                vectors = launched.vectors()
            else:  # the wait blocks a thread: neither the event loop nor the model thread
                vectors = await asyncio.get_running_loop().run_in_executor(
                    self._collect_thread, launched.vectors
                )
        except Exception as error:  # a CUDA error surfaces where the host first waits
            await self._on_model_error(window, planned, encoded, error, in_flight.oom_retries)
            return
        # On CPU: the launch's wall time, less the queries served at layer boundaries inside
        # it. On CUDA: the device's time between the batch's events.
        seconds = launched.seconds
        if launched.copied is None:
            seconds = max(0.0, seconds - in_flight.query_seconds)
        self._learn_slice(in_flight)
        self.events.batch_encoded(
            texts=len(planned.positions),
            real_tokens=planned.real_tokens,
            padded_tokens=planned.padded_tokens,
            seconds=seconds,
        )
        tokens = [window.tokens[p] for p in planned.positions]
        await encoded.put(
            Encoded(
                chunks=[window.chunks[p] for p in planned.positions],
                deliveries=accounted(
                    [window.deliveries[p] for p in planned.positions],
                    tokens,
                    self.encoder.name,
                    seconds,
                ),
                tokens=tokens,
                vectors=vectors,
                content_keys=[
                    window.content_keys.get(window.deliveries[p]) for p in planned.positions
                ],
            )
        )

    async def _on_model_error(
        self,
        window: Window,
        planned: PlannedBatch,
        encoded: asyncio.Queue[Encoded | None],
        error: Exception,
        oom_retries: int = 0,
    ) -> None:
        """Halve the batch until the text that fails is alone (workers/device_faults.py).

        A CUDA error that poisons the context stops the worker (DeviceFault: entries are
        redelivered). Out of memory frees the cache and halves too, but a text alone that
        still does not fit is retried, then stops the worker: never dead-lettered for OOM.
        """
        positions = planned.positions
        action = recovery(error, len(positions), oom_retries, isolate_model_errors=True)
        if action is Recovery.DEVICE_LOST:
            raise DeviceFault(f"CUDA error in a forward pass: {error}") from error
        out_of_memory = is_out_of_memory(error)
        if out_of_memory:
            await asyncio.get_running_loop().run_in_executor(
                self._model_thread, free_device_memory, self.encoder.device
            )
        if action is Recovery.NEVER_FITS:
            raise DeviceFault(
                f"out of memory on one text of {planned.real_tokens} tokens after "
                f"{oom_retries} retries: {error}"
            ) from error
        if action is Recovery.RETRY:
            log.warning("out of memory on one text, retrying", tries=oom_retries + 1)
            await asyncio.sleep(oom_retry_pause_s(oom_retries))
            await self._encode(window, planned, encoded, oom_retries + 1)
            return
        if action is Recovery.DEAD_LETTER:
            chunk, delivery = window.chunks[positions[0]], window.deliveries[positions[0]]
            detail = f"model error: {type(error).__name__}: {error}"
            await self.intake.dead_letter(
                [Rejected.chunk(delivery, chunk, DeadReason.MODEL, detail)]
            )
            return
        log.warning(
            "model error, splitting the batch",
            texts=len(positions),
            out_of_memory=out_of_memory,
            error=str(error),
        )
        for half in (positions[: len(positions) // 2], positions[len(positions) // 2 :]):
            lengths = [window.tokens[p].length for p in half]
            sub = PlannedBatch(half, max(lengths), sum(lengths), packed=planned.packed)
            await self._encode(window, sub, encoded)

    def _learn_slice(self, in_flight: InFlightBatch) -> None:
        """One more observation for the path's cost model, the batch's longest slice, and the
        event that reports it against the target (metrics, tests, the latency benchmark)."""
        target = self.slice_seconds
        if target <= 0:
            return
        window, planned, path = in_flight.window, in_flight.planned, in_flight.path
        frozen = path in ("frozen", "int8")
        slice_seconds = self._slice_seconds(in_flight.launched, in_flight.slice_seconds, frozen)
        shape = self._shape(path, [window.tokens[p].length for p in planned.positions])
        cost = self._slice_cost(path)
        predicted = cost.predict(shape)
        cost.observe(shape, slice_seconds)
        self.events.bulk_slice(
            path=path,
            seconds=slice_seconds,
            predicted_seconds=predicted or 0.0,
            target_seconds=target,
            texts=len(planned.positions),
            longest=planned.longest,
        )


def tokenizer_json(transformer_dir: Path) -> bytes | None:
    """The model's ``tokenizer.json``, which the worker publishes for the gateway; None where
    the directory has none (then the gateway needs the model's files for this lane)."""
    path = transformer_dir / "tokenizer.json"
    return path.read_bytes() if path.is_file() else None


def accounted(
    deliveries: list[Delivery], tokens: list[Tokenized], model: str, seconds: float
) -> list[Delivery]:
    """The batch's deliveries with what the acknowledgement accounts for them (issue 30): the
    model, each text's tokens (as the tokenizer counted them, special tokens and prompt in,
    truncated to the model's maximum) and its share of the batch's model time by tokens."""
    total = sum(t.length for t in tokens) or 1
    micros = seconds * 1e6 / total  # per token
    # built directly, not dataclasses.replace: this runs per text on the event loop
    return [
        Delivery(
            d.stream, d.entry_id, d.job, d.tenant, model, t.length, round(t.length * micros), d.copy
        )
        for d, t in zip(deliveries, tokens, strict=True)
    ]
