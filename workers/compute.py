"""The worker's compute stage: windows in, encoded batches out, sliced so that queries can get
in between.

``Compute.run`` takes the windows the intake stage opened and launches their batches on the
model thread (workers/bulk.py: padded or varlen; on CUDA batch i+1 is queued before batch i is
collected), each sized by the slices' cost model (workers/slices.py) so that a query waits at
most one slice; before each bulk batch the interactive stream's windows jump the queue
(workers/interactive.py). Each collected batch goes on to the write stage as ``Encoded``, with
what its acknowledgement accounts (``accounted``).

Model errors (workers/device_faults.py): a batch that fails is halved until the text that fails
is alone and dead-lettered; out of memory halves too but never dead-letters (a text alone that
still does not fit is retried, then stops the worker); a CUDA error that poisons the context
stops the worker with a ``DeviceFault``, its entries left for a healthy worker.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field

import numpy as np

from embedfleet.shared.dead_letters import DeadReason
from embedfleet.shared.logging import get_logger
from embedfleet.sinks import Delivery
from embedfleet.workers.batcher import PlannedBatch
from embedfleet.workers.bulk import BulkBatch, LaunchAhead
from embedfleet.workers.dead_letter_writer import Rejected
from embedfleet.workers.device_faults import (
    DeviceFault,
    Recovery,
    free_device_memory,
    is_device_fault,
    is_out_of_memory,
    oom_retry_pause_s,
    recovery,
)
from embedfleet.workers.images import NO_TOKENS, ImageBatches
from embedfleet.workers.intake import Intake, first_set
from embedfleet.workers.interactive import InteractiveJump
from embedfleet.workers.long_inputs import Rows, before_normalize
from embedfleet.workers.memory import TrimTimer, release_free_memory
from embedfleet.workers.model.encoder import EncodeBatch, Encoder, Tokenized
from embedfleet.workers.parts import StageParts
from embedfleet.workers.queries import QueryStage
from embedfleet.workers.slices import InFlightBatch, Slices
from embedfleet.workers.windows import Window
from embedfleet.workers.write import Encoded

log = get_logger("embedfleet.worker")
_END = None  # queue sentinel: the stage before has finished


@dataclass(eq=False)
class Compute:
    """The compute stage: windows in, encoded batches out, sliced so the query stage can get in
    between and the interactive stream can jump the queue."""

    parts: StageParts
    slices: Slices
    intake: Intake
    interactive: InteractiveJump
    queries: QueryStage
    # set once this stage can take windows (graph settled, speed seeded): nothing is read,
    # and so held from other workers, before
    ready: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _ahead: LaunchAhead[InFlightBatch] = field(
        default_factory=lambda: LaunchAhead(ahead=False), init=False
    )
    _trim_timer: TrimTimer = field(default_factory=TrimTimer, init=False)
    # a bulk batch's time (from launch to the next), seconds: paces the reader
    _batch_s: float = field(default=0.0, init=False)
    # a dual encoder's image batches, sized by their measured cost (workers/images.py)
    _image_batches: ImageBatches | None = field(default=None, init=False)

    async def start(self) -> None:
        """Before the stages run, on the model thread: the bulk path (none in a query-only
        worker), then one forward pass before the first timed batch: the slice cost model
        (``Slices.seed_speed``) must not learn from cold kernels, lazy allocations and
        first-shape dispatch."""
        loop = asyncio.get_running_loop()
        if not self.parts.settings.query_only:
            self.slices.bulk = await loop.run_in_executor(
                self.parts.threads.model, self.slices.make_bulk
            )
            self._ahead = LaunchAhead(ahead=self.slices.bulk.asynchronous)
        try:
            await loop.run_in_executor(self.parts.threads.model, self.slices.warm_up)
        except Exception as error:
            if is_device_fault(error):
                raise DeviceFault(f"CUDA error in the warm-up forward pass: {error}") from error
            log.warning("warm-up forward pass failed; going on", error=str(error))

    async def run(
        self, windows: asyncio.Queue[Window | None], encoded: asyncio.Queue[Encoded | None]
    ) -> None:
        try:
            # Bulk batches start once the query stage has settled the graph they run through
            # (the frozen or int8 copy, which can take a minute to compile), not eager before
            # it; the model's busy share counts from then. A drain (the stage failed) ends the
            # wait too: what was read is then finished without the graph.
            await first_set(self.queries.ready, self.parts.stopping)
            self.parts.events.forward_path_chosen(path=self.parts.encoder.forward_path)
            await self.slices.seed_speed()
            self.ready.set()
            self.parts.stats.started_at = time.perf_counter()
            while (window := await self.intake.next_window(windows)) is not _END:
                await self._hand_on_cached(window, encoded)
                await self._encode_images(window, encoded)
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
                        self.parts.threads.model, release_free_memory
                    )
            await self._jump_the_queue(encoded, read=False)  # what the reader left there
            await self._collect_in_flight(encoded)
        finally:
            await encoded.put(_END)

    async def _jump_the_queue(
        self, encoded: asyncio.Queue[Encoded | None], *, read: bool = True
    ) -> None:
        """Before a bulk batch: the interactive stream's windows (large requests someone waits
        on, workers/interactive.py) are encoded now, ahead of the bulk windows this worker
        already holds: those the reader opened, then (``read``) those a non-blocking read of
        the stream brings."""
        while (window := self.interactive.opened()) is not None:
            await self._encode_window(window, encoded)
        if read and (window := await self.interactive.read_new()) is not None:
            await self._encode_window(window, encoded)

    async def _encode_images(self, window: Window, encoded: asyncio.Queue[Encoded | None]) -> None:
        if window.images is None:
            return
        if self._image_batches is None:  # the slice target is known once the query stage is ready
            self._image_batches = ImageBatches(
                self.parts.batching.max_batch,
                self.slices.slice_seconds,
                ImageBatches.tower_layers(self.parts.encoder.loaded.model),
            )
        await encode_images(
            self.parts, self.intake, window, encoded, self._image_batches, self.slices
        )

    async def _encode_window(self, window: Window, encoded: asyncio.Queue[Encoded | None]) -> None:
        await self._hand_on_cached(window, encoded)
        await self._encode_images(window, encoded)
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
        bulk, events = self.slices.bulk, self.parts.events
        assert bulk is not None
        loop = asyncio.get_running_loop()
        if batch is None:  # a retried or split batch: collated again, off the event loop
            tokens = [window.tokens[p] for p in planned.positions]
            batch = await loop.run_in_executor(self.parts.threads.tokenizer, bulk.collate, tokens)
        events.batch_started(texts=len(planned.positions), padded_tokens=planned.padded_tokens)
        chunks = [window.chunks[p] for p in planned.positions]
        if isinstance(batch, EncodeBatch):  # a multi-head model: the heads its chunks want
            batch.heads = self.parts.outputs.heads_for(chunks)
        path, frozen = self.slices.bulk_path(), self.slices.bulk_frozen()
        launch = functools.partial(
            self.slices.launch_timed,
            batch,
            frozen=frozen,
            half=self.parts.outputs.full_float16(chunks),
        )
        if window.rejoin is not None:
            # long inputs' windows are averaged before the model's Normalize: the window's
            # batches come back unnormalised, and the rejoin normalises every row
            launch = functools.partial(before_normalize, launch)
        try:
            launched, clocked, query_seconds = await loop.run_in_executor(
                self.parts.threads.model, launch
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
                    self.parts.threads.collect, launched.vectors
                )
        except Exception as error:  # a CUDA error surfaces where the host first waits
            await self._on_model_error(window, planned, encoded, error, in_flight.oom_retries)
            return
        # On CPU: the launch's wall time, less the queries served at layer boundaries inside
        # it. On CUDA: the device's time between the batch's events.
        seconds = launched.seconds
        if launched.copied is None:
            seconds = max(0.0, seconds - in_flight.query_seconds)
        self.slices.learn_slice(in_flight)
        self.parts.events.batch_encoded(
            texts=len(planned.positions),
            real_tokens=planned.real_tokens,
            padded_tokens=planned.padded_tokens,
            seconds=seconds,
        )
        tokens = [window.tokens[p] for p in planned.positions]
        chunks = [window.chunks[p] for p in planned.positions]
        deliveries = accounted(
            [window.deliveries[p] for p in planned.positions],
            tokens,
            self.parts.encoder.name,
            seconds,
        )
        # none to look up where the window has no content keys (the vector cache off): a
        # Delivery's hash costs half a microsecond a text on the event loop (issue 53)
        keys: list[str | None] = (
            [window.content_keys.get(window.deliveries[p]) for p in planned.positions]
            if window.content_keys
            else [None] * len(planned.positions)
        )
        if window.rejoin is not None:  # long inputs' windows: one row each once all are in
            chunks, deliveries, tokens, vectors, keys = window.rejoin.take(
                Rows(chunks, deliveries, tokens, vectors, keys)
            )
            if not chunks:
                return
        await encoded.put(
            Encoded(
                chunks=chunks,
                deliveries=deliveries,
                tokens=tokens,
                vectors=vectors,
                content_keys=keys,
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
                self.parts.threads.model, free_device_memory, self.parts.encoder.device
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
            rejoin = window.rejoin
            if rejoin is not None and delivery in rejoin and not rejoin.fail(delivery):
                return  # another window of this long input was dead-lettered already
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


def accounted(
    deliveries: list[Delivery], tokens: list[Tokenized], model: str, seconds: float
) -> list[Delivery]:
    """The batch's deliveries with what the acknowledgement accounts for them (issue 30): the
    model, each text's tokens (as the tokenizer counted them, special tokens and prompt in,
    truncated to the model's maximum) and its share of the batch's model time by tokens."""
    total = sum(t.length for t in tokens) or 1
    micros = seconds * 1e6 / total  # per token
    # not dataclasses.replace, nor Delivery(...): this runs per text on the event loop
    return [
        d.accounted(model, t.length, round(t.length * micros))
        for d, t in zip(deliveries, tokens, strict=True)
    ]


async def encode_images(
    parts: StageParts,
    intake: Intake,
    window: Window,
    encoded: asyncio.Queue[Encoded | None],
    sizes: ImageBatches,
    slices: Slices,
) -> None:
    """A dual encoder's image chunks of the window (workers/images.py), in batches ``sizes``
    cuts (to the slice target where queries wait on bulk work) on the model thread; the images
    of a batch the model fails on are dead-lettered (``model``), the other batches go on."""
    rows = window.images
    if rows is None:
        return
    loop = asyncio.get_running_loop()
    start = 0
    while start < len(rows.chunks):
        batch = range(start, min(start + sizes.next_size(), len(rows.chunks)))
        start = batch.stop
        chunks, deliveries = (
            rows.chunks[batch.start : batch.stop],
            rows.deliveries[batch.start : batch.stop],
        )
        predicted = sizes.layer_seconds(len(batch))
        try:
            vectors, seconds, longest = await loop.run_in_executor(
                parts.threads.model,
                _timed_images,
                parts.encoder,
                slices,
                rows.pixels[batch.start : batch.stop],
            )
        except Exception as error:
            if is_device_fault(error):
                raise DeviceFault(f"CUDA error in an image batch: {error}") from error
            await intake.dead_letter(
                [
                    Rejected.chunk(delivery, chunk, DeadReason.MODEL, f"model error: {error}")
                    for chunk, delivery in zip(chunks, deliveries, strict=True)
                ]
            )
            continue
        sizes.observe(len(batch), seconds)
        # the model's time on images counts in its busy share, and its longest stretch between
        # two layers against the slice target, as a text batch's do (the image tower: eager)
        parts.events.batch_encoded(
            texts=len(batch), real_tokens=0, padded_tokens=0, seconds=seconds
        )
        if sizes.slice_seconds > 0:
            parts.events.bulk_slice(
                path="eager",
                seconds=longest,
                predicted_seconds=predicted,
                target_seconds=sizes.slice_seconds,
                texts=len(batch),
                longest=0,
            )
        keys = [rows.content_keys.get(delivery) for delivery in deliveries]
        tokens = [NO_TOKENS] * len(chunks)
        await encoded.put(Encoded(chunks, deliveries, tokens, vectors, content_keys=keys))


def _timed_images(
    encoder: Encoder, slices: Slices, pixels: np.ndarray
) -> tuple[np.ndarray, float, float]:
    """On the model thread: an image batch's vectors, the seconds the model spent on them (the
    queries served at its layer boundaries left out) and its longest stretch between two of
    them (the slice clock, workers/cost_model.py: what a query waited behind)."""
    served, started = slices.queries.serving_seconds, time.perf_counter()
    slices.slice_clock.start()
    try:
        vectors = encoder.embed_images(pixels)
    finally:
        longest = slices.slice_clock.stop()
    seconds = time.perf_counter() - started - (slices.queries.serving_seconds - served)
    return vectors, seconds, longest
