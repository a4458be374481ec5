"""The worker's HTTP endpoints on EMBEDFLEET_HEALTH_PORT: /healthz, /readyz and /metrics.

An aiohttp server on the worker's own event loop, not on a thread: when the loop is stuck, the
probes time out, which is exactly what a liveness probe should notice.

- ``/healthz``: alive. Answering at all proves the event loop runs; it answers while the model
  is still loading, so a startup probe passes during a long load. It answers 503 when a sink
  call has outlived its bound (``Sink.stalled``: a database that no longer answers the worker's
  connection, which only a restart frees; the entries it holds are then reclaimed by others).
- ``/readyz``: ready to embed: the model is loaded, Redis answers PING, and the device works.
  The device works when a forward pass succeeded in the last ``device_check_ttl_s``: one of the
  worker's own batches or queries, or else a probe of the real model on one short text, run on
  the worker's model thread (the encoder is single-threaded: its layer hooks serve queries) and
  cached for that long, so frequent probes stay cheap. PING is not cached, so an outage shows
  at once. Draining (after SIGTERM) is not ready, and neither is a worker waiting out an outage
  of a system it needs (the database, Redis): each open outage is a failed check, named after
  the system, with what failed and for how long (workers/outages.py).
- ``/metrics``: the worker's Prometheus registry, the stream gauges refreshed first.
"""

from __future__ import annotations

import asyncio
import math
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING

import numpy as np
import redis.asyncio as aioredis
from aiohttp import web
from prometheus_client.exposition import choose_encoder

from embedfleet.shared.logging import get_logger
from embedfleet.workers.metrics import StreamGauges, WorkerMetrics

if TYPE_CHECKING:
    from embedfleet.sinks import Sink
    from embedfleet.workers.model.encoder import EncodeBatch, Encoder
    from embedfleet.workers.outages import Outages

log = get_logger("embedfleet.health")
OK = "ok"


@dataclass(frozen=True)
class DeviceCheck:
    ok: bool
    detail: str
    checked_at: float


@dataclass(eq=False)
class HealthServer:
    """Serves the probes and the metrics; ``start`` before loading the model, ``stop`` at exit."""

    port: int
    client: aioredis.Redis
    metrics: WorkerMetrics
    gauges: StreamGauges | None = None
    _: KW_ONLY
    host: str | None = None  # None: every interface (IPv4 and IPv6); the kubelet probes pod IPs
    device_check_ttl_s: float = 5.0
    check_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        self._encoder: Encoder | None = None
        self._probe_batch: EncodeBatch | None = None
        self._device_check: DeviceCheck | None = None
        self._device_task: asyncio.Future[float] | None = None
        self._executor: Executor | None = None
        self._own_executor: ThreadPoolExecutor | None = None
        self._draining = False
        self._outages: Outages | None = None
        self._sink: Sink | None = None
        self.device_checks = 0  # forward passes run for /readyz, to see that the cache works
        self._started = time.monotonic()
        self._runner: web.AppRunner | None = None

    # --- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        # No access log: probes every few seconds would drown the worker's own lines.
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host=self.host, port=self.port, reuse_address=True)
        try:
            await site.start()
        except OSError as error:
            await self._runner.cleanup()
            self._runner = None
            raise RuntimeError(
                f"cannot listen on EMBEDFLEET_HEALTH_PORT={self.port}: {error.strerror or error}"
            ) from error
        log.info("health server listening", port=self.port, paths="/healthz /readyz /metrics")

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._own_executor is not None:
            self._own_executor.shutdown(wait=False, cancel_futures=True)

    def model_loaded(self, encoder: Encoder, model_thread: Executor | None = None) -> None:
        """The model is in memory: readiness may now pass. Call on the event loop.

        ``model_thread`` is the worker's single model thread; the probe runs there so that it
        never runs beside a batch. Without one (no worker), the server uses a thread of its own.
        """
        # Tokenized once here, so the readiness check runs only the forward pass (the worker's
        # tokenizer thread owns the tokenizer from now on).
        self._probe_batch = encoder.collate(encoder.tokenize(["readiness check"]))
        if model_thread is None:
            self._own_executor = ThreadPoolExecutor(1, thread_name_prefix="readiness")
            model_thread = self._own_executor
        self._executor = model_thread
        self._encoder = encoder

    def watch_outages(self, outages: Outages) -> None:
        """Report not ready while the worker waits for a system (workers/outages.py)."""
        self._outages = outages

    def watch_sink(self, sink: Sink) -> None:
        """Report not alive while a call to ``sink`` outlives its bound (``Sink.stalled``)."""
        self._sink = sink

    def draining(self) -> None:
        """After SIGTERM: report not ready, so Kubernetes stops counting this pod as available."""
        self._draining = True

    # --- handlers -----------------------------------------------------------------------
    async def _healthz(self, request: web.Request) -> web.Response:
        stalled = self._sink.stalled() if self._sink is not None else None
        body: dict[str, object] = {
            "alive": stalled is None,
            "model_loaded": self._encoder is not None,
            "uptime_s": round(time.monotonic() - self._started, 3),
        }
        if stalled is not None:
            body["sink"] = stalled
        return web.json_response(body, status=200 if stalled is None else 503)

    async def _readyz(self, request: web.Request) -> web.Response:
        checks = await self.readiness()
        ready = all(value == OK for value in checks.values())
        return web.json_response({"ready": ready, "checks": checks}, status=200 if ready else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.gauges is not None:
            await self.gauges.refresh()
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(
            body=encode(self.metrics.registry), headers={"Content-Type": content_type}
        )

    # --- checks -------------------------------------------------------------------------
    async def readiness(self) -> dict[str, str]:
        """Each check's result: "ok", or what is wrong, for a person reading the probe's body."""
        checks: dict[str, str] = {}
        if self._draining:
            checks["draining"] = "draining after SIGTERM: finishing in-flight work"
        checks["model"] = OK if self._encoder is not None else "loading"
        checks["redis"] = await self._check_redis()
        if self._outages is not None:
            for system, detail in self._outages.describe().items():
                if checks.get(system, OK) == OK:
                    checks[system] = detail
        checks["device"] = await self._check_device() if self._encoder else "model not loaded yet"
        return checks

    async def _check_redis(self) -> str:
        try:
            await asyncio.wait_for(self.client.ping(), self.check_timeout_s)
        except TimeoutError:
            return f"PING got no answer in {self.check_timeout_s:g}s"
        except (OSError, aioredis.RedisError) as error:
            return f"PING failed: {type(error).__name__}: {error}"
        return OK

    async def _check_device(self) -> str:
        now = time.monotonic()
        worked = self.metrics.last_forward_at
        if worked is not None and now - worked < self.device_check_ttl_s:
            return OK  # the worker's own batches prove the device: no probe needed
        cached = self._device_check
        if cached is not None and now - cached.checked_at < self.device_check_ttl_s:
            return OK if cached.ok else cached.detail
        if self._device_task is None:
            # One probe at a time, shared by concurrent requests, queued on the model thread.
            loop = asyncio.get_running_loop()
            self._device_task = loop.run_in_executor(self._executor, self._forward)
        task = self._device_task
        try:
            seconds = await asyncio.wait_for(asyncio.shield(task), self.check_timeout_s)
        except TimeoutError:
            # Not cached and the task kept: a hung device stays "not ready" until it answers.
            return f"forward pass did not finish in {self.check_timeout_s:g}s"
        except Exception as error:
            ok, detail = False, f"forward pass failed: {type(error).__name__}: {error}"
        else:
            ok, detail = True, f"forward pass in {seconds * 1000:.1f} ms"
        self._device_task = None
        self._device_check = DeviceCheck(ok, detail, time.monotonic())
        return OK if ok else detail

    def _forward(self) -> float:
        encoder, batch = self._encoder, self._probe_batch
        assert encoder is not None and batch is not None, "model_loaded() sets both"
        self.device_checks += 1
        started = time.perf_counter()
        vectors = encoder.embed(batch)
        seconds = time.perf_counter() - started
        if vectors.shape != (1, encoder.dim) or not np.isfinite(vectors).all():
            raise RuntimeError(
                f"the model on {encoder.device} returned a bad vector "
                f"(shape {vectors.shape}, finite: {bool(np.isfinite(vectors).all())})"
            )
        if encoder.pooling.normalize and not math.isclose(
            float(np.linalg.norm(vectors[0])), 1.0, abs_tol=1e-2
        ):
            raise RuntimeError(f"the model on {encoder.device} returned a vector of wrong norm")
        return seconds
