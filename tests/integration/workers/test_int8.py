"""int8 compute on a CPU (workers/model/int8.py, EMBEDFLEET_CPU_INT8): the W8A8 layer,
SmoothQuant, the held-out gate (workers/model/heldout.py) every copy must pass against float32,
the copies tried on each CPU class, and a worker's bulk batches through the copy kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis
import torch

from embedfleet.producer import Producer
from embedfleet.producer.chunker import builtin_corpus
from embedfleet.shared.settings import Settings
from embedfleet.workers.calibration import calibration_texts
from embedfleet.workers.cpus import cpu_class
from embedfleet.workers.model.choose import cpu_paths
from embedfleet.workers.model.encoder import Encoder
from embedfleet.workers.model.forward import layer_stack
from embedfleet.workers.model.heldout import GROUPS, HELDOUT_TEXTS
from embedfleet.workers.model.int8 import (
    Int8Forward,
    SmoothedDynamicLinear,
    W8A8Linear,
    build_int8,
    cpp_compiler_available,
    quantize_layers,
)
from embedfleet.workers.model.precision import (
    BULK_PROBE_TEXTS,
    GATE_TEXTS,
    MEAN_COSINE,
    MIN_COSINE,
    PROBE_TEXTS,
    cosines,
    embed_in_batches,
    holds_bar,
)
from tests.conftest import WorkerLauncher, assert_heldout_parity, reference_model

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = [pytest.mark.slow, pytest.mark.serial]  # serial: its assertions hold times (Makefile)


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


def test_the_smoothed_dynamic_int8_layer_keeps_the_product() -> None:
    """PyTorch's dynamic int8 Linear on x / s with weights w * s: the float layer's output, in
    the input's dtype."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    inputs = torch.randn(3, 50, 64)
    smoothing = inputs.abs().amax(dim=(0, 1)) ** 0.5 / linear.weight.abs().amax(dim=0) ** 0.5
    layer = SmoothedDynamicLinear(linear, smoothing)
    with torch.no_grad():
        want, got = linear(inputs), layer(inputs)
        assert layer(inputs.bfloat16()).dtype == torch.bfloat16
    assert got.shape == want.shape and _row_cosines(got, want).min() > 0.99


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


@pytest.mark.parametrize("dynamic", [False, True])
def test_one_builder_makes_either_int8_copy(dynamic: bool) -> None:
    """Issue 55: the W8A8 and the dynamic copy come from one builder, their difference a
    parameter: each copy's own layers, strength and dtype; the model itself untouched."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {
            "output": torch.nn.ModuleDict({"dense": torch.nn.Linear(8, 8)}),
            "intermediate": torch.nn.ModuleDict({"dense": torch.nn.Linear(8, 8)}),
        }
    ).bfloat16()

    def run(copy: torch.nn.Module, texts: Sequence[str]) -> object:
        inputs = torch.randn(len(texts), 8, dtype=next(copy.parameters()).dtype)
        return copy["output"]["dense"](copy["intermediate"]["dense"](inputs))

    copy = build_int8(model, lambda m: m, run, ["a", "b"], dynamic=dynamic, compiled=False)
    assert copy.name == ("int8-dynamic" if dynamic else "int8-w8a8")
    layers = copy._model
    assert isinstance(layers, torch.nn.ModuleDict)
    quantized = layers.get_submodule("intermediate.dense")
    assert isinstance(quantized, SmoothedDynamicLinear if dynamic else W8A8Linear)
    assert type(layers.get_submodule("output.dense")) is torch.nn.Linear  # kept in float
    assert layers.get_submodule("output.dense").weight.dtype == (
        torch.float32 if dynamic else torch.bfloat16
    )
    assert type(model.get_submodule("intermediate.dense")) is torch.nn.Linear


# --- the held-out set -------------------------------------------------------------------


def test_the_heldout_set_is_disjoint_from_every_calibration_text(encoder: Encoder) -> None:
    """The gate means something only on texts no path was tuned on: not the probe texts (the
    SmoothQuant ranges, bf16's probe), not the timing batch, not the output calibration corpus;
    and it has the inputs that failed: many scripts, passages at and over the limit, odd ones."""
    seen = set(PROBE_TEXTS) | set(BULK_PROBE_TEXTS) | set(calibration_texts())
    assert not seen & set(HELDOUT_TEXTS)
    assert GATE_TEXTS == HELDOUT_TEXTS and len(set(HELDOUT_TEXTS)) == len(HELDOUT_TEXTS)
    assert set(GROUPS) == {"multilingual", "long", "odd"}
    lengths = {text: encoder.tokenize([text])[0] for text in GROUPS["long"]}
    assert min(item.length for item in lengths.values()) >= 150  # corpus median: 47
    assert any(item.truncated for item in lengths.values())
    scripts = {_script(ch) for text in GROUPS["multilingual"] for ch in text if ch.isalpha()}
    assert len(scripts) >= 10, scripts


def _script(character: str) -> str:
    import unicodedata

    return unicodedata.name(character, "?").split()[0]


# --- the gate reads the held-out set ------------------------------------------------------


class OverfitCopy(Int8Forward):
    """A deliberately damaged copy: exact on the texts it was calibrated on (their token ids),
    noisy on every other input. What the old gate, which read only those texts, kept."""

    name = "int8-w8a8"

    def __init__(self, encoder: Encoder, calibrated: tuple[str, ...]) -> None:
        super().__init__(encoder._model)
        self._calibrated = {tuple(item.ids) for item in encoder.tokenize(list(calibrated))}

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = super().__call__(input_ids, attention_mask).clone()
        generator = torch.Generator().manual_seed(0)
        for row in range(hidden.shape[0]):
            ids = tuple(input_ids[row][attention_mask[row].bool()].tolist())
            if ids not in self._calibrated:
                noise = torch.randn(hidden[row].shape, generator=generator)
                hidden[row] += 0.6 * hidden[row].abs().mean() * noise
        return hidden


def test_the_gate_rejects_a_copy_that_passes_only_its_calibration_texts(
    float32_encoder: Encoder,
) -> None:
    encoder = float32_encoder
    damaged = OverfitCopy(encoder, PROBE_TEXTS)
    reference = encoder.embed_texts(list(PROBE_TEXTS))
    on_calibration = cosines(
        reference, encoder.paths.through(damaged).embed(_batch(encoder, PROBE_TEXTS))
    )
    assert holds_bar(float(on_calibration.min()), float(on_calibration.mean()))  # the old check

    heldout = embed_in_batches(encoder.embed_texts, GATE_TEXTS)
    report = encoder.paths.gate(damaged, heldout)
    assert not report.passed and report.texts == len(HELDOUT_TEXTS)
    assert set(report.groups) == {"multilingual", "long", "odd"}
    assert report.mean_cosine < MEAN_COSINE


def test_a_worker_never_keeps_a_copy_that_fails_the_heldout_gate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """prepare_query_graph builds the copy, gates it on the held-out set, and serves the frozen
    graph instead; a copy exact on the held-out set (the eager model itself) is kept."""
    encoder = Encoder(dtype="auto")
    monkeypatch.setattr(encoder.paths, "build_int8", lambda name: OverfitCopy(encoder, PROBE_TEXTS))
    assert encoder.prepare_query_graph("w8a8")
    assert not encoder.computes_in_int8 and encoder.forward_path.endswith("frozen")
    assert not encoder.gate_reports["int8-w8a8"].passed
    assert encoder.serve_query(_batch(encoder, ["a query"]))[1] == "frozen"

    exact = Encoder(dtype="auto")
    monkeypatch.setattr(exact.paths, "build_int8", lambda name: OverfitCopy(exact, GATE_TEXTS))
    assert exact.prepare_query_graph("w8a8")
    assert exact.computes_in_int8 and exact.forward_path.startswith("int8-w8a8")
    assert exact.computes_in_reduced_precision  # so the worker runs bulk through it too


def test_a_real_w8a8_copy_passes_its_probe_texts_and_fails_heldout(
    float32_encoder: Encoder,
) -> None:
    """The issue's case with a real copy: the W8A8 scheme with only the attention output kept
    in float holds the bar on the 20 texts it was calibrated on and not on the held-out set;
    the scheme kept now (both output projections in float) holds it there. Eager (the compiled
    copy computes the same, fused), on a float32 model: the scheme's own error. Where W8A8 is
    not a path (no VNNI/AMX) its eager int8 matmul alone took 128 s of CI: checked elsewhere."""
    if "int8-w8a8" not in cpu_paths(cpu_class(), compiler=True):
        pytest.skip(f"the W8A8 copy is not a path on this CPU: {cpu_class().describe()}")
    encoder = float32_encoder
    reference = embed_in_batches(encoder.embed_texts, GATE_TEXTS)
    old = build_int8(
        encoder._model,
        layer_stack,
        encoder.paths.run_copy,
        PROBE_TEXTS,
        kept=("attention.output.dense",),
        compiled=False,
    )
    on_probe = cosines(
        encoder.embed_texts(list(PROBE_TEXTS)),
        encoder.paths.through(old).embed(_batch(encoder, PROBE_TEXTS)),
    )
    print(f"old scheme on its probe texts: min {on_probe.min():.5f} mean {on_probe.mean():.6f}")
    assert holds_bar(float(on_probe.min()), float(on_probe.mean()))
    assert not encoder.paths.gate(old, reference).passed

    new = build_int8(
        encoder._model, layer_stack, encoder.paths.run_copy, PROBE_TEXTS, compiled=False
    )
    assert encoder.paths.gate(new, reference).passed


def _batch(encoder: Encoder, texts: tuple[str, ...] | list[str]):  # type: ignore[no-untyped-def]
    return encoder.collate(encoder.tokenize(list(texts)))


# --- which copies a CPU tries -------------------------------------------------------------


_EMULATED_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def _in_subprocess(code: str, env: dict[str, str]) -> dict:  # type: ignore[type-arg]
    """Run ``code`` (which prints one JSON line last) in a fresh interpreter with ``env``
    added: torch reads ATEN_CPU_CAPABILITY and oneDNN its ISA cap once, at start."""
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **env},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_avx2_only_cpu_tries_int8_where_auto_keeps_float32() -> None:
    """Emulated AVX2-only CPU (this machine's AVX-512, BF16 and VNNI hidden from torch and
    oneDNN): `auto` keeps float32, and the worker still builds and gates an int8 copy (on the
    old code it tried none: int8 only followed bf16)."""
    found = _in_subprocess(
        "import json\n"
        "from embedfleet.workers.cpus import cpu_class\n"
        "from embedfleet.workers.model.choose import cpu_paths\n"
        "from embedfleet.workers.model.encoder import Encoder\n"
        "cpu = cpu_class()\n"
        "encoder = Encoder(dtype='auto')\n"
        "encoder.prepare_query_graph('dynamic')\n"
        "print(json.dumps({'capability': cpu.capability, 'fast_bf16': cpu.fast_bf16,\n"
        "    'paths': cpu_paths(cpu, compiler=True), 'no_compiler': cpu_paths(cpu, False),\n"
        "    'precision': encoder.precision.name, 'gated': sorted(encoder.gate_reports),\n"
        "    'path': encoder.forward_path}))\n",
        _EMULATED_AVX2,
    )
    print(found)
    assert found["capability"] == "AVX2" and not found["fast_bf16"]
    assert found["precision"] == "float32"
    assert "bfloat16" not in found["paths"]
    assert found["paths"] == ["float32", "int8-dynamic"]  # W8A8: no int8 dot products
    assert "int8-dynamic" in found["no_compiler"]  # FBGEMM/oneDNN kernels, no compile
    assert found["gated"] == ["int8-dynamic"]  # built and held to the bar (kept or not)


def test_explicit_dtypes_and_the_setting_off_try_no_int8(float32_encoder: Encoder) -> None:
    """float32 (or bf16) asked for is what runs: no copy is gated against it; CPU_INT8=false."""
    encoder = Encoder(dtype="float32")
    assert encoder.prepare_query_graph(int8=True)
    assert not encoder.computes_in_int8 and not encoder.gate_reports
    assert encoder.serve_query(_batch(encoder, ["a query"]))[1] == "frozen"
    off = Encoder(dtype="auto")
    assert off.prepare_query_graph("off") and not off.gate_reports


def test_no_compiler_no_w8a8_and_no_attempt(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without a C++ compiler (the CPU image) the W8A8 copy is not even tried: inductor would
    fail after tracing the whole model, at every start."""
    encoder = Encoder(dtype="auto")
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert not cpp_compiler_available()
    started = time.perf_counter()
    assert encoder.paths.int8_candidates("w8a8") == []
    assert time.perf_counter() - started < 10  # the float32 reference at most, no compile


# --- the copy kept, against float32 sentence-transformers ---------------------------------


@pytest.fixture(scope="module")
def float32_encoder() -> Encoder:
    return Encoder(dtype="float32")


@pytest.fixture(scope="module")
def int8_encoder(request: pytest.FixtureRequest) -> Encoder:
    """A default CPU worker's encoder with the W8A8 copy forced (EMBEDFLEET_CPU_INT8_PATH=w8a8:
    kept when it passes the held-out gate, without the timing race): the session's
    ``forced_int8_encoder`` (tests/conftest.py), compiled once for this module and
    tests/integration/workers/test_slices.py."""
    if not cpp_compiler_available():
        pytest.skip("no C++ compiler: torch.compile cannot build the W8A8 copy here")
    if "int8-w8a8" not in cpu_paths(cpu_class(), compiler=True):
        # a path `auto` never takes here (no VNNI/AMX: its int8 matmul is tens of times slower
        # than float32), so its parity is checked on the CPUs that can choose it
        pytest.skip(f"the W8A8 copy is not a path on this CPU: {cpu_class().describe()}")
    encoder: Encoder = request.getfixturevalue("forced_int8_encoder")
    assert "int8-w8a8" in encoder.gate_reports, "the shared encoder must have built the W8A8 copy"
    return encoder


def _served(encoder: Encoder, texts: list[str] | tuple[str, ...]) -> np.ndarray:
    batches = [list(texts[start : start + 16]) for start in range(0, len(texts), 16)]
    return np.concatenate([encoder.serve_query(_batch(encoder, b))[0] for b in batches])


def test_the_kept_int8_copy_holds_the_bar_against_sentence_transformers_heldout(
    int8_encoder: Encoder,
) -> None:
    """The W8A8 copy passes its gate here, and its vectors of the held-out set, served as a
    worker serves them, hold the bar against float32 sentence-transformers in every group."""
    report = int8_encoder.gate_reports["int8-w8a8"]
    assert report.passed, report
    assert int8_encoder.computes_in_int8
    assert int8_encoder.serve_query(_batch(int8_encoder, ["a query"]))[1] == "int8"
    found = cosines(
        reference_model().encode(list(HELDOUT_TEXTS)), _served(int8_encoder, HELDOUT_TEXTS)
    )
    assert_heldout_parity(found, "int8")
    assert found.mean() < 0.99999, "vectors identical to float32's: the int8 layers did not run"


def test_the_int8_copy_holds_the_float32_bar_on_a_corpus(
    int8_encoder: Encoder, float32_encoder: Encoder
) -> None:
    """And on 120 corpus texts it never saw either."""
    texts = [chunk.text for chunk in builtin_corpus(120)]
    found = cosines(
        embed_in_batches(float32_encoder.embed_texts, texts), _served(int8_encoder, texts)
    )
    print(f"int8 copy vs float32: min {found.min():.5f}, mean {found.mean():.6f}")
    assert found.min() >= MIN_COSINE and found.mean() >= MEAN_COSINE


async def test_a_worker_embeds_bulk_through_its_query_graph_with_int8_on(
    workers: WorkerLauncher,
    settings: Settings,
    client: aioredis.Redis,
    int8_encoder: Encoder,
    float32_encoder: Encoder,
) -> None:
    """EMBEDFLEET_CPU_INT8=true: bulk batches go through the copy the lane kept (here the
    W8A8 copy), with the vectors it gives and within the float32 bar."""
    count = 40
    chunks = list(builtin_corpus(count))
    on = settings.model_copy(update={"cpu_int8": True, "cpu_int8_path": "w8a8"})
    async with Producer(on, client) as producer, workers.run(on, encoder=int8_encoder):
        await producer.enqueue(chunks, job="int8")
        progress = await producer.wait_for_job("int8", timeout=300)
        results = {r.id: r.vector.astype(np.float32) async for r in producer.results(job="int8")}
    assert progress.done == count and progress.dead == 0
    assert int8_encoder.computes_in_int8
    vectors = np.stack([results[chunk.id] for chunk in chunks])
    texts = [chunk.text for chunk in chunks]
    served, path = int8_encoder.serve_query(_batch(int8_encoder, texts))
    assert path == "int8"
    assert cosines(served, vectors).min() > 0.999  # fp16 results, other batch shapes
    found = cosines(float32_encoder.embed_texts(texts), vectors)
    assert found.min() >= MIN_COSINE and found.mean() >= MEAN_COSINE
