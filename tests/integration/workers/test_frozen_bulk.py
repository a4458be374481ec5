"""Bulk batches through the frozen copy (EMBEDFLEET_FROZEN_BULK) in reduced precision, with the
vectors sentence-transformers gives; eager when the setting is off or the model is float32."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import redis.asyncio as aioredis

from embedfleet.producer import Producer
from embedfleet.producer.chunker import builtin_corpus
from embedfleet.shared.settings import Settings
from embedfleet.workers.cpus import cpu_class
from embedfleet.workers.model.encoder import Encoder
from embedfleet.workers.model.precision import cosines
from tests.conftest import WorkerLauncher, reference_model

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bf16_encoder() -> Encoder:
    """bf16 weights, where the CPU runs them natively: elsewhere no frozen copy is built (its
    emulated kernels ran slower than eager; tests/integration/workers/model/test_frozen.py)."""
    if not cpu_class().fast_bf16:
        pytest.skip(f"no frozen bf16 copy on this CPU: {cpu_class().describe()}")
    encoder = Encoder(dtype="bfloat16")
    assert encoder.computes_in_reduced_precision
    assert encoder.prepare_query_graph(), "the bf16 copy must freeze and hold parity"
    return encoder


def _count_calls(encoder: Encoder, monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    calls: Counter[str] = Counter()
    for name in ("embed", "embed_query"):
        original: Callable = getattr(encoder, name)

        def counted(batch, _original=original, _name=name):  # type: ignore[no-untyped-def]
            calls[_name] += int(batch.input_ids.shape[0])  # texts, not calls: warm-up runs eager
            return _original(batch)

        monkeypatch.setattr(encoder, name, counted)
    return calls


async def _embed_corpus(
    workers: WorkerLauncher,
    settings: Settings,
    client: aioredis.Redis,
    encoder: Encoder,
    count: int,
) -> dict[str, np.ndarray]:
    chunks = list(builtin_corpus(count))
    async with Producer(settings, client) as producer, workers.run(settings, encoder=encoder):
        await producer.enqueue(chunks, job="bulk")
        progress = await producer.wait_for_job("bulk", timeout=300)
        results = {r.id: r.vector.astype(np.float32) async for r in producer.results(job="bulk")}
    assert progress.done == count and progress.dead == 0
    return results


async def test_bulk_runs_frozen_in_bf16_with_parity(
    workers: WorkerLauncher,
    settings: Settings,
    client: aioredis.Redis,
    bf16_encoder: Encoder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:

    calls = _count_calls(bf16_encoder, monkeypatch)
    results = await _embed_corpus(workers, settings, client, bf16_encoder, 60)
    assert calls["embed_query"] >= 60, calls  # every bulk text went through the frozen copy
    assert calls["embed"] <= 6, calls  # the warm-up: two eager passes of 2 and 4 probe texts
    texts = {chunk.id: chunk.text for chunk in builtin_corpus(60)}
    ids = sorted(results)
    reference = reference_model().encode([texts[i] for i in ids])
    parity = cosines(reference, np.stack([results[i] for i in ids]))
    print(f"frozen bulk bf16 vs sentence-transformers fp32: min {parity.min():.6f}")
    assert parity.min() >= 0.999 and parity.mean() >= 0.9999


@pytest.mark.parametrize(
    ("encoder_fixture", "frozen_bulk", "reduced_precision"),
    [("bf16_encoder", False, True), ("encoder", True, False)],
    ids=["bf16-with-the-setting-off", "float32"],
)
async def test_bulk_stays_eager(
    encoder_fixture: str,
    frozen_bulk: bool,
    reduced_precision: bool,
    request: pytest.FixtureRequest,
    workers: WorkerLauncher,
    settings: Settings,
    client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eager when EMBEDFLEET_FROZEN_BULK is off, and for a float32 model even when it is on:
    in both cases the frozen query graph exists, so staying eager is the worker's choice."""
    encoder: Encoder = request.getfixturevalue(encoder_fixture)
    assert encoder.prepare_query_graph()
    assert encoder.computes_in_reduced_precision == reduced_precision
    calls = _count_calls(encoder, monkeypatch)
    bulk = settings.model_copy(update={"frozen_bulk": frozen_bulk})
    await _embed_corpus(workers, bulk, client, encoder, 20)
    assert calls["embed"] >= 20 and calls["embed_query"] == 0, calls
