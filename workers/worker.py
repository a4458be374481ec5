"""The worker loop: read → decode → tokenize → sort and batch → encode → write + ack.

Three bulk tasks joined by bounded queues (Infinity's shape), so Redis I/O, tokenization and
the forward pass overlap while memory stays bounded:

    reader   (workers/intake.py) XREADGROUP (and reclaimed entries); on the
             tokenizer thread decode and validate; look each chunk's content key
             up in the vector cache (shared/vector_cache.py: a hit's result is
             made from the stored vector and skips the model); on the tokenizer
             thread again tokenize the rest (the batch call on the encoding
             thread), sort by length, plan batches by token budget and collate
             them into host buffers; dead-letter bad input (on the event loop).
             A host-bound worker with two CPUs opens the next read beside the
             one before (two tokenizer threads): one's Python beside the
             other's Rust                                                       → windows
    compute  launch each batch on the model thread (workers/compute.py; workers/bulk.py:
             padded or varlen; on CUDA batch i+1 is queued before batch i is collected);
             on a CPU queries get in between transformer layers (or, through the
             frozen and int8 copies, between batches), and batches are sized from
             a cost model of each path so that a query waits at most one slice
             (workers/slices.py, workers/cost_model.py); before a batch,
             the interactive stream's new entries (large requests someone waits
             on) are read and encoded first (workers/interactive.py)            → encoded
    writer   fp16 results to the sink, XACK in the same round trip (workers/write.py)

Beside them: the query stage (workers/queries.py) and the reclaimer (workers/reclaim.py). What
the stages share (settings, encoder, connection, consumer, outputs, vector cache, dead letters,
in-flight set, outages, events, threads) is built once (workers/parts.py) and handed to each;
``Worker`` builds the stages from those parts and runs them.

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
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis.asyncio as aioredis

from embedfleet.shared.fault_kinds import System
from embedfleet.shared.logging import get_logger
from embedfleet.shared.model_registry import register_model
from embedfleet.shared.modelcard import publish_card
from embedfleet.shared.settings import Settings
from embedfleet.sinks import Sink
from embedfleet.workers.calibration import Calibration
from embedfleet.workers.compute import Compute
from embedfleet.workers.consumer import StreamEntry
from embedfleet.workers.cost_model import SliceClock
from embedfleet.workers.device_faults import DeviceFault
from embedfleet.workers.events import WorkerEvents
from embedfleet.workers.heartbeat import run_heartbeat
from embedfleet.workers.intake import Intake
from embedfleet.workers.interactive import InteractiveJump
from embedfleet.workers.model.encoder import Encoder
from embedfleet.workers.outages import RideOut, ride_out
from embedfleet.workers.parts import StageParts
from embedfleet.workers.queries import QueryStage
from embedfleet.workers.reclaim import Reclaimer
from embedfleet.workers.slices import Slices
from embedfleet.workers.windows import Window
from embedfleet.workers.write import Encoded, Writer

log = get_logger("embedfleet.worker")
# The bulk stages feed each other through bounded queues: a stage's upstream may be blocked on
# handing it work, so when the stage fails only the others are waited for.
_UPSTREAM = {"compute": ("reader",), "writer": ("reader", "compute")}


class Worker:
    """One worker: its stages built from the parts they share, run until drained."""

    def __init__(
        self,
        settings: Settings,
        encoder: Encoder,
        client: aioredis.Redis,
        sink: Sink,
        events: WorkerEvents | None = None,
    ) -> None:
        self.settings = settings
        self.keys = settings.keys
        self.encoder = encoder
        self.client = client
        self.listener = events or WorkerEvents()
        self.parts = parts = StageParts.build(settings, encoder, client, sink, self.listener)
        self.stats = parts.stats
        self.consumer = parts.consumer
        self.outages = parts.outages
        self.outputs = parts.outputs
        # the longest stretch of each bulk forward a query could not get into (model thread)
        slice_clock = SliceClock()
        self.queries = QueryStage(parts, slice_clock)
        self.reclaimer = Reclaimer(
            settings,
            client,
            parts.in_flight,
            parts.dead_letters,
            parts.events,
            parts.outages,
            # one claim takes at most one read's worth, as this worker's device reads
            read_count=parts.batching.read_count,
        )
        # the bulk stages: intake (windows), compute (encoded batches), write (acknowledged)
        self.slices = Slices(parts, self.queries, slice_clock)
        self.intake = Intake(parts, self.slices.prepare)
        self.interactive = InteractiveJump(parts, self.intake)
        self.compute = Compute(parts, self.slices, self.intake, self.interactive, self.queries)
        self.writer = Writer(parts)
        self._stage_tasks: dict[str, asyncio.Task[None]] = {}

    @property
    def model_thread(self) -> ThreadPoolExecutor:
        """The one thread that runs the model; health probes must run their forward pass here."""
        return self.parts.threads.model

    def drain(self) -> None:
        """Stop reading; what was read is finished and acknowledged, then run() returns."""
        self.parts.stopping.set()

    async def on_model_thread(self, function: Callable[[], Calibration]) -> Calibration:
        return await self.parts.on_model_thread(function)

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
            self.encoder.text.published.encode(),
        )

    async def run(self) -> None:
        """Run until drained. Raises when a stage failed (after draining what it could):
        ``WorkerFault`` for a fault that names its setting, else the stage's error."""
        self.outputs.check_settings()
        # A worker started before its Redis waits for it, as it would for an outage later.
        ride = RideOut("creating the consumer group", self.outages, self.parts.events)
        await ride_out(ride, System.REDIS, self.parts.consumer.setup)
        await ride_out(ride, System.REDIS, self.publish_model)
        self.stats.started_at = time.perf_counter()
        log.info(
            "worker started",
            consumer=self.settings.consumer,
            model=self.encoder.name,
            device=str(self.encoder.device),
            query_only=self.settings.query_only,
            partitions=self.settings.read_partitions,
            dtype=str(self.encoder.dtype).removeprefix("torch."),
            slice_ms=round(self.slices.slice_seconds * 1000),
        )
        await self.compute.start()
        try:
            async with asyncio.TaskGroup() as group:
                for name, coroutine in self._stages().items():
                    self._stage_tasks[name] = group.create_task(
                        self._stage(name, coroutine), name=f"worker-{name}"
                    )
        except ExceptionGroup as failed:
            errors = failed.exceptions
            raise errors[0] if len(errors) == 1 else failed from None
        finally:
            self.parts.threads.shutdown()
        log.info("worker stopped", texts=self.stats.texts, dead_letters=self.stats.dead_letters)

    def _stages(self) -> dict[str, Coroutine[Any, Any, None]]:
        """What runs side by side: the query stage, the reclaimer and the heartbeat, and (unless
        the worker only answers queries) the bulk stages, joined by bounded queues."""
        stopping, keys = self.parts.stopping, self.keys
        query_stream = keys.priority_streams.query
        # what the reclaimer scans, asked each period: tenants registered later are covered too
        streams: Callable[[], list[str]] = (
            (lambda: [query_stream]) if self.settings.query_only else self.parts.consumer.streams
        )
        stages: dict[str, Coroutine[Any, Any, None]] = {
            "queries": self.queries.run(stopping),
            "reclaim": self.reclaimer.run(stopping, self._deliver_reclaimed, streams),
            "heartbeat": run_heartbeat(self.client, keys, self.settings.consumer, stopping),
        }
        if not self.settings.query_only:
            windows: asyncio.Queue[Window | None] = asyncio.Queue(maxsize=1)
            encoded: asyncio.Queue[Encoded | None] = asyncio.Queue(maxsize=4)
            stages["reader"] = self.intake.run(windows, self.compute.ready)
            stages["compute"] = self.compute.run(windows, encoded)
            stages["writer"] = self.writer.run(encoded)
        return stages

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
        if stream == self.keys.priority_streams.query:
            await self.queries.accept(entries)
        else:
            await self.intake.hold_reclaimed(stream, entries)
