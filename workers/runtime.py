"""Run a worker process: load the model, connect, handle signals, run until drained."""

from __future__ import annotations

import asyncio
import signal

import uvloop

from shared.logging import configure_logging, get_logger
from shared.redis_conn import connect
from shared.settings import Settings
from workers.encoder import Encoder
from workers.sinks import RedisStreamSink
from workers.worker import Worker

log = get_logger("embedfleet.worker")


def load_encoder(settings: Settings) -> Encoder:
    return Encoder(
        settings.model, device=settings.device, dtype=settings.dtype, threads=settings.threads
    )


async def serve(settings: Settings, encoder: Encoder | None = None) -> None:
    """Run until SIGTERM/SIGINT: the first drains in-flight work, a second aborts at once."""
    encoder = encoder or await asyncio.to_thread(load_encoder, settings)
    client = connect(settings.effective_redis_url)
    worker = Worker(settings, encoder, client, RedisStreamSink(client, settings.keys))
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
            asyncio.get_running_loop().call_later(settings.drain_timeout_s, run_task.cancel)
        else:
            log.warning("second signal: exiting now; pending entries will be reclaimed")
            run_task.cancel()

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
        await client.aclose()


def run_worker(settings: Settings) -> None:
    configure_logging(settings.log_level, settings.log_format)
    uvloop.run(serve(settings))
