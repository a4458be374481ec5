"""int8 compute on a CPU (workers/int8.py, EMBEDFLEET_CPU_INT8): the W8A8 layer, SmoothQuant,
the copy's parity against float32, and a worker's bulk batches through it."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis
import torch

from embedfleet.producer import Producer
from embedfleet.producer.chunker import builtin_corpus
from embedfleet.shared.settings import Settings
from embedfleet.workers.encoder import Encoder
from embedfleet.workers.int8 import W8A8Linear, cpp_compiler_available, quantize_layers
from embedfleet.workers.precision import MEAN_COSINE, MIN_COSINE, cosines
from tests.conftest import WorkerLauncher


def _row_cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def test_w8a8_linear_matches_the_float_layer() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    inputs = torch.randn(3, 50, 64)
    with torch.no_grad():
        want, got = linear(inputs), W8A8Linear(linear)(inputs)
    assert got.shape == want.shape and got.dtype == inputs.dtype
    assert _row_cosines(got, want).min() > 0.999
    with torch.no_grad():  # bf16 in, bf16 out
        assert W8A8Linear(linear)(inputs.bfloat16()).dtype == torch.bfloat16


def test_smoothing_keeps_the_product_and_tames_an_outlier_channel() -> None:
    """Inputs with one channel 100x the others (and its weights 100x smaller, so it does not
    drown the output): per-token int8 keeps about one level for the other channels; moving the
    range into the weights (x / s @ (w * s)^T) brings the layer back to float's."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    with torch.no_grad():
        linear.weight[:, 5] /= 100
    inputs = torch.randn(200, 64)
    inputs[:, 5] *= 100
    smoothing = inputs.abs().amax(dim=0) ** 0.5 / linear.weight.abs().amax(dim=0) ** 0.5
    with torch.no_grad():
        want = linear(inputs)
        plain = _row_cosines(W8A8Linear(linear)(inputs), want)
        smoothed = _row_cosines(W8A8Linear(linear, smoothing)(inputs), want)
    assert plain.min() < 0.95  # what the outlier does without smoothing
    assert smoothed.min() > 0.999


def test_quantize_layers_leaves_the_kept_layers_in_float() -> None:
    layers = torch.nn.ModuleDict(
        {
            "attention": torch.nn.ModuleDict(
                {"output": torch.nn.ModuleDict({"dense": torch.nn.Linear(8, 8)})}
            ),
            "intermediate": torch.nn.ModuleDict({"dense": torch.nn.Linear(8, 16)}),
        }
    )
    ranges = {"intermediate.dense": torch.ones(8)}
    assert quantize_layers(layers, ranges, alpha=0.5, kept=("attention.output.dense",)) == 1
    assert type(layers.get_submodule("attention.output.dense")) is torch.nn.Linear
    swapped = layers.get_submodule("intermediate.dense")
    assert isinstance(swapped, W8A8Linear) and swapped.smoothing is not None


@pytest.fixture(scope="module")
def auto_encoder() -> Encoder:
    return Encoder(dtype="auto")


@pytest.fixture(scope="module")
def float32_encoder() -> Encoder:
    return Encoder(dtype="float32")


def _needs_bf16(encoder: Encoder) -> None:
    if not encoder.computes_in_reduced_precision:
        pytest.skip("auto kept float32 on this CPU (no native bf16), so no int8 either")


def test_no_int8_without_bf16() -> None:
    """float32 asked for: the float32 frozen graph, never the int8 copy."""
    encoder = Encoder(dtype="float32")
    assert encoder.prepare_query_graph(int8=True)
    assert not encoder.computes_in_int8
    assert encoder.serve_query(encoder.collate(encoder.tokenize(["a query"])))[1] == "frozen"


def test_no_compiler_no_int8_and_no_attempt(
    auto_encoder: Encoder, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without a C++ compiler (the CPU image) the copy is not even tried: inductor would fail
    after tracing the whole model, at every start."""
    _needs_bf16(auto_encoder)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert not cpp_compiler_available()
    started = time.perf_counter()
    assert auto_encoder._build_int8() is None
    assert time.perf_counter() - started < 5


def test_the_int8_copy_holds_the_float32_bar_on_a_corpus(
    auto_encoder: Encoder, float32_encoder: Encoder
) -> None:
    """Checked at start-up on the 20 probe texts only; here on 120 texts it never saw."""
    _needs_bf16(auto_encoder)
    forward = auto_encoder._build_int8()
    assert forward is not None, "the int8 copy must build, compile and pass its probe here"
    texts = [chunk.text for chunk in builtin_corpus(120)]
    batches = [texts[start : start + 24] for start in range(0, len(texts), 24)]
    int8 = np.concatenate(
        [
            auto_encoder._embed_frozen(forward, auto_encoder.collate(auto_encoder.tokenize(b)))
            for b in batches
        ]
    )
    reference = np.concatenate([float32_encoder.embed_texts(b) for b in batches])
    found = cosines(reference, int8)
    print(f"int8 copy vs float32: min {found.min():.5f}, mean {found.mean():.6f}")
    assert found.min() >= MIN_COSINE and found.mean() >= MEAN_COSINE
    assert found.mean() < 0.99999, "vectors identical to float32's: the int8 layers did not run"


async def test_a_worker_embeds_bulk_through_its_query_graph_with_int8_on(
    workers: WorkerLauncher,
    settings: Settings,
    client: aioredis.Redis,
    auto_encoder: Encoder,
    float32_encoder: Encoder,
) -> None:
    """EMBEDFLEET_CPU_INT8=true: the lane builds the int8 copy and keeps it or the bf16 copy
    (whichever ran a timed batch faster here); bulk batches go through the one kept, with the
    vectors it gives and within the float32 bar."""
    _needs_bf16(auto_encoder)
    count = 40
    chunks = list(builtin_corpus(count))
    on = settings.model_copy(update={"cpu_int8": True})
    async with Producer(on, client) as producer, workers.run(on, encoder=auto_encoder):
        await producer.enqueue(chunks, job="int8")
        progress = await producer.wait_for_job("int8", timeout=300)
        results = {r.id: r.vector.astype(np.float32) async for r in producer.results(job="int8")}
    assert progress.done == count and progress.dead == 0
    assert auto_encoder.has_query_graph
    vectors = np.stack([results[chunk.id] for chunk in chunks])
    texts = [chunk.text for chunk in chunks]
    served, path = auto_encoder.serve_query(auto_encoder.collate(auto_encoder.tokenize(texts)))
    assert path == ("int8" if auto_encoder.computes_in_int8 else "frozen")
    assert cosines(served, vectors).min() > 0.999  # fp16 results, other batch shapes
    found = cosines(float32_encoder.embed_texts(texts), vectors)
    assert found.min() >= MIN_COSINE and found.mean() >= MEAN_COSINE
