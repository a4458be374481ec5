"""The parts the worker's stages share, built once (``StageParts.build``) and handed to each.

Intake, compute, write and the query stage (its inbox too) each read the same settings,
encoder, connection, consumer, outputs, vector cache, dead letters, in-flight set, outages,
events, threads and drain flag; one object carries them, so a stage's constructor says what is
its own and nothing is built twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from embedfleet.shared.keys import Keys
from embedfleet.shared.settings import Batching, Settings
from embedfleet.shared.vector_cache import VectorCache
from embedfleet.sinks import Sink
from embedfleet.workers.calibration import Calibration, CalibrationStore
from embedfleet.workers.consumer import StreamConsumer
from embedfleet.workers.cpus import usable_cpus
from embedfleet.workers.dead_letter_writer import DeadLetters
from embedfleet.workers.events import StatsEvents, WorkerEvents, WorkerStats
from embedfleet.workers.model.encoder import Encoder
from embedfleet.workers.outages import Outages
from embedfleet.workers.output import Outputs
from embedfleet.workers.reclaim import InFlight


@dataclass
class Threads:
    """The worker's own threads: one runs the model (queries and bulk batches, never two
    forward passes at once), two open windows (decode, tokenize, plan, collate; one on a single
    CPU), one runs the windows' batch tokenizer calls, one waits for copy backs (CUDA)."""

    model: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
    )
    # Two where there is a second CPU, so that while one window's texts are in the
    # tokenizer's Rust (``encode``), the next window's Python (decode, validate) and the one
    # before's (plan, collate) run beside it: one thread alone left a core idle for each
    # window's Python (docs/BENCHMARKS.md, stop 65). On one CPU they would only take turns.
    # Windows still reach the compute stage in read order (workers/intake.py).
    tokenizer: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(
            max_workers=2 if usable_cpus() > 1 else 1, thread_name_prefix="tokenize"
        )
    )
    # One: the windows' batch tokenizer calls one at a time, each on every core (the
    # tokenizers library's own pool), never two sharing the cores in step.
    encode: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode")
    )
    # waits for copy backs off the event loop and off the model thread (CUDA only)
    collect: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="collect")
    )

    def shutdown(self) -> None:
        """Queued work is cancelled; a forward pass already running is not waited for."""
        for thread in (self.model, self.tokenizer, self.encode, self.collect):
            thread.shutdown(wait=False, cancel_futures=True)


@dataclass
class StageParts:
    """What every stage of one worker shares."""

    settings: Settings
    encoder: Encoder
    client: aioredis.Redis
    sink: Sink
    # the counters of this run, kept current by ``events``, which passes every event on to the
    # listener the worker was given (its metrics, a test's recorder)
    stats: WorkerStats
    events: WorkerEvents
    consumer: StreamConsumer
    # what the reclaimer renews: the entries being computed, and those the sink holds written
    # and not yet acknowledged (a Parquet shard's, also while its store is down)
    in_flight: InFlight
    dead_letters: DeadLetters
    outages: Outages
    outputs: Outputs
    # stored vectors by content key (shared/vector_cache.py): a hit skips the model
    vector_cache: VectorCache
    # EMBEDFLEET_READ_COUNT / TOKEN_BUDGET / MAX_BATCH, -1 resolved for this device
    batching: Batching
    threads: Threads
    # set by drain(): stop reading, finish what was read
    stopping: asyncio.Event

    @classmethod
    def build(
        cls,
        settings: Settings,
        encoder: Encoder,
        client: aioredis.Redis,
        sink: Sink,
        listener: WorkerEvents,
    ) -> StageParts:
        keys = settings.keys
        stats = WorkerStats()
        events = StatsEvents(stats, listener)
        calibrations = CalibrationStore(client, keys, encoder.name, settings.calibration_file)
        batching = settings.batching(encoder.device.type)
        return cls(
            settings=settings,
            encoder=encoder,
            client=client,
            sink=sink,
            stats=stats,
            events=events,
            consumer=StreamConsumer(
                client,
                keys,
                settings.consumer,
                partitions=settings.read_partitions,
                policy=settings.tenant_policy,
                max_read_bytes=batching.read_max_bytes,
            ),
            in_flight=InFlight(sink),
            dead_letters=DeadLetters(
                client,
                keys,
                events,
                settings.reply_ttl_s,
                settings.dead_payload_max_bytes,
                settings.job_reply_ttl_s,
                model=encoder.name,
            ),
            outages=Outages(events),
            outputs=Outputs(settings, encoder, calibrations),
            vector_cache=VectorCache(
                client, keys, settings.vector_cache_mb, settings.vector_cache_ttl_s
            ),
            batching=batching,
            threads=Threads(),
            stopping=asyncio.Event(),
        )

    @property
    def keys(self) -> Keys:
        return self.settings.keys

    async def on_model_thread(self, function: Callable[[], Calibration]) -> Calibration:
        return await asyncio.get_running_loop().run_in_executor(self.threads.model, function)
