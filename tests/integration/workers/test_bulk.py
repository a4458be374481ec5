"""The bulk path's CUDA form, run on a CPU (workers/bulk.py).

A CPU launch is synchronous, so the worker there collects each batch as it launches it. The
asynchronous path (non-blocking copies, an event behind the copy back, batch i+1 launched
before batch i is collected) runs here with ``tests.conftest.FakeEvents`` standing in for CUDA
events: the same code, the order of launches and waits recorded.
"""

from __future__ import annotations

import numpy as np
import pytest
import redis.asyncio as aioredis
import torch

from embedfleet.producer import Producer
from embedfleet.producer.chunker import builtin_corpus
from embedfleet.shared.settings import Settings
from embedfleet.workers.bulk import BulkForward, LaunchAhead, Launched, resolve_layout
from embedfleet.workers.model.encoder import Encoder
from embedfleet.workers.model.packing import VarlenBatch, collate_varlen
from embedfleet.workers.model.precision import PROBE_TEXTS, cosines
from tests.conftest import FakeEvents, WorkerLauncher, reference_model

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = pytest.mark.slow

TEXTS = list(PROBE_TEXTS[:6])  # real sentences of mixed lengths


def test_collate_varlen_is_one_int32_buffer(encoder: Encoder) -> None:
    tokens = encoder.tokenize(TEXTS)
    batch = collate_varlen(tokens)
    lengths = [t.length for t in tokens]
    assert batch.buffer.dtype == torch.int32 and batch.buffer.shape == (7 + sum(lengths),)
    assert batch.cu_seqlens.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    assert batch.input_ids.tolist() == [i for t in tokens for i in t.ids]
    assert (batch.longest, batch.shortest) == (max(lengths), min(lengths))
    assert batch.real_tokens == batch.padded_tokens == sum(lengths)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works where CUDA is present")
def test_pinning_only_on_cuda(encoder: Encoder, varlen_encoder: Encoder) -> None:
    """This torch has no pinned allocator, so asking for pinned memory raises: collation that
    succeeds here did not ask. On CUDA the same calls pin (the device check's tests step)."""
    tokens = encoder.tokenize(TEXTS)
    with pytest.raises(RuntimeError, match="pin_memory"):
        collate_varlen(tokens, pin=True)
    with pytest.raises(RuntimeError, match="pin_memory"):
        encoder.collate(tokens, pin=True)
    for layout, model in (("padded", encoder), ("varlen", varlen_encoder)):
        bulk = BulkForward(model, layout, events=FakeEvents())
        assert not bulk.pin
        batch = bulk.collate(tokens)
        assert isinstance(batch, VarlenBatch) == (layout == "varlen")
        launched = bulk.launch(batch, half=True)
        assert isinstance(launched.host, torch.Tensor) and not launched.host.is_pinned()


def test_launch_ahead_keeps_one_batch_in_flight() -> None:
    ahead: LaunchAhead[str] = LaunchAhead(ahead=True)
    assert ahead.push("batch 1") is None  # launched; nothing to collect yet
    assert ahead.push("batch 2") == "batch 1"  # batch 2 queued before batch 1 is collected
    assert ahead.pop() == "batch 2" and ahead.pop() is None
    synchronous: LaunchAhead[str] = LaunchAhead(ahead=False)
    assert synchronous.push("batch 1") == "batch 1"  # a CPU launch is the computation


@pytest.mark.parametrize("layout", ["padded", "varlen"])
def test_asynchronous_launch_path(encoder: Encoder, varlen_encoder: Encoder, layout: str) -> None:
    """Batch i+1 is queued before batch i is waited on; the vectors are the padded path's,
    cast to float16 on the device when asked. Real CUDA events on a GPU (the device check's
    tests step), logged stand-ins on a CPU."""
    model = varlen_encoder if layout == "varlen" else encoder
    events = FakeEvents(model.device)
    bulk = BulkForward(model, layout, events=events)  # type: ignore[arg-type]
    assert bulk.asynchronous
    tokens = model.tokenize(TEXTS * 3)
    reference = encoder.embed(encoder.collate(tokens))
    vectors = np.zeros_like(reference)
    ahead: LaunchAhead[tuple[list[int], Launched]] = LaunchAhead(bulk.asynchronous)
    plans = bulk.plan([t.length for t in tokens], token_budget=120, max_batch=8)
    assert len(plans) >= 3
    for planned in plans:
        batch = bulk.collate([tokens[p] for p in planned.positions])
        done = ahead.push((planned.positions, bulk.launch(batch, half=True)))
        if done is not None:
            vectors[done[0]] = done[1].vectors()
            assert done[1].vectors().dtype == np.float16 and done[1].seconds >= 0
    last = ahead.pop()
    assert last is not None
    vectors[last[0]] = last[1].vectors()
    # two events a batch (start, after the copy back): batch i's copy event is waited on only
    # after batch i+1's events were recorded
    for batch_number in range(1, len(plans)):
        copied_i, started_next = 2 * batch_number, 2 * batch_number + 1
        assert events.log.index(f"wait {copied_i}") > events.log.index(f"record {started_next}")
    assert cosines(reference, vectors).min() >= 0.9999


def test_layout_setting(encoder: Encoder) -> None:
    expected = "varlen" if encoder.device.type == "cuda" else "padded"
    assert resolve_layout("auto", encoder) == expected
    assert resolve_layout("varlen", encoder) == "varlen"
    assert resolve_layout("padded", encoder) == "padded"


# --- the worker, end to end -----------------------------------------------------------------
async def test_worker_varlen_on_cpu_matches_sentence_transformers(
    workers: WorkerLauncher,
    settings: Settings,
    client: aioredis.Redis,
    varlen_encoder: Encoder,
    fake_cuda_events: FakeEvents,
) -> None:
    """EMBEDFLEET_LAYOUT=varlen through the whole worker, on the launch-ahead path: the vectors
    sentence-transformers gives in fp32 (min cosine >= 0.9999 on real texts)."""

    count = 48
    chunks = list(builtin_corpus(count))
    varlen = settings.model_copy(update={"layout": "varlen", "max_batch": 8})
    async with (
        Producer(varlen, client) as producer,
        workers.run(varlen, encoder=varlen_encoder) as worker,
    ):
        await producer.enqueue(chunks, job="varlen")
        progress = await producer.wait_for_job("varlen", timeout=300)
        results = {r.id: r.vector.astype(np.float32) async for r in producer.results(job="varlen")}
    assert progress.done == count and progress.dead == 0
    assert worker.slices.bulk is not None and worker.slices.bulk.layout == "varlen"
    assert worker.stats.padding_waste == 0.0 and worker.stats.batches >= count // 8
    waits = [entry for entry in fake_cuda_events.log if entry.startswith("wait")]
    assert len(waits) >= count // 8  # every batch came back through its copy event
    texts = {chunk.id: chunk.text for chunk in chunks}
    ids = sorted(results)
    reference = reference_model().encode([texts[i] for i in ids])
    parity = cosines(reference, np.stack([results[i] for i in ids]))
    print(f"worker varlen (CPU) vs sentence-transformers fp32: min {parity.min():.6f}")
    assert parity.min() >= 0.9999


def test_device_casts_to_float16_only_for_full_float16_outputs(encoder: Encoder) -> None:
    """The fp16 cast before the copy back is for batches whose every chunk stores the whole
    vector in float16; a truncated, float32 or quantized output is computed from float32."""
    from embedfleet.shared.protocol import Chunk
    from embedfleet.workers.output import Outputs

    outputs = Outputs(Settings(), encoder, calibrations=None)  # type: ignore[arg-type]
    plain = Chunk(id="a", text="x")
    assert outputs.full_float16([plain, Chunk(id="b", text="y", dtype="float16")])
    assert not outputs.full_float16([plain, Chunk(id="c", text="z", dimensions=64)])
    assert not outputs.full_float16([plain, Chunk(id="d", text="z", dtype="float32")])
    assert not outputs.full_float16([Chunk(id="e", text="z", dtype="int8")])
    assert not Outputs(Settings(output_dtype="float32"), encoder, None).full_float16([plain])  # type: ignore[arg-type]
