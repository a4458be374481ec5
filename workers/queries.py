"""The query stage: single queries answered ahead of bulk work.

Its inbox (workers/query_inbox.py) reads the query stream on the event loop and queues each
query tokenized; the model thread serves the inbox either right away (when idle) or at the next
transformer-layer boundary of the bulk batch it is computing (see
``Encoder.set_layer_callback``).

The model thread also writes the answer (reply list + acknowledgement, one MULTI) through its
own blocking connection, straight after the forward pass. Handing the vectors back to the event
loop first cost two more thread wake-ups per query, and on a small CPU every extra runnable
thread also stalls the OpenMP team of a bulk batch in flight.

On CUDA the layer hooks fire at launch, not at run time, so they are not installed: queries are
served from a thread of their own through the encoder's CUDA query path (its own model copy on
a high-priority stream, CUDA graphs; see workers/model/cuda_queries.py), beside the bulk pass.

A failed query forward pass is handled by one method on either thread (``_on_model_error``,
workers/device_faults.py's classification): out of memory halves the batch and never
dead-letters a query for it; any other CUDA error stops the worker (``DeviceFault`` out of
``run``) with the queries left pending for a healthy worker; other errors dead-letter the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import redis

from embedfleet.shared.dead_letters import DeadReason
from embedfleet.shared.fault_kinds import is_transient
from embedfleet.shared.keys import Keys
from embedfleet.shared.logging import get_logger
from embedfleet.shared.protocol import encode_result
from embedfleet.shared.redis_conn import connect_sync
from embedfleet.shared.settings import Settings
from embedfleet.sinks.reply import queue_replies
from embedfleet.workers import device_faults
from embedfleet.workers.consumer import StreamEntry
from embedfleet.workers.cost_model import SliceClock
from embedfleet.workers.dead_letter_writer import Rejected
from embedfleet.workers.device_faults import DeviceFault, Recovery
from embedfleet.workers.long_inputs import before_normalize_wanted, normalized_except
from embedfleet.workers.model.encoder import Encoder
from embedfleet.workers.model.model_dir import head_normalizes
from embedfleet.workers.output import pool_windows
from embedfleet.workers.parts import StageParts
from embedfleet.workers.query_inbox import PendingQuery, QueryInbox

log = get_logger("embedfleet.queries")


def prepare_forward_paths(encoder: Encoder, settings: Settings) -> bool:
    """The CPU copy queries (and frozen bulk) run through, chosen once as a worker's query stage
    does at start from its settings (FROZEN_QUERIES, CPU_INT8, CPU_INT8_PATH, CPU_BACKEND,
    OPENVINO_PRECISION); whether one was kept. The benchmarks call this too, so that their
    in-process encoder takes the worker's path. On the model thread: it runs the model."""
    if not settings.frozen_queries:
        return False
    return encoder.prepare_query_graph(
        settings.cpu_int8_choice, settings.cpu_backend, settings.openvino_precision
    )


class QueryStage:
    def __init__(self, parts: StageParts, slice_clock: SliceClock | None = None) -> None:
        """The worker's shared parts (workers/parts.py): settings, encoder, connection, dead
        letters, events, outputs, outages and the model thread the queries are served on."""
        self.settings = parts.settings
        # told of every layer boundary of a bulk pass and of the queries served there, so the
        # worker knows the longest stretch a query had to wait (workers/cost_model.py)
        self.slice_clock = slice_clock or SliceClock()
        self.outages = parts.outages
        self.encoder = parts.encoder
        self.model_thread = parts.threads.model
        self.dead_letters = parts.dead_letters
        self.events = parts.events
        self.outputs = parts.outputs
        # the query stream read and its queries queued, on the event loop (workers/query_inbox.py)
        self.inbox = QueryInbox(parts, queued=self._queued)
        # the priority streams' key set: query stream, replies, dead letters in one slot
        self.keys: Keys = self.inbox.keys
        self._inbox = self.inbox.pending  # the serving thread's side of the same deque
        # Re-entrance from the layer hook (the nested forward pass fires them too); the lock
        # keeps the model thread and the CUDA query thread from serving at once while the
        # stage switches from one to the other at startup.
        self._serving = False
        self._serve_lock = threading.Lock()
        # where serve_inbox runs: the model thread, or on CUDA the CUDA query thread
        self._serve_thread: ThreadPoolExecutor = self.model_thread
        # Model-thread seconds spent on queries, so bulk timing can leave them out.
        self.serving_seconds = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failures: set[asyncio.Task[None]] = set()
        self._reply_client: redis.Redis | None = None  # only touched on the model thread
        # A CUDA error that poisoned the context, set once by the serving thread: nothing more
        # is served, and run() raises it (the worker stops, the queries stay pending).
        self._device_fault: DeviceFault | None = None
        self._faulted: asyncio.Future[None] | None = None
        # Set once the stage is prepared (frozen graph or CUDA copy built) and about to read.
        self.ready = asyncio.Event()

    async def run(self, stopping: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        # on the model thread, before any query or bulk batch (it runs the model)
        await self._loop.run_in_executor(
            self.model_thread, prepare_forward_paths, self.encoder, self.settings
        )
        mode = self.settings.cuda_query_lane
        if await self._loop.run_in_executor(
            self.model_thread, lambda: self.encoder.prepare_cuda_queries(mode)
        ):
            self._serve_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="queries")
        else:
            self.encoder.set_layer_callback(self.serve_at_layer_boundary)
        self.ready.set()
        log.info(
            "query stage ready",
            # on its own thread (CUDA) queries run beside bulk batches, which are then not
            # sliced (Worker.slice_seconds; the "worker started" line's slice_ms came before)
            served_on=(
                "own thread and model copy"
                if self.encoder.serves_queries_concurrently
                else "model thread"
            ),
            frozen_graph=self.encoder.has_query_graph,
            forward_path=self.encoder.forward_path,
        )
        self._faulted = self._loop.create_future()
        reading = asyncio.create_task(self.inbox.read(stopping), name="query-reader")
        try:
            await asyncio.wait((reading, self._faulted), return_when=asyncio.FIRST_COMPLETED)
            if self._device_fault is not None:
                raise self._device_fault
            reading.result()
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            self.encoder.set_layer_callback(None)
            # the last answers are written on the serving thread: let them finish
            with contextlib.suppress(RuntimeError):  # the executor is already shut down
                await asyncio.get_running_loop().run_in_executor(self._serve_thread, self._close)
            if self._serve_thread is not self.model_thread:
                self._serve_thread.shutdown(wait=False)
            if self._failures:
                await asyncio.gather(*self._failures, return_exceptions=True)

    async def accept(self, entries: list[StreamEntry]) -> None:
        """Queries read elsewhere (the reclaimer's), queued as the inbox queues its own."""
        await self.inbox.accept(entries)

    def _queued(self) -> None:
        """Queries queued: served at once if the model is idle; if a bulk batch is in flight,
        the layer hook serves the inbox first and this call finds it empty. A plain submit, not
        run_in_executor: nothing awaits it, and its completion would wake the event loop just
        while the answer travels to the caller."""
        self._serve_thread.submit(self.serve_inbox).add_done_callback(_log_unexpected)

    # --- model thread ------------------------------------------------------------------
    def serve_at_layer_boundary(self) -> None:
        if self._serving:  # a query's own forward pass fires the hooks too
            return
        self.slice_clock.boundary()
        if self._inbox:
            self.serve_inbox()
            self.slice_clock.resume()  # the queries' time is not part of a bulk slice

    def serve_inbox(self) -> None:
        if not self._inbox:
            return
        with self._serve_lock:
            self._serve_locked()

    def _serve_locked(self) -> None:
        # served by the other thread while this one waited; or the device is lost, and what
        # is left stays pending for a healthy worker
        if not self._inbox or self._device_fault is not None:
            return
        self._serving = True  # the nested forward pass fires the layer hooks too
        started = time.perf_counter()
        on_model_thread = self._serve_thread is self.model_thread
        try:
            self._serve([self._inbox.popleft() for _ in range(len(self._inbox))])
        finally:
            if on_model_thread:  # time the bulk batch in flight did not spend on itself
                self.serving_seconds += time.perf_counter() - started
            self._serving = False

    def _serve(self, items: list[PendingQuery], oom_retries: int = 0) -> None:
        """One forward pass for ``items``, then their answers."""
        if self._device_fault is not None:  # an earlier part of the batch lost the device
            return
        serving_at = time.time()
        try:
            rows = [row for item in items for row in item.rows]
            batch = self.encoder.collate(rows)
            # a multi-head model's heads (it has no frozen or CUDA query copy: the eager pass)
            batch.heads = self.outputs.heads_for([i.chunk for i in items])
            # said each time: a query served at a layer boundary of a bulk batch of long
            # inputs' windows (computed before Normalize) is normalised all the same, and
            # long inputs' windows here are averaged before it (workers/long_inputs.py)
            # (and a query that asks for its vector before Normalize, TEI's normalize=false)
            chunks = [item.chunk for item in items]
            model_normalizes = self.encoder.pooling.normalize
            raw = before_normalize_wanted(chunks, model_normalizes)
            with head_normalizes(len(rows) == len(items) and not raw):
                vectors, path = self.encoder.serve_query(batch)
            if len(rows) > len(items):  # long inputs' windows, pooled back into one each
                vectors = pool_windows(
                    vectors,
                    [len(item.rows) for item in items],
                    [row.length for row in rows],
                    normalize=False,
                )
            if len(rows) > len(items) or raw:
                vectors = normalized_except(vectors, chunks, model_normalizes)
        except Exception as error:
            self._on_model_error(items, error, oom_retries)
            return
        self.events.queries_served(count=len(items), path=path)
        self._answer(items, vectors, serving_at, time.time())

    def _on_model_error(
        self, items: list[PendingQuery], error: Exception, oom_retries: int
    ) -> None:
        """A failed query forward pass, by kind (workers/device_faults.py), on the serving
        thread. Out of memory: free the cache and serve the halves; one query is retried after
        a pause (time for another replica to free memory; on a CPU the model thread waits too,
        short of memory as it is), and one that still does not fit stops the worker. Any other
        CUDA error stops it at once. Stopped, the queries are neither answered nor
        acknowledged: a healthy worker reclaims them. Other errors are the queries' own: the
        batch is dead-lettered."""
        action = device_faults.recovery(error, len(items), oom_retries, isolate_model_errors=False)
        if action is Recovery.DEVICE_LOST:
            self._stop(DeviceFault(f"CUDA error in a query forward pass: {error}"), error)
            return
        if action is Recovery.DEAD_LETTER:
            self._on_loop(self._fail, items, f"model error: {type(error).__name__}: {error}")
            return
        device_faults.free_device_memory(self.encoder.device)  # what is left is out of memory
        if action is Recovery.SPLIT:
            log.warning("out of memory on a query batch, splitting it", queries=len(items))
            half = len(items) // 2
            self._serve(items[:half])
            self._serve(items[half:])
        elif action is Recovery.RETRY:
            log.warning("out of memory on one query, retrying", tries=oom_retries + 1)
            time.sleep(device_faults.oom_retry_pause_s(oom_retries))
            self._serve(items, oom_retries + 1)
        else:
            message = f"out of memory on one query after {oom_retries} retries: {error}"
            self._stop(DeviceFault(message), error)

    def _stop(self, fault: DeviceFault, error: Exception) -> None:
        """From the serving thread: serve nothing more, and have run() raise ``fault``."""
        fault.__cause__ = error
        self._device_fault = fault
        assert self._loop is not None and self._faulted is not None
        self._loop.call_soon_threadsafe(_set_once, self._faulted)

    def _answer(
        self,
        items: list[PendingQuery],
        vectors: np.ndarray,
        serving_at: float,
        computed_at: float,
    ) -> None:
        """Answers and acknowledgement in one MULTI, from the model thread.

        If Redis is unreachable the entries stay pending: the reclaimer hands them to a worker
        again once their lease runs out, while the caller may still be waiting.
        """
        results = self.outputs.results(
            [item.chunk for item in items],
            vectors,
            [item.tokens.truncated for item in items],
            with_meta=False,
        )
        if self._reply_client is None:
            self._reply_client = connect_sync(
                self.settings.effective_redis_url, cluster=self.settings.redis_cluster
            )
        pipe = self._reply_client.pipeline(transaction=True)
        # the reply contract's one writer (embedfleet/sinks/reply.py): an answer is pushed only for
        # an entry this call acknowledged, so a query redelivered meanwhile is answered once
        queue_replies(
            pipe,
            self.keys,
            [item.delivery for item in items],
            [item.reply for item in items],
            [encode_result(result) for result in results],
            "done",
            self.settings.reply_ttl_s,
        )
        try:
            pipe.execute()
        except Exception as error:
            if not is_transient(error):
                raise
            log.warning("query answers not written; left pending", error=str(error))
            return
        now = time.time()
        for item in items:  # metrics are thread-safe (prometheus_client)
            self.events.query_answered(latency_seconds=max(0.0, now - item.enqueued_at))
            self.events.query_stages(
                read=item.read_at - item.enqueued_at,
                tokenize=item.queued_at - item.read_at,
                wait=serving_at - item.queued_at,
                forward=computed_at - serving_at,
                reply=now - computed_at,
            )

    def _close(self) -> None:
        with self._serve_lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._reply_client is not None:
            self._reply_client.close()
            self._reply_client = None

    def _on_loop(self, function, *args) -> None:
        """Run an async handler on the event loop (rare paths: failures)."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._track, function(*args))

    def _track(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self._failures.add(task)
        task.add_done_callback(self._failures.discard)

    # --- failures (event loop) --------------------------------------------------------
    async def _fail(self, items: list[PendingQuery], reason: str) -> None:
        await self.dead_letters.send(
            [Rejected.chunk(i.delivery, i.chunk, DeadReason.MODEL, reason) for i in items]
        )


def _log_unexpected(future: Future[None]) -> None:
    """serve_inbox handles model and Redis errors itself; anything else must not vanish."""
    if not future.cancelled() and (error := future.exception()) is not None:
        log.error("query stage failed", error=repr(error))


def _set_once(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
