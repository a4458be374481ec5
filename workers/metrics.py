"""Prometheus metrics of one worker: a ``WorkerEvents`` listener plus the streams' gauges.

Every ``WorkerMetrics`` has its own ``CollectorRegistry`` (not prometheus-client's global one),
so a test or a benchmark can run several workers in one process and read each one's numbers.
``workers/health.py`` serves the registry at ``/metrics``.

Counters and histograms are fed by the worker's hooks on the event loop. The stream gauges (lag,
pending, length) describe the whole fleet, not this worker, so ``StreamGauges`` reads them from
Redis when Prometheus scrapes (at most once a second, however many scrapers ask), through the
reader `embedfleet status` uses (``shared/fleet.py``); every worker of a model reports the same
values, so aggregate them with ``max by (model, stream)``, not ``sum``. The per-model metrics
carry a ``model`` label (the worker's model lane, or the default model's served name): a
namespace serving several models breaks down by it.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import KW_ONLY, dataclass, field
from typing import NamedTuple, Unpack

import redis.asyncio as aioredis
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)

from embedfleet.shared.dead_letters import DeadReason
from embedfleet.shared.fault_kinds import System
from embedfleet.shared.fleet import FLEET_STREAMS, INPUT_STREAMS, USAGE_COUNTERS, read_fleet
from embedfleet.shared.keys import Keys
from embedfleet.shared.logging import get_logger
from embedfleet.shared.tenants import TenantPolicy
from embedfleet.workers.events import QUERY_STAGES, BulkSlice, WorkerEvents

log = get_logger("embedfleet.metrics")

PREFIX = "embedfleet"


class MetricSpec(NamedTuple):
    """One of a worker's metrics, as ``WorkerMetrics`` registers it."""

    kind: type[Counter] | type[Gauge] | type[Histogram] | type[Info]
    name: str  # after the "embedfleet_" prefix
    documentation: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None  # histograms only

    def register(self, registry: CollectorRegistry) -> Counter | Gauge | Histogram | Info:
        if self.buckets is None:
            return self.kind(
                self.name, self.documentation, self.labels, namespace=PREFIX, registry=registry
            )
        if not issubclass(self.kind, Histogram):
            raise TypeError(f"metric {self.name!r}: buckets are for histograms only")
        return self.kind(
            self.name,
            self.documentation,
            self.labels,
            namespace=PREFIX,
            registry=registry,
            buckets=self.buckets,
        )


# WorkerMetrics attribute -> its metric, in the order they are exposed.
METRICS: dict[str, MetricSpec] = {
    "info": MetricSpec(
        Info, "worker", "This worker: consumer, model, device, dtype, forward path (once chosen)."
    ),
    "texts": MetricSpec(
        Counter,
        "texts_embedded",
        "Texts embedded, written to the sink and acknowledged.",
        ("model",),
    ),
    "tokens": MetricSpec(
        Counter,
        "tokens_embedded",
        "Real (non-padding) tokens that went through the model.",
        ("model",),
    ),
    "padded_tokens": MetricSpec(
        Counter,
        "padded_tokens",
        "Tokens the model computed, padding included (batch size × longest sequence).",
    ),
    "batches": MetricSpec(Counter, "batches", "Micro-batches that went through the model."),
    "batch_texts": MetricSpec(
        Histogram,
        "batch_texts",
        "Texts per micro-batch.",
        buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
    ),
    "batch_tokens": MetricSpec(
        Histogram,
        "batch_padded_tokens",
        "Padded tokens per micro-batch (what EMBEDFLEET_TOKEN_BUDGET bounds).",
        buckets=(64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536),
    ),
    "batch_seconds": MetricSpec(
        Histogram,
        "batch_seconds",
        "Forward-pass time of one bulk micro-batch.",
        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    ),
    "slice_seconds": MetricSpec(
        Histogram,
        "bulk_slice_seconds",
        "Longest stretch of one bulk micro-batch a query could not get into, by forward path "
        "(eager, varlen and openvino, cut at its layers: one layer; frozen, int8 and "
        "onnxruntime: the whole batch); sized to "
        "EMBEDFLEET_SLICE_MS.",
        ("path",),
        buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5),
    ),
    "slice_target_seconds": MetricSpec(
        Gauge,
        "slice_target_seconds",
        "The slice target bulk batches are sized to (EMBEDFLEET_SLICE_MS resolved).",
    ),
    "write_seconds": MetricSpec(
        Histogram,
        "write_seconds",
        "Time to write one batch of results to the sink and acknowledge its entries.",
        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
    ),
    "query_seconds": MetricSpec(
        Histogram,
        "query_latency_seconds",
        "Priority query latency, from enqueue (the entry id's time) to reply.",
        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    ),
    "query_stage_seconds": MetricSpec(
        Histogram,
        "query_stage_seconds",
        "Where an answered priority query's time went, by stage: read (enqueue until the "
        "worker's event loop had it), tokenize, wait (in the inbox until the model thread took "
        "it: the rest of a bulk slice), forward, reply (the answer written).",
        ("stage",),
        buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 1),
    ),
    "queries_by_path": MetricSpec(
        Counter,
        "queries_served",
        "Queries through the model, by path: graph or stream (CUDA query path), frozen "
        "(CPU query graph), eager (the bulk model).",
        ("path",),
    ),
    "model_seconds": MetricSpec(
        Counter,
        "model_seconds",
        "Seconds the model spent computing; rate() of it is the busy fraction over a window.",
        ("model",),
    ),
    "padding_ratio": MetricSpec(
        Gauge,
        "padding_ratio",
        "Share of computed tokens that were padding, since the worker started.",
    ),
    "model_busy_fraction": MetricSpec(
        Gauge,
        "model_busy_fraction",
        "Share of wall time the model spent computing, since the worker started.",
    ),
    "dead_letters": MetricSpec(
        Counter,
        "dead_letters",
        "Entries sent to the dead-letter stream by this worker, by reason code.",
        ("model", "reason"),
    ),
    "cache_hits": MetricSpec(
        Counter,
        "vector_cache_hits",
        "Chunks written from a vector found in the vector cache by content key (text, model "
        "revision, options): the model did not run for them.",
    ),
    "cache_misses": MetricSpec(
        Counter,
        "vector_cache_misses",
        "Chunks looked up in the vector cache and not found there (or sent with reembed): "
        "embedded by the model.",
    ),
    "tokens_saved": MetricSpec(
        Counter,
        "tokens_saved",
        "Tokens of the vector cache's hits: what the model would have computed for them.",
    ),
    "reclaims": MetricSpec(
        Counter,
        "reclaimed",
        "Entries of a dead or stuck consumer claimed by this worker (XAUTOCLAIM).",
    ),
    "sink_errors": MetricSpec(
        Counter,
        "sink_errors",
        "Failed sink writes, by exception type and kind of fault (transient: waited out; "
        "row: the row is isolated and dead-lettered; worker: the worker exits).",
        ("error", "kind"),
    ),
    "transient_faults": MetricSpec(
        Counter,
        "transient_faults",
        "Waits on a system that was unreachable or said try again, by system.",
        ("system",),
    ),
    "outages": MetricSpec(
        Gauge,
        "outages",
        "Systems this worker is waiting for right now (1 while it waits), by system.",
        ("system",),
    ),
    # Fleet-wide stream state, filled in by StreamGauges.
    "stream_length": MetricSpec(
        Gauge, "stream_length", "XLEN of each stream, by model.", ("model", "stream")
    ),
    "stream_lag": MetricSpec(
        Gauge,
        "stream_lag",
        "Entries not yet delivered to the consumer group (XINFO GROUPS lag); NaN when "
        "Redis cannot tell.",
        ("model", "stream"),
    ),
    "stream_pending": MetricSpec(
        Gauge,
        "stream_pending",
        "Entries delivered but not yet acknowledged (XINFO GROUPS pending).",
        ("model", "stream"),
    ),
    "group_consumers": MetricSpec(
        Gauge,
        "group_consumers",
        "Consumers registered in the group (XINFO GROUPS consumers), live or not.",
        ("model", "stream"),
    ),
    "tenant_backlog": MetricSpec(
        Gauge,
        "tenant_backlog",
        "XLEN of each tenant's ingest streams, summed over the partitions (issue 30).",
        ("tenant",),
    ),
    "usage": MetricSpec(
        Gauge,
        "usage",
        "What each tenant used per model and job, from the fleet's usage hashes (kept in Redis "
        "across worker restarts): counter chunks, tokens, model_us, dead, expired.",
        ("tenant", "model", "job", "counter"),
    ),
    "redis_up": MetricSpec(
        Gauge,
        "redis_up",
        "1 when the last read of the stream state from Redis succeeded, else 0.",
    ),
}


class WorkerMetrics(WorkerEvents):
    """The worker's hooks, counted into a registry of this worker's own.

    Each entry of ``METRICS`` is an attribute of the same name (``self.texts``, ...), set in
    ``__init__``; the annotations below give each its type for the type checker
    (tests/end_to_end/test_ops.py checks that they match ``METRICS``).
    """

    info: Info
    texts: Counter
    tokens: Counter
    padded_tokens: Counter
    batches: Counter
    batch_texts: Histogram
    batch_tokens: Histogram
    batch_seconds: Histogram
    slice_seconds: Histogram
    slice_target_seconds: Gauge
    write_seconds: Histogram
    query_seconds: Histogram
    query_stage_seconds: Histogram
    queries_by_path: Counter
    model_seconds: Counter
    padding_ratio: Gauge
    model_busy_fraction: Gauge
    dead_letters: Counter
    cache_hits: Counter
    cache_misses: Counter
    tokens_saved: Counter
    reclaims: Counter
    sink_errors: Counter
    transient_faults: Counter
    outages: Gauge
    stream_length: Gauge
    stream_lag: Gauge
    stream_pending: Gauge
    group_consumers: Gauge
    tenant_backlog: Gauge
    usage: Gauge
    redis_up: Gauge

    def __init__(self, registry: CollectorRegistry | None = None, *, model: str = "") -> None:
        """``model``: the ``model`` label of the per-model metrics (texts, tokens, model
        seconds, dead letters, the stream gauges): the worker's model lane, or its default
        model's served name (``model_label``)."""
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.model = model
        # The process's CPU, memory and open files, as every Prometheus exporter reports them.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        for attribute, spec in METRICS.items():
            setattr(self, attribute, spec.register(self.registry))
        self.padding_ratio.set_function(self._padding_ratio)
        self.model_busy_fraction.set_function(self._busy_fraction)
        # Every label value exists from the start, so a dashboard shows 0, not "no data".
        self._texts = self.texts.labels(model=model)
        self._tokens = self.tokens.labels(model=model)
        self._model_seconds_counter = self.model_seconds.labels(model=model)
        for reason in DeadReason:
            self.dead_letters.labels(model=model, reason=reason.value)
        for system in System:
            self.transient_faults.labels(system=system.value)
            self.outages.labels(system=system.value)
        for stream in FLEET_STREAMS:
            self.stream_length.labels(model=model, stream=stream)
        for stream in INPUT_STREAMS:
            self.stream_lag.labels(model=model, stream=stream).set(math.nan)
            self.stream_pending.labels(model=model, stream=stream)
            self.group_consumers.labels(model=model, stream=stream)

        self._started = time.perf_counter()
        self._model_seconds = 0.0
        self._real_tokens = 0
        self._padded_tokens = 0
        self._reported_busy: float | None = None
        # When the model last produced vectors (time.monotonic()); /readyz takes it as proof
        # that the device works, instead of running a probe of its own.
        self.last_forward_at: float | None = None
        self._description: dict[str, str] = {}

    # --- what the runtime tells us ----------------------------------------------------
    def describe_worker(self, *, consumer: str, model: str, device: str, dtype: str) -> None:
        self._description = {"consumer": consumer, "model": model, "device": device}
        self._description.update(dtype=dtype, forward_path="choosing")
        self.info.info(self._description)

    def forward_path_chosen(self, *, path: str) -> None:
        # The dtype label alone says bfloat16 or float32 even where an int8 copy runs batches.
        self._description["forward_path"] = path
        self.info.info(self._description)

    def restart_clock(self) -> None:
        """Busy fraction counts from here: call when the model is loaded and work can start."""
        self._started = time.perf_counter()

    # --- WorkerEvents -----------------------------------------------------------------
    def batch_encoded(
        self, *, texts: int, real_tokens: int, padded_tokens: int, seconds: float
    ) -> None:
        self.batches.inc()
        self._tokens.inc(real_tokens)
        self.padded_tokens.inc(padded_tokens)
        self.batch_texts.observe(texts)
        self.batch_tokens.observe(padded_tokens)
        self.batch_seconds.observe(seconds)
        self._model_seconds_counter.inc(seconds)
        self._model_seconds += seconds
        self.last_forward_at = time.monotonic()
        self._real_tokens += real_tokens
        self._padded_tokens += padded_tokens

    def bulk_slice(self, **slice_: Unpack[BulkSlice]) -> None:
        self.slice_seconds.labels(path=slice_["path"]).observe(slice_["seconds"])
        self.slice_target_seconds.set(slice_["target_seconds"])

    def results_written(self, *, texts: int, seconds: float) -> None:
        self._texts.inc(texts)
        self.write_seconds.observe(seconds)

    def query_answered(self, *, latency_seconds: float) -> None:
        self.query_seconds.observe(max(0.0, latency_seconds))
        self.last_forward_at = time.monotonic()

    def query_stages(
        self, *, read: float, tokenize: float, wait: float, forward: float, reply: float
    ) -> None:
        for stage, seconds in zip(
            QUERY_STAGES, (read, tokenize, wait, forward, reply), strict=True
        ):
            self.query_stage_seconds.labels(stage=stage).observe(max(0.0, seconds))

    def queries_served(self, *, count: int, path: str) -> None:
        self.queries_by_path.labels(path=path).inc(count)

    def dead_lettered(self, *, count: int, reason: str) -> None:
        self.dead_letters.labels(model=self.model, reason=reason).inc(count)

    def vector_cache_checked(self, *, hits: int, misses: int, tokens_saved: int) -> None:
        self.cache_hits.inc(hits)
        self.cache_misses.inc(misses)
        self.tokens_saved.inc(tokens_saved)

    def reclaimed(self, *, count: int) -> None:
        self.reclaims.inc(count)

    def sink_error(self, *, error: BaseException, kind: str) -> None:
        self.sink_errors.labels(error=type(error).__name__, kind=kind).inc()

    def transient_fault(self, *, system: str, doing: str) -> None:
        self.transient_faults.labels(system=system).inc()

    def outage(self, *, system: str, active: bool) -> None:
        self.outages.labels(system=system).set(1 if active else 0)

    def model_busy(self, *, fraction: float) -> None:
        self._reported_busy = fraction

    # --- computed at scrape time --------------------------------------------------------
    def _padding_ratio(self) -> float:
        if not self._padded_tokens:
            return 0.0
        return 1.0 - self._real_tokens / self._padded_tokens

    def _busy_fraction(self) -> float:
        # The worker's own figure when it reports one; else the same thing from batch_encoded.
        if self._reported_busy is not None:
            return self._reported_busy
        elapsed = time.perf_counter() - self._started
        return 0.0 if elapsed <= 0 else min(1.0, self._model_seconds / elapsed)


@dataclass(eq=False)
class StreamGauges:
    """Fills the stream gauges from Redis: XLEN of every stream, XINFO GROUPS of the inputs.

    One pipelined round trip. ``refresh`` is called per scrape; scrapes within ``min_interval_s``
    of the last refresh (or while one is running) reuse its values, so a crowd of scrapers costs
    Redis one round trip a second.
    """

    metrics: WorkerMetrics
    client: aioredis.Redis
    keys: Keys
    _: KW_ONLY
    policy: TenantPolicy = field(default_factory=TenantPolicy)
    min_interval_s: float = 1.0
    timeout_s: float = 2.0

    def __post_init__(self) -> None:
        self._refreshed_at = -math.inf
        self._last_ok = False
        self._lock = asyncio.Lock()

    async def refresh(self) -> bool:
        """Update the gauges; False (and ``embedfleet_redis_up`` 0) when Redis did not answer."""
        async with self._lock:
            if time.monotonic() - self._refreshed_at < self.min_interval_s:
                return self._last_ok
            try:
                await asyncio.wait_for(self._read(), self.timeout_s)
            except (TimeoutError, OSError, aioredis.RedisError) as error:
                # Keep the last values: a blip in Redis should not zero the lag on a dashboard;
                # embedfleet_redis_up says they are stale.
                log.warning("stream gauges not refreshed", error=f"{type(error).__name__}: {error}")
                self._last_ok = False
            else:
                self._last_ok = True
            self.metrics.redis_up.set(1 if self._last_ok else 0)
            self._refreshed_at = time.monotonic()
            return self._last_ok

    async def _read(self) -> None:
        # the fleet reader `embedfleet status` uses too, asked for the streams only
        state = await read_fleet(self.client, self.keys, usage=True)
        metrics = self.metrics
        model = metrics.model
        for tenant, stream in state.tenants.items():
            metrics.tenant_backlog.labels(tenant=self.policy.named(tenant)).set(stream.length)
        for row in state.usage:
            labels = {
                "tenant": self.policy.named(row.tenant),
                "model": row.model,
                "job": row.job or "",
            }
            for counter in USAGE_COUNTERS:
                metrics.usage.labels(**labels, counter=counter).set(getattr(row, counter))
        for name, stream in state.streams.items():
            metrics.stream_length.labels(model=model, stream=name).set(stream.length)
        for name in INPUT_STREAMS:
            stream = state.streams[name]
            # no group yet: it will be created at id 0, so every entry is still to deliver
            metrics.stream_lag.labels(model=model, stream=name).set(
                math.nan if stream.lag is None else stream.lag
            )
            metrics.stream_pending.labels(model=model, stream=name).set(stream.pending)
            metrics.group_consumers.labels(model=model, stream=name).set(stream.group_consumers)
