"""Run a worker process: load the model, connect, handle signals, run until drained."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import sys
import threading

import redis.asyncio as aioredis
import uvloop
from prometheus_client import disable_created_metrics

from embedfleet.shared.eviction import warn_on_eviction_policy
from embedfleet.shared.logging import configure_logging, get_logger
from embedfleet.shared.model_registry import model_label
from embedfleet.shared.redis_conn import connect_settings
from embedfleet.shared.settings import Settings
from embedfleet.sinks import NO_EXTRAS, Extras, Sink, build_sink, parse_sink_url
from embedfleet.workers.health import HealthServer
from embedfleet.workers.metrics import StreamGauges, WorkerMetrics
from embedfleet.workers.model.encoder import Encoder
from embedfleet.workers.model.model_dir import UnsupportedModelError, directory_revision
from embedfleet.workers.outages import RideOut, classify_sink_error, ride_out
from embedfleet.workers.replicas import gpu_memory_share, limit_gpu_memory
from embedfleet.workers.worker import Worker

# After a second signal, how long the worker may take to exit before it is cut short
SECOND_SIGNAL_GRACE_S = 2.0
log = get_logger("embedfleet.worker")


def check_sink_holds(settings: Settings, encoder: Encoder) -> None:
    """Refuse (UnsupportedModelError, exit 1) a sparse-only or rerank model with a database
    sink: a table's row is keyed on its dense vector (a multi-representation model's sparse
    and per-token vectors are kept beside it, ``sink_extras``); scores and sparse weights
    alone only the results stream carries, and a sink given an empty vector would fail on
    every write instead."""
    if encoder.representation == "dense":
        return
    kind = parse_sink_url(settings.sink, settings.sink_table).kind
    if kind != "redis":
        raise UnsupportedModelError(
            f"the model {encoder.name!r} gives {encoder.representation} results, which the "
            f"{kind} sink cannot store yet; use EMBEDFLEET_SINK=redis (the results stream)"
        )


def sink_extras(encoder: Encoder) -> Extras:
    """What a database sink keeps beside the dense vector for this model: the sparse weights
    and per-token vectors of a multi-representation model (BGE-M3), else nothing."""
    layout = encoder.layout
    if layout is None:
        return NO_EXTRAS
    return Extras(
        sparse_dim=layout.vocab_size if "sparse" in encoder.representations else None,
        multivector_dim=layout.colbert_dim or None,
    )


# The collector's thresholds in a worker process: its youngest generation is collected once
# this many more container objects are alive than at its last collection, the older ones after
# 10 collections of the one below (Python's). Python's 700 suits a program whose objects die
# young; a worker keeps a window's chunks, token ids and results alive while it is opened,
# computed and written (several objects per entry of a read window), so at 700 the collector
# ran hundreds of times per window, promoted every window to the oldest generation and paused
# every thread, the query path's too, to collect it there. The measurement: docs/BENCHMARKS.md,
# "Stop 64".
COLLECTOR_THRESHOLDS = (100_000, 10, 10)


def freeze_loaded_heap() -> None:
    """Once a worker process has loaded its model: everything made so far (the model, torch's
    and transformers' modules, millions of objects) lives as long as the process, so it is
    frozen out of the garbage collector and each collection scans only what the stream work
    makes, not the whole heap (issue 53: a GPU host's CPU per text); and the collector runs at
    the worker's thresholds (``COLLECTOR_THRESHOLDS``). Per process, not per Worker: a process
    that runs several (the tests) would otherwise freeze their garbage too."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*COLLECTOR_THRESHOLDS)


def load_encoder(settings: Settings) -> Encoder:
    encoder: Encoder
    if settings.benchmark_standin_encoder_us_per_token is not None:
        from embedfleet.workers.model.standin import StandInEncoder

        cost = settings.benchmark_standin_encoder_us_per_token
        encoder = StandInEncoder(
            settings.model, us_per_token=cost, threads=settings.threads, name=settings.model_lane
        )
        log.warning(
            "BENCHMARK STAND-IN ENCODER: no model runs, the vectors are made up; never use this "
            "in production",
            setting="EMBEDFLEET_BENCHMARK_STANDIN_ENCODER_US_PER_TOKEN",
            us_per_token=cost,
            model=encoder.name,
        )
    else:
        # a model lane's workers serve under the lane's name: the name requests route by
        encoder = Encoder(
            settings.model,
            device=settings.device,
            dtype=settings.dtype,
            threads=settings.threads,
            name=settings.model_lane,
        )
    # a replica's share of a GPU it shares (the parent passes it); the allocator's cap counts
    # the weights already loaded as well as what comes. REPLICAS=auto reaches here only in a
    # process that runs the model itself (`embedfleet worker` starts a supervisor for more than
    # one): one process, no share of its own.
    processes = settings.replicas if isinstance(settings.replicas, int) else 1
    limit_gpu_memory(gpu_memory_share(settings.gpu_memory_fraction, processes), encoder.device)
    model_dir = getattr(encoder, "model_dir", None)
    if not settings.model_revision and model_dir is not None:
        # the card's revision hashes every file of the model (cached per directory state):
        # done here, with the load, so the worker's first reads do not share a core with it
        # (it was ~10% of the host path's CPU over 20,000 texts: docs/BENCHMARKS.md, stop 58)
        directory_revision(model_dir)
    # likewise the card (which the worker publishes once it reads): its tokenizer fingerprint
    # is a digest of tokenizer.json made canonical, parsed and written again (~0.3 s of CPU
    # for a BERT vocabulary)
    _ = encoder.card  # a cached property: computed here, for the first reads' sake
    return encoder


async def serve(settings: Settings, encoder: Encoder | None = None) -> None:
    """Run until SIGTERM/SIGINT: the first drains in-flight work, a second aborts at once."""
    client = connect_settings(settings)
    # beside the start (the model loads meanwhile): a person reads the warning early
    policy_check = asyncio.ensure_future(warn_on_eviction_policy(client))
    metrics = WorkerMetrics(model=model_label(settings))
    # Up before the model loads: /healthz answers during a long load (the startup probe) and
    # /readyz says "loading" until the model is in memory.
    health = await start_health_server(settings, client, metrics)
    try:
        await _serve(settings, encoder, client, metrics, health)
    finally:
        policy_check.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await policy_check
        if health is not None:
            await health.stop()
        await client.aclose()


async def start_health_server(
    settings: Settings, client: aioredis.Redis, metrics: WorkerMetrics
) -> HealthServer | None:
    """The /healthz, /readyz and /metrics server on EMBEDFLEET_HEALTH_PORT; None when it is 0."""
    if not settings.health_port:
        return None
    gauges = StreamGauges(metrics, client, settings.keys, policy=settings.tenant_policy)
    health = HealthServer(settings.health_port, client, metrics, gauges)
    await health.start()
    return health


async def _serve(
    settings: Settings,
    encoder: Encoder | None,
    client: aioredis.Redis,
    metrics: WorkerMetrics,
    health: HealthServer | None,
) -> None:
    if encoder is None:  # (`encoder or await ...` is not narrowed by mypy)
        encoder = await asyncio.to_thread(load_encoder, settings)
    worker, sink = await _set_up(settings, encoder, client, metrics, health)
    await _run_until_stopped(settings, worker, sink, health)


async def _set_up(
    settings: Settings,
    encoder: Encoder,
    client: aioredis.Redis,
    metrics: WorkerMetrics,
    health: HealthServer | None,
) -> tuple[Worker, Sink]:
    """The worker and its sink, the sink's table set up and the health server told."""
    freeze_loaded_heap()
    metrics.describe_worker(
        consumer=settings.consumer,
        model=encoder.name,
        device=str(encoder.device),
        dtype=str(encoder.dtype).removeprefix("torch."),
    )
    check_sink_holds(settings, encoder)
    sink = build_sink(settings, client)
    worker = Worker(settings, encoder, client, sink, metrics)
    if health is not None:
        health.watch_outages(worker.outages)
        health.watch_sink(sink)
    # the table/collection exists, with the model's dimension, before the first write; a
    # database that is not up yet is waited for, like one that goes away later
    ride = RideOut("setting up the sink", worker.outages, metrics)
    dim = settings.dimensions or encoder.dim
    extras = sink_extras(encoder)
    await ride_out(
        ride, sink.system, lambda: sink.setup(encoder.name, dim, extras), classify_sink_error
    )
    if health is not None:
        # The readiness probe's forward pass queues on the worker's one model thread.
        health.model_loaded(encoder, worker.model_thread)
    return worker, sink


async def _run_until_stopped(
    settings: Settings, worker: Worker, sink: Sink, health: HealthServer | None
) -> None:
    """Run the worker until it ends: a first SIGTERM/SIGINT drains it (cancelled after
    EMBEDFLEET_DRAIN_TIMEOUT_S), a second stops it at once; the sink is closed either way."""
    run_task = asyncio.ensure_future(worker.run())
    signals_seen = 0

    def on_signal(signum: int) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen == 1:
            log.info(
                "draining: finishing in-flight work",
                signal=signal.Signals(signum).name,
                timeout_s=settings.drain_timeout_s,
            )
            worker.drain()
            if health is not None:
                health.draining()
            asyncio.get_running_loop().call_later(settings.drain_timeout_s, run_task.cancel)
        else:
            log.warning("second signal: exiting now; pending entries will be reclaimed")
            run_task.cancel()
            # Queued model work is cancelled when the worker stops, but a forward pass already
            # running is one native call the interpreter joins before it exits: on a loaded CPU
            # that outlasted a minute (CI). "At once" must not wait on it; a daemon timer exits.
            timer = threading.Timer(SECOND_SIGNAL_GRACE_S, _exit_now, (128 + signum,))
            timer.daemon = True
            timer.start()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        await run_task
    except asyncio.CancelledError:
        if signals_seen == 0:
            raise
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        await sink.close()


def _exit_now(status: int) -> None:
    """The second signal's hard exit (128 + the signal, as a shell reports one)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_worker(settings: Settings) -> None:
    configure_logging(settings.log_level, settings.log_format)
    # The *_created series double the count of series and no dashboard here reads them.
    disable_created_metrics()
    uvloop.run(serve(settings))
