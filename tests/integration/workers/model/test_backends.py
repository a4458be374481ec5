"""ONNX Runtime and OpenVINO as a CPU worker's forward path (EMBEDFLEET_CPU_BACKEND,
workers/model/backends.py): each engine's copy against float32 sentence-transformers on the
held-out set, the copy a named engine or `auto` keeps, and a worker started with the setting
serving its vectors through Redis."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis
import torch

from embedfleet.producer import Producer
from embedfleet.producer.chunker import builtin_corpus
from embedfleet.shared.settings import Settings
from embedfleet.workers.model import choose
from embedfleet.workers.model.backends import ENGINES, BackendForward, BuildCost, installed
from embedfleet.workers.model.encoder import Encoder
from embedfleet.workers.model.heldout import HELDOUT_TEXTS
from embedfleet.workers.model.precision import MEAN_COSINE, MIN_COSINE, cosines, embed_in_batches
from tests.conftest import WorkerLauncher, assert_heldout_parity, reference_model

# the slow tier: each engine exports and compiles a copy of the model (seconds to a minute)
pytestmark = pytest.mark.slow

ENGINE_PARAMS = [
    pytest.param(
        engine,
        marks=pytest.mark.skipif(
            not installed(engine), reason=f"the {engine!r} extra is not installed"
        ),
    )
    for engine in ENGINES
]


def _batch(encoder: Encoder, texts: list[str]):  # type: ignore[no-untyped-def]
    return encoder.collate(encoder.tokenize(texts))


@pytest.fixture(scope="module")
def built(encoder: Encoder) -> Callable[[str], BackendForward]:
    """``built(engine)``: the engine's copy of the session encoder's model, built once for the
    module (an export takes seconds to tens of seconds on 2 cores); its cost in the encoder's
    ``backend_costs``."""
    copies: dict[str, BackendForward] = {}

    def build(engine: str) -> BackendForward:
        if engine not in copies:
            copy = encoder.paths.build_backend(engine, "default")
            assert copy is not None, "the copy could not be built: see the warning logged"
            copies[engine] = copy
        return copies[engine]

    return build


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_each_engine_holds_the_bar_against_sentence_transformers(
    encoder: Encoder, built: Callable[[str], BackendForward], engine: str
) -> None:
    """The engine's copy, through the sentence pipeline, in padded batches of mixed lengths and
    alone: within the bar of every path against float32 sentence-transformers, in every group
    of the held-out set; what it cost to build is kept on it."""
    copy = built(engine)
    path = encoder.paths.through(copy)
    assert path.kind == engine and path.name.startswith(engine)
    found = cosines(
        reference_model().encode(list(HELDOUT_TEXTS)),
        embed_in_batches(lambda texts: path.embed(_batch(encoder, list(texts))), HELDOUT_TEXTS),
    )
    assert_heldout_parity(found, path.name)
    alone, label = path.serve(_batch(encoder, ["hello"]))  # batch and sequence both dynamic
    assert label == engine and alone.shape == (1, encoder.dim)
    want = reference_model().encode(["hello"])
    assert cosines(want, alone).min() >= MIN_COSINE
    cost = encoder.paths.backend_costs[engine]
    assert cost is copy.cost and cost.export_s > 0 and cost.compile_s > 0
    print(f"{engine}: {cost}")


@pytest.mark.skipif(not installed("openvino"), reason="the 'openvino' extra is not installed")
def test_the_openvino_copy_is_cut_at_its_layers_where_queries_get_in(
    encoder: Encoder, built: Callable[[str], BackendForward]
) -> None:
    """MiniLM's OpenVINO copy is cut at its 6 layers: the callback the query stage sets runs
    before each of them, a query served there (re-entrantly, through the same copy) gets its
    own vector, and the bulk batch it interrupted comes out as it does uninterrupted."""
    copy = built("openvino")
    assert getattr(copy, "layer_boundaries", 0) == encoder.layer_count == 6
    path = encoder.paths.through(copy)
    bulk = _batch(encoder, list(HELDOUT_TEXTS[:8]))
    query = _batch(encoder, ["how do I read a file line by line"])
    alone_bulk, alone_query = path.embed(bulk), path.embed(query)
    served: list[np.ndarray] = []
    serving: list[bool] = []  # the nested pass fires the callback too (the lane's guard)

    def at_boundary() -> None:
        if not serving and len(served) < 3:
            serving.append(True)
            served.append(path.embed(query))
            serving.clear()

    assert path.set_layer_callback(at_boundary) == 6
    try:
        interrupted = path.embed(bulk)
    finally:
        path.set_layer_callback(None)
    assert len(served) == 3
    for vector in served:
        assert cosines(alone_query, vector).min() >= 0.9999
    assert cosines(alone_bulk, interrupted).min() >= 0.9999
    fired: list[int] = []
    path.set_layer_callback(lambda: fired.append(1))
    path.set_layer_callback(None)  # removed: a batch runs through without it
    path.embed(bulk)
    assert fired == []


def test_a_model_the_cut_does_not_reproduce_is_converted_whole() -> None:
    """A model whose layers, run in turn from its embeddings, do not give its hidden states
    (here: a final norm after the stack) is not cut: None, and the whole model is converted."""
    from embedfleet.workers.model.forward import layer_stack
    from embedfleet.workers.model.openvino import cut_at_layers

    class Output:
        def __init__(self, hidden: torch.Tensor) -> None:
            self.last_hidden_state = hidden

    class WithFinalNorm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embeddings = torch.nn.Embedding(50, 8)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
            self.norm = torch.nn.LayerNorm(8)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Output:
            hidden = self.embeddings(input_ids)
            for layer in self.layers:
                hidden = layer(hidden)
            return Output(self.norm(hidden))

    class Stage(torch.nn.Module):  # the layer signature BERT's has: (hidden, attention_mask=)
        def __init__(self, linear: torch.nn.Module) -> None:
            super().__init__()
            self.linear = linear

        def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.linear(hidden)

    model = WithFinalNorm().eval()
    model.embeddings.forward = lambda input_ids: torch.nn.Embedding.forward(  # type: ignore[method-assign]
        model.embeddings, input_ids
    )
    example = (torch.randint(1, 50, (2, 5)), torch.ones(2, 5, dtype=torch.long))
    stages = torch.nn.ModuleList(Stage(layer) for layer in model.layers)
    assert cut_at_layers(model, stages, example) is None
    model.norm = torch.nn.Identity()  # without it the cut reproduces the model: it is cut
    cut = cut_at_layers(model, stages, example)
    assert cut is not None and len(cut[1]) == 2
    assert len(layer_stack(model)) == 2


# an OpenVINO copy of a small random BERT, built as a worker builds it, in a process of its own
BUILD_A_COPY = """
import torch, transformers
from embedfleet.workers.model.forward import layer_stack
from embedfleet.workers.model.openvino import build_openvino
config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=64)
model = transformers.BertModel(config).eval()
example = (torch.randint(1, 100, (2, 7)), torch.ones(2, 7, dtype=torch.long))
copy = build_openvino(model, example, threads=1, layers=layer_stack)
print(tuple(copy(*example).shape))
"""


def _build_a_copy(home: Path, before: str = "", after: str = "") -> str:
    """BUILD_A_COPY in a process with ``home`` as HOME (``before`` and ``after`` it: more
    code); what it printed."""
    done = subprocess.run(
        [sys.executable, "-c", before + BUILD_A_COPY + after],
        env={**os.environ, "HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "(2, 7, 32)" in done.stdout, done.stdout
    return done.stdout


@pytest.mark.skipif(not installed("openvino"), reason="the 'openvino' extra is not installed")
def test_an_openvino_copy_is_built_without_telemetry(tmp_path: Path) -> None:
    """OpenVINO's conversion reports its use to Google Analytics unless the machine opted out,
    forking the worker to send each event; the worker's conversion sends nothing: the telemetry
    package keeps its client id and consent under ~/intel, and that is not even made."""
    home = tmp_path / "home"
    home.mkdir()
    _build_a_copy(home)
    assert not (home / "intel").exists(), sorted(str(p) for p in home.rglob("*"))


@pytest.mark.skipif(not installed("openvino"), reason="the 'openvino' extra is not installed")
def test_telemetry_imported_before_the_build_is_replaced_by_openvinos_stub(tmp_path: Path) -> None:
    """Another library imported OpenVINO's converter first (its import alone writes ~/intel):
    every converter module that holds the telemetry package holds OpenVINO's no-op stub once the
    worker has built its copy, so no conversion event is sent."""
    from embedfleet.workers.model.telemetry import TELEMETRY_USERS

    before = "import openvino.tools.ovc.convert_impl, openvino.tools.ovc.telemetry_utils\n"
    after = (
        "import sys\n"
        f"for name in {TELEMETRY_USERS!r}:\n"
        "    if name in sys.modules: print(name, sys.modules[name].tm.__name__)\n"
    )
    printed = _build_a_copy(tmp_path, before, after).splitlines()
    bound = dict(line.split() for line in printed if line.startswith("openvino."))
    assert {"openvino.tools.ovc.convert_impl", "openvino.tools.ovc.telemetry_utils"} <= set(bound)
    assert set(bound.values()) == {"openvino.tools.ovc.telemetry_stub"}, bound


class NoiseCopy:
    """A copy that builds and runs but is wrong: what the gate is there to refuse."""

    name = "openvino"
    precision = "bf16"
    cost = BuildCost(0.0, 0.0, 0.0)

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        return torch.randn((*input_ids.shape, self.dim), generator=generator)


@pytest.mark.skipif(not installed("openvino"), reason="the 'openvino' extra is not installed")
def test_an_engine_copy_that_fails_the_gate_leaves_torchs_path(
    encoder: Encoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU_BACKEND=openvino whose copy fails the held-out gate: torch's frozen graph serves."""
    monkeypatch.setattr(encoder.paths, "gate_reports", {})  # the session encoder's, restored
    monkeypatch.setattr(
        encoder.paths, "build_backend", lambda engine, precision: NoiseCopy(encoder.dim)
    )
    kept = encoder.paths.choose("off", "openvino")
    assert kept is not None and kept.kind == "frozen", kept
    assert not encoder.paths.gate_reports["openvino"].passed


def test_auto_builds_gates_and_races_every_installed_engine(
    built: Callable[[str], BackendForward], monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU_BACKEND=auto: each installed engine's copy is gated on the held-out set, and the path
    kept is one of the contenders timed (torch's frozen graph or an engine that passed). The
    copies are the module's (the same model's, built once): what is under test is the choice."""
    engines = [engine for engine in ENGINES if installed(engine)]
    if not engines:
        pytest.skip("neither the onnxruntime nor the openvino extra is installed")
    auto = Encoder(dtype="auto")
    asked: list[str] = []

    def build_backend(engine: str, precision: str) -> BackendForward:
        asked.append(engine)
        return built(engine)

    monkeypatch.setattr(auto.paths, "build_backend", build_backend)
    # the race on a quarter of its bulk-shaped batch: every contender is still timed (which
    # one wins is not asserted); the whole batch took 15 s on one thread of an AVX2 core
    monkeypatch.setattr(choose, "BULK_PROBE_TEXTS", choose.BULK_PROBE_TEXTS[:16])
    assert auto.prepare_query_graph("off", "auto")
    assert asked == engines and set(auto.gate_reports) == set(engines)
    passed = [name for name, report in auto.gate_reports.items() if report.passed]
    assert passed == engines  # all hold the bar here (the test above)
    kind = auto.query_path.kind
    assert kind == "frozen" or kind in passed, auto.forward_path
    print(f"auto kept {auto.forward_path}")


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
async def test_a_worker_started_with_the_setting_serves_the_engines_vectors(
    workers: WorkerLauncher,
    settings: Settings,
    client: aioredis.Redis,
    encoder: Encoder,
    built: Callable[[str], BackendForward],
    monkeypatch: pytest.MonkeyPatch,
    engine: str,
) -> None:
    """EMBEDFLEET_CPU_BACKEND=<engine> on a fresh worker: its query stage asks for the
    engine's copy at start, gates and keeps it, and bulk batches through it give vectors
    within the bar of float32 sentence-transformers, through Redis. The copy handed over is
    the module's (``build_backend`` of the same model's float32 weights, what the worker's own
    call builds: an ONNX export is 15 s of CPU on an AVX2 core); a worker process building its
    own at start is tests/end_to_end/test_no_phone_home.py's ("backend copy made")."""
    count = 40
    chunks = list(builtin_corpus(count))
    fresh = Encoder(dtype="auto")
    assert fresh.model_dir == encoder.model_dir  # the module's copies are of this model
    asked: list[tuple[str, str]] = []

    def build_backend(wanted: str, precision: str) -> BackendForward:
        asked.append((wanted, precision))
        return built(wanted)

    monkeypatch.setattr(fresh.paths, "build_backend", build_backend)
    chosen = settings.model_copy(update={"cpu_backend": engine})
    async with Producer(chosen, client) as producer, workers.run(chosen, encoder=fresh):
        await producer.enqueue(chunks, job=engine)
        progress = await producer.wait_for_job(engine, timeout=600)
        results = {r.id: r.vector.astype(np.float32) async for r in producer.results(job=engine)}
    assert asked == [(engine, "default")]  # the setting reached the worker's start
    assert fresh.gate_reports[engine].passed
    assert progress.done == count and progress.dead == 0
    assert fresh.forward_path.startswith(engine) and fresh.query_path.kind == engine
    assert fresh.computes_in_reduced_precision  # so bulk batches ran through the copy
    vectors = np.stack([results[chunk.id] for chunk in chunks])
    want = reference_model().encode([chunk.text for chunk in chunks])
    found = cosines(want, vectors)
    print(f"worker on {fresh.forward_path}: min {found.min():.6f} mean {found.mean():.7f}")
    assert found.min() >= MIN_COSINE and found.mean() >= MEAN_COSINE
