"""The bulk path's forward and its slices: which path bulk batches take, and how large a batch
may be so that a query waits at most one slice behind it.

On a CPU queries are served between the transformer layers of a bulk batch (or, through the
frozen and int8 copies, between batches): a slice is the longest stretch a query cannot get into.
``Slices`` owns the bulk path's layout and launches (workers/bulk.py: padded or varlen), times
each launch with the slice clock, fits a cost model per forward path from what it measured
(workers/cost_model.py; seeded with probe batches before the first window, ``seed_speed``) and
plans each window's batches to fit the slice target (``prepare``, on the tokenizer thread).
Where queries are served concurrently (the CUDA query path) nothing is sliced.
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from dataclasses import dataclass

import torch

from embedfleet.shared.logging import get_logger
from embedfleet.workers.batcher import PlannedBatch
from embedfleet.workers.bulk import BulkBatch, BulkForward, Launched, resolve_layout
from embedfleet.workers.cost_model import BulkPath, Shape, SliceClock, SliceCost, SliceLimit
from embedfleet.workers.device_faults import is_device_fault
from embedfleet.workers.model.precision import BULK_PROBE_TEXTS, PROBE_TEXTS
from embedfleet.workers.parts import StageParts
from embedfleet.workers.queries import QueryStage
from embedfleet.workers.windows import Prepared, Window

log = get_logger("embedfleet.worker")
SLICE_MS_AUTO = {"cpu": 100.0, "cuda": 20.0}
# The speed seed's probe batches (seed_speed): a bulk-shaped batch, a small one (the fixed
# cost) and one of long texts (attention's cost per pair of tokens), so the cost model tells
# its three terms apart before the first window is planned.
SEED_SMALL_TEXTS = 8
SEED_LONG_TEXTS = 4
# The probes' times, kept per loaded model, by bulk path (which says whether it is a frozen
# copy) and torch threads: a second worker started over the same encoder in one process (the
# tests' and benchmarks' in-process workers, which share one) seeds from them instead of timing
# the same batches again (seconds of a CPU core each). A worker process measures once, as it did.
SeedKey = tuple[BulkPath, int]
_SEEDS: weakref.WeakKeyDictionary[object, dict[SeedKey, list[tuple[Shape, float]]]] = (
    weakref.WeakKeyDictionary()
)


@dataclass
class InFlightBatch:
    """A launched batch with what the compute stage needs to finish it (or retry it)."""

    window: Window
    planned: PlannedBatch
    launched: Launched
    oom_retries: int
    query_seconds: float  # queries served inside the launch (not bulk time)
    path: BulkPath = "eager"
    slice_seconds: float = 0.0  # the launch's longest stretch between query boundaries (CPU)


class Slices:
    """The bulk path's forward, its launches timed by the slice clock, and each path's
    cost model, which sizes the batches planned from it."""

    def __init__(self, parts: StageParts, queries: QueryStage, slice_clock: SliceClock) -> None:
        self.parts = parts
        # the query stage's serving time is left out of a launch's (launch_timed)
        self.queries = queries
        # the longest stretch of each bulk forward a query could not get into (model thread)
        self.slice_clock = slice_clock
        # each bulk path's slice time, fitted from every bulk forward; sizes batches to the slice
        self.slice_costs: dict[BulkPath, SliceCost] = {}
        # the bulk path's layout and launches (workers/bulk.py); made by the compute stage's
        # start, on the model thread, since varlen probes its kernels there
        self.bulk: BulkForward | None = None

    @property
    def slice_seconds(self) -> float:
        """The longest stretch of bulk compute a query may wait behind, which bulk batches are
        sized to (``_slice_limit``); 0 = no limit.

        No limit where queries are served concurrently (the CUDA query path: its own model copy
        and stream, its own thread, never at a bulk layer boundary): a query does not wait on
        bulk layers there, so capping batches would only cost throughput. Bulk batches then use
        the full token budget whatever EMBEDFLEET_SLICE_MS says."""
        if self.parts.encoder.serves_queries_concurrently:
            return 0.0
        configured = self.parts.settings.slice_ms
        if configured < 0:
            configured = SLICE_MS_AUTO.get(self.parts.encoder.device.type, 100.0)
        return configured / 1000

    def prepare(self, window: Window) -> list[Prepared]:
        """The window's batches, planned and collated."""
        assert self.bulk is not None
        lengths = [t.length for t in window.tokens]
        batching = self.parts.batching
        plans = self.bulk.plan(
            lengths, batching.token_budget, batching.max_batch, self._slice_limit()
        )
        return [
            Prepared(planned, self.bulk.collate([window.tokens[p] for p in planned.positions]))
            for planned in plans
        ]

    def make_bulk(self) -> BulkForward:
        """On the model thread: the bulk path for EMBEDFLEET_LAYOUT (varlen installs its
        attention in the model, which still runs padded batches as before)."""
        layout = resolve_layout(self.parts.settings.layout, self.parts.encoder)
        bulk = BulkForward(self.parts.encoder, layout)
        log.info(
            "bulk layout",
            layout=layout,
            kernel=bulk.packer.kernel if bulk.packer else None,
            launch_ahead=bulk.asynchronous,
        )
        return bulk

    def warm_up(self) -> None:
        """The encoder's warm-up, then one batch through the bulk path's own forward (varlen
        kernels, pinned buffers and events get their first call here, not in a timed batch)."""
        self.parts.encoder.warm_up()
        if self.bulk is None or self.bulk.layout != "varlen":
            return
        try:
            tokens = self.parts.encoder.tokenize(list(PROBE_TEXTS[:4]))
            self.bulk.launch(self.bulk.collate(tokens)).vectors()
        except Exception as error:
            if is_device_fault(error) or self.parts.settings.layout == "varlen":
                raise
            # a kernel that passed its probe but fails in the model: better padded batches
            # than every text dead-lettered as a model error
            log.warning("varlen layout failed its warm-up batch; padded batches", error=str(error))
            self.bulk = BulkForward(self.parts.encoder, "padded")

    def bulk_frozen(self) -> bool:
        """Bulk batches through the frozen, pre-packed copy: where it was kept (CPU) and the
        model computes in bf16/fp16, whose eager linear layers measured several times slower
        than the frozen graph's (docs/BENCHMARKS.md, Throughput II). In float32 the two are
        even, and eager keeps its layer boundaries for queries. Padded batches only."""
        return (
            self.parts.settings.frozen_bulk
            and self.parts.encoder.has_query_graph
            and self.parts.encoder.computes_in_reduced_precision
            and (self.bulk is None or self.bulk.layout == "padded")
        )

    def bulk_path(self) -> BulkPath:
        """The forward path bulk batches take now: each has its own cost model."""
        if self.bulk is not None and self.bulk.layout == "varlen":
            return "varlen"
        if self.bulk_frozen():
            encoder = self.parts.encoder
            return "int8" if encoder.computes_in_int8 else encoder.engine or "frozen"
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
        cost = self.slice_costs.get(self.bulk_path())
        return None if cost is None else cost.limit(self.slice_seconds)

    def launch_timed(
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
        return launched.seconds / (1 if frozen else max(1, self.parts.encoder.layer_count))

    @staticmethod
    def _shape(path: BulkPath, lengths: list[int]) -> Shape:
        """A batch's shape as its path computes it: packed rows for varlen, padded otherwise."""
        if path == "varlen":
            return Shape.packed(lengths)
        return Shape.padded(len(lengths), max(lengths))

    async def seed_speed(self) -> None:
        """Time probe batches of three shapes through the bulk path before the first window is
        read, and seed the path's cost model with them (workers/cost_model.py).

        A window's batches are planned when it is opened, with the limit known then: without a
        measured cost the first windows would get the whole token budget, batches several
        times the query slice. Each probe runs twice through a copy and the faster counts (a
        graph's first call at a new shape is slower; once through the eager model on a CPU:
        ``_probe_runs``). A worker started over an encoder whose probes were timed
        before in this process, on the same path and torch threads, seeds from those times
        (``_SEEDS``). Any error here is left for the first real batch to meet (and handle: split
        on out-of-memory, exit on a device fault)."""
        bulk = self.bulk
        if self.slice_seconds <= 0 or bulk is None or self.parts.stopping.is_set():
            return
        path = self.bulk_path()
        key: SeedKey = (path, torch.get_num_threads())
        measured = _SEEDS.setdefault(self.parts.encoder, {})
        reused = key in measured
        if not reused:
            timed = await self._time_probes(bulk, path, self.bulk_frozen())
            if timed is None:
                return
            measured[key] = timed
        samples = measured[key]
        cost = self._slice_cost(path)
        cost.seed(samples)
        log.info(
            "bulk slice cost seeded",
            path=path,
            slice_ms=round(self.slice_seconds * 1000, 1),
            probe_ms=[round(seconds * 1000, 1) for _, seconds in samples],
            fitted=str(cost.cost),
            reused=reused,
        )

    def _probe_runs(self, frozen: bool) -> int:
        """How often each probe batch runs, the fastest counting: twice through a copy (the
        frozen graph, an int8 or engine copy: its first call at a new shape specializes it) and
        on CUDA; once through the eager model on a CPU, whose first call at a shape measured as
        long as its second, the second a few seconds of every worker's start (docs/BENCHMARKS.md,
        "Stop 68")."""
        return 2 if frozen or self.parts.encoder.device.type != "cpu" else 1

    async def _time_probes(
        self, bulk: BulkForward, path: BulkPath, frozen: bool
    ) -> list[tuple[Shape, float]] | None:
        """Each probe batch's shape and its fastest time of ``_probe_runs`` (None where one
        failed: said at warning, the first windows then unsliced)."""
        loop = asyncio.get_running_loop()
        threads = self.parts.threads
        long_text = max(PROBE_TEXTS, key=len)  # over the model's maximum: truncated to it
        probes = [
            list(BULK_PROBE_TEXTS),
            list(BULK_PROBE_TEXTS[:SEED_SMALL_TEXTS]),
            [long_text] * SEED_LONG_TEXTS,
        ]
        samples: list[tuple[Shape, float]] = []
        try:
            for texts in probes:
                tokens = await loop.run_in_executor(
                    threads.tokenizer, self.parts.encoder.tokenize, texts
                )
                batch = await loop.run_in_executor(threads.tokenizer, bulk.collate, tokens)
                times = []
                for _ in range(self._probe_runs(frozen)):
                    launched, clocked, _ = await loop.run_in_executor(
                        threads.model, functools.partial(self.launch_timed, batch, frozen=frozen)
                    )
                    await loop.run_in_executor(threads.collect, launched.vectors)
                    times.append(self._slice_seconds(launched, clocked, frozen))
                samples.append((self._shape(path, [t.length for t in tokens]), min(times)))
        except Exception as error:
            log.warning(
                "speed probe batch failed; the first batches are not sliced", error=str(error)
            )
            return None
        return samples

    def learn_slice(self, in_flight: InFlightBatch) -> None:
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
        self.parts.events.bulk_slice(
            path=path,
            seconds=slice_seconds,
            predicted_seconds=predicted or 0.0,
            target_seconds=target,
            texts=len(planned.positions),
            longest=planned.longest,
        )
