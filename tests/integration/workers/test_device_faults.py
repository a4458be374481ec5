"""Failures on a GPU, run on CPU: out of memory never dead-letters a valid text, and a CUDA error
that poisons the context stops the worker with its entries left pending for a healthy one.

The real worker, Redis server and model; the forward pass is wrapped to raise the errors torch
raises on a GPU (the exception types and messages are torch's own), since a CPU cannot be made
to run out of device memory or trip a device-side assert on demand.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import redis.asyncio as aioredis
import torch

from embedfleet.producer import Producer
from embedfleet.shared.protocol import PAYLOAD_FIELD, Chunk, decode_result, encode_chunk
from embedfleet.shared.settings import Settings
from embedfleet.workers.device_faults import DeviceFault, is_device_fault, is_out_of_memory
from embedfleet.workers.model.encoder import EncodeBatch, Encoder
from tests.conftest import FakeEvents, WorkerLauncher

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = pytest.mark.slow

TEXTS = [f"document number {n} about the device faults a worker survives" for n in range(24)]
OOM_MESSAGE = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 139.8 GiB total capacity)"
ASSERT_MESSAGE = "CUDA error: device-side assert triggered\nCompile with TORCH_USE_CUDA_DSA"


@pytest.mark.parametrize(
    ("error", "oom", "device"),
    [
        (torch.OutOfMemoryError(OOM_MESSAGE), True, False),
        (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"), True, False),
        (RuntimeError(ASSERT_MESSAGE), False, True),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), False, True),
        (RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx"), False, True),
        (RuntimeError("The size of tensor a (600) must match the size of tensor b (512)"), 0, 0),
        (ValueError("text is not a string"), False, False),
    ],
)
def test_classification(error: Exception, oom: bool, device: bool) -> None:
    assert is_out_of_memory(error) == bool(oom)
    assert is_device_fault(error) == bool(device)


def documents(job: str) -> list[dict[str, str]]:
    return [{"id": f"{job}-{i}", "text": text} for i, text in enumerate(TEXTS)]


async def _run_job(settings: Settings, job: str) -> tuple[int, int]:
    async with Producer(settings) as producer:
        await producer.enqueue(documents(job), job=job)
        progress = await producer.wait_for_job(job, interval=0.05, timeout=120)
    return progress.done, progress.dead


async def test_out_of_memory_splits_and_retries_never_dead_letters(
    workers: WorkerLauncher, settings: Settings, encoder: Encoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches over 4 texts do not fit; one single text fails once more before it fits."""
    real_embed = encoder.embed
    calls = {"single": 0}

    def short_of_memory(batch: EncodeBatch):
        if batch.size > 4:
            raise torch.OutOfMemoryError(OOM_MESSAGE)
        if batch.size == 1 and calls["single"] == 0:
            calls["single"] += 1
            raise torch.OutOfMemoryError(OOM_MESSAGE)
        return real_embed(batch)

    monkeypatch.setattr(encoder, "embed", short_of_memory)
    settings = settings.model_copy(update={"max_batch": 8})  # batches of 8, halves of 4 fit
    async with workers.run(settings, encoder=encoder) as worker:
        done, dead = await _run_job(settings, "oom")
    assert (done, dead) == (len(TEXTS), 0)
    assert worker.stats.dead_letters == 0


async def test_cuda_error_stops_the_worker_and_leaves_entries_pending(
    settings: Settings,
    encoder: Encoder,
    client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_embed = encoder.embed
    forward_passes = []

    def poisoned(batch: EncodeBatch):
        forward_passes.append(batch.size)
        if len(forward_passes) <= 2:  # the worker's warm-up (Encoder.warm_up) goes through
            return real_embed(batch)
        raise RuntimeError(ASSERT_MESSAGE)

    monkeypatch.setattr(encoder, "embed", poisoned)
    await _stops_with_entries_pending(settings, encoder, client, "c")


async def _stops_with_entries_pending(
    settings: Settings, encoder: Encoder, client: aioredis.Redis, job: str
) -> None:
    """A worker given TEXTS stops with a DeviceFault for the device-side assert, nothing
    dead-lettered, every entry read and left pending."""
    from embedfleet.sinks import RedisStreamSink
    from embedfleet.workers.worker import Worker

    worker = Worker(settings, encoder, client, RedisStreamSink(client, settings.keys))
    task = asyncio.create_task(worker.run())
    async with Producer(settings) as producer:
        await producer.enqueue(documents(job), job=job)
        with pytest.raises(DeviceFault, match="device-side assert"):
            await asyncio.wait_for(task, timeout=60)
        progress = await producer.progress(job)
    assert progress.dead == 0 and worker.stats.dead_letters == 0
    pending = await client.xpending(settings.keys.ingest, settings.group)
    assert pending["pending"] == len(TEXTS)  # read, never acknowledged: another worker's now


async def test_out_of_memory_on_the_varlen_launch_path_never_dead_letters(
    workers: WorkerLauncher,
    settings: Settings,
    varlen_encoder: Encoder,
    fake_cuda_events: FakeEvents,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CUDA path (varlen, launched one ahead): an OOM at launch, while the batch before is
    still in flight, halves the batch as on the padded path; every text is embedded."""
    from embedfleet.workers.model.packing import PackedEncoder, VarlenBatch

    real_vectors = PackedEncoder.vectors
    sizes: list[int] = []

    def short_of_memory(self: PackedEncoder, batch: VarlenBatch) -> torch.Tensor:
        sizes.append(batch.size)
        if batch.size > 4:
            raise torch.OutOfMemoryError(OOM_MESSAGE)
        return real_vectors(self, batch)

    monkeypatch.setattr(PackedEncoder, "vectors", short_of_memory)
    settings = settings.model_copy(update={"max_batch": 8, "layout": "varlen"})
    async with workers.run(settings, encoder=varlen_encoder) as worker:
        done, dead = await _run_job(settings, "oom-varlen")
    assert (done, dead) == (len(TEXTS), 0)
    assert worker.stats.dead_letters == 0 and 8 in sizes  # the full batches were tried


async def test_cuda_error_at_the_copy_back_stops_the_worker(
    settings: Settings,
    varlen_encoder: Encoder,
    client: aioredis.Redis,
    fake_cuda_events: FakeEvents,
) -> None:
    """On the CUDA path a device-side assert surfaces when the host waits on the batch's
    event, not at launch: the worker stops the same way, nothing dead-lettered."""
    # the warm-up's varlen batch is waited on once; every later wait fails
    fake_cuda_events.failure = (2, RuntimeError(ASSERT_MESSAGE))
    settings = settings.model_copy(update={"layout": "varlen"})
    await _stops_with_entries_pending(settings, varlen_encoder, client, "e")
    assert fake_cuda_events.waits >= 2


QUERIES = [f"question {n}: what does a worker do when the device fails?" for n in range(8)]


async def _enqueue_queries(client: aioredis.Redis, settings: Settings, request: str) -> None:
    """QUERIES on the query stream before any worker runs: its first read takes them all,
    so they are served as one batch."""
    for index, text in enumerate(QUERIES):
        chunk = Chunk(id=f"{request}:{index}", text=text, reply=request)
        await client.xadd(
            settings.keys.priority_streams.query, {PAYLOAD_FIELD: encode_chunk(chunk)}
        )


@pytest.fixture(params=[False, True], ids=["model-thread", "own-thread"])
def query_settings(
    request: pytest.FixtureRequest,
    settings: Settings,
    encoder: Encoder,
    monkeypatch: pytest.MonkeyPatch,
) -> Settings:
    """A query-only worker, its queries served on the model thread (a CPU's lane, at layer
    boundaries) or on the CUDA query thread (the CUDA query path's wiring, a CPU standing in)."""
    if request.param:  # the encoder says its CUDA query path is ready: queries get their own thread
        monkeypatch.setattr(encoder, "prepare_cuda_queries", lambda mode: True)
    return settings.model_copy(update={"query_only": True})


async def test_out_of_memory_on_a_query_batch_splits_and_never_dead_letters(
    workers: WorkerLauncher,
    query_settings: Settings,
    encoder: Encoder,
    client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only single queries fit, and the first single one fails once more: the batch is halved
    down to single queries, that one is retried, and every query is answered."""
    serve_query = encoder.serve_query
    sizes: list[int] = []

    def short_of_memory(batch: EncodeBatch):
        sizes.append(batch.size)
        if batch.size > 1 or sizes.count(1) == 1:
            raise torch.OutOfMemoryError(OOM_MESSAGE)
        return serve_query(batch)

    monkeypatch.setattr(encoder, "serve_query", short_of_memory)
    settings = query_settings
    await _enqueue_queries(client, settings, "oom")
    async with workers.run(settings, encoder=encoder) as worker:
        reply = settings.keys.priority_streams.reply("oom")
        answers = [await client.blpop([reply], timeout=60) for _ in QUERIES]
    results = sorted(
        (decode_result(answer[1]) for answer in answers if answer is not None),
        key=lambda result: int(result.id.split(":")[1]),
    )
    assert [r.id for r in results] == [f"oom:{i}" for i in range(len(QUERIES))]
    expected = encoder.embed_texts(QUERIES)
    for result, vector in zip(results, expected, strict=True):
        assert float(result.vector.astype(np.float32) @ vector) > 0.999
    assert sizes[:4] == [8, 4, 2, 1] and sizes.count(1) == len(QUERIES) + 1  # one retry
    assert worker.stats.dead_letters == 0


async def test_cuda_error_on_a_query_stops_the_worker_and_leaves_it_pending(
    query_settings: Settings,
    encoder: Encoder,
    client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from embedfleet.sinks import RedisStreamSink
    from embedfleet.workers.worker import Worker

    def poisoned(batch: EncodeBatch):
        raise RuntimeError(ASSERT_MESSAGE)

    monkeypatch.setattr(encoder, "serve_query", poisoned)
    settings = query_settings
    await _enqueue_queries(client, settings, "assert")
    worker = Worker(settings, encoder, client, RedisStreamSink(client, settings.keys))
    with pytest.raises(DeviceFault, match="device-side assert"):
        await asyncio.wait_for(worker.run(), timeout=60)
    assert worker.stats.dead_letters == 0
    assert not await client.exists(settings.keys.priority_streams.reply("assert"))  # no answer
    pending = await client.xpending(settings.keys.priority_streams.query, settings.group)
    assert pending["pending"] == len(QUERIES)  # read, never acknowledged: another worker's now


def test_tf32_for_float32_work_on_cuda_only() -> None:
    from embedfleet.workers.model.encoder import configure_device_math

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        configure_device_math(torch.device("cpu"))
        assert not torch.backends.cuda.matmul.allow_tf32
        configure_device_math(torch.device("cuda"))  # sets flags only: no device needed
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_malloc_trim_runs_on_a_timer_not_per_window() -> None:
    from embedfleet.workers.memory import TrimTimer

    timer = TrimTimer(interval=5.0)
    # windows every 10 ms (a GPU) for 12 s: trims at 0, 5 and 10 s, not 1,200 times
    trims = [t for t in range(1200) if timer.due(now=1000 + t * 0.01)]
    assert [round(t * 0.01, 2) for t in trims] == [0.0, 5.0, 10.0]
    slow = TrimTimer(interval=5.0)
    assert all(slow.due(now=2000 + t * 6.0) for t in range(5))  # CPU windows: every one
