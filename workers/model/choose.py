"""Which forward path a CPU worker keeps, chosen once at start (``Encoder.prepare_query_graph``).

From the CPU class (workers/cpus.py: native bf16, int8 dot products), the precision settled at
load (workers/model/precision.py) and the probes: the frozen graph is kept where it matches the
eager model (workers/model/frozen.py); each int8 copy this CPU runs (workers/model/int8.py) is
held to the float32 bar on the held-out set and, under ``auto``, raced against the frozen graph
(or the eager model) on a timed bulk-shaped batch. The fastest is kept, an int8 copy only where
it is at least :data:`INT8_MIN_GAIN` faster (it costs a little parity). Then the other engines
``EMBEDFLEET_CPU_BACKEND`` names (workers/model/backends.py: ONNX Runtime, OpenVINO): each copy
is held to the same bar on the held-out set; one named is kept whenever it holds it, and under
``auto`` each installed one is raced against torch's path and kept where at least
:data:`BACKEND_MIN_GAIN` faster. The paths themselves are workers/model/forward.py's.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import numpy as np
import torch

from embedfleet.shared.logging import get_logger
from embedfleet.shared.settings.query_stage import CpuBackend
from embedfleet.workers.cpus import CpuClass, cpu_class
from embedfleet.workers.model.backends import BackendForward, BuildCost, wanted_engines
from embedfleet.workers.model.dense import Dense
from embedfleet.workers.model.forward import CopyPath, EagerPath, ForwardPath, layer_stack
from embedfleet.workers.model.frozen import FrozenForward, build_checked, freeze, frozen_min_cosine
from embedfleet.workers.model.int8 import (
    DynamicInt8Forward,
    Int8Forward,
    W8A8Forward,
    build_int8,
    cpp_compiler_available,
)
from embedfleet.workers.model.precision import (
    BULK_PROBE_TEXTS,
    FP32,
    GATE_TEXTS,
    PROBE_BATCH,
    PROBE_TEXTS,
    GateReport,
    ParityReport,
    embed_in_batches,
    gate,
)
from embedfleet.workers.model.tokenizer import EncodeBatch

log = get_logger("embedfleet.encoder")

# EMBEDFLEET_CPU_INT8_PATH: which int8 copies are tried ("auto": every one this CPU can run)
Int8Choice = Literal["auto", "w8a8", "dynamic", "off"]
INT8_PATHS: dict[str, str] = {"w8a8": W8A8Forward.name, "dynamic": DynamicInt8Forward.name}
# An int8 copy replaces the frozen graph only if its timed batch is at least this much faster:
# it costs a little parity, and a tie on the probe batch (Zen 4, 201.0 against 201.8 ms) was
# 28% fewer tokens/s in the bulk (docs/BENCHMARKS.md, the query stage's bound per path).
INT8_MIN_GAIN = 0.10
# Another engine replaces torch's path under CPU_BACKEND=auto only if this much faster on the
# timed batch: a tie keeps the path whose query-stage bound and bulk figures are measured
# (docs/BENCHMARKS.md).
BACKEND_MIN_GAIN = 0.10


def cpu_paths(cpu: CpuClass, compiler: bool) -> list[str]:
    """Every forward path a CPU worker with EMBEDFLEET_DTYPE=auto may choose at start, each held
    to the same parity bar: float32; bfloat16 where the CPU runs it natively (elsewhere it is
    emulated, slower than float32); the dynamic int8 copy wherever FBGEMM/oneDNN have int8
    kernels (AVX2 and up: vpmaddubsw, VNNI, AMX); the W8A8 copy where inductor can compile its
    kernels (a C++ compiler) and the CPU has int8 dot-product instructions (VNNI, AMX): its
    int8 matmul (``torch._int_mm``) has no fast kernel below them, and on a real AVX2-only Zen 3
    it ran tens of times slower than float32 (docs/BENCHMARKS.md), after a minute's compile at
    every start. Which of them is kept is measured at start (:meth:`CpuPaths.choose`)."""
    paths = ["float32"]
    if cpu.fast_bf16:
        paths.append("bfloat16")
    if cpu.int8_dot != "none":
        paths.append(DynamicInt8Forward.name)
    if compiler and cpu.int8_dot in ("vnni", "amx"):
        paths.append(W8A8Forward.name)
    return paths


class CpuPaths:
    """The CPU copies of one loaded model: built, held to their bars and raced by
    :meth:`choose`; the held-out gate's verdicts kept in :attr:`gate_reports`."""

    def __init__(
        self,
        eager: EagerPath,
        sentence: Dense,
        batch_of: Callable[[Sequence[str]], EncodeBatch],
        *,
        auto_dtype: bool,
        parity: ParityReport | None,
    ) -> None:
        self.eager = eager
        self.sentence = sentence
        self.batch_of = batch_of  # tokenize and collate, as the worker does
        # int8 copies are gated against float32's vectors, which only `auto` computes (an
        # explicit dtype is what the operator wants, not a candidate to beat)
        self.auto_dtype = auto_dtype
        self.parity = parity
        self.gate_reports: dict[str, GateReport] = {}
        # what each engine copy built cost (export, compile, memory), for the log and the bench
        self.backend_costs: dict[str, BuildCost] = {}
        # a float32 copy of the loaded model for the engines to export (set by the encoder:
        # reloaded where the model was cast to bf16, whose rounding a float32 engine would keep)
        self.float32_model: Callable[[], torch.nn.Module] = lambda: self.eager.model

    @property
    def precision_name(self) -> str:
        return self.eager.precision.name

    def choose(
        self,
        int8: bool | Int8Choice,
        backend: CpuBackend = "torch",
        openvino_precision: str = "default",
    ) -> ForwardPath | None:
        """The path kept for queries and frozen bulk (``Encoder.prepare_query_graph`` says what
        ``int8`` and ``backend`` mean); None where no CPU copy applies (not a CPU, autocast, a
        model that does not end in pooling, a dtype the CPU emulates): the path held stays.
        Raises :class:`~embedfleet.workers.model.backends.MissingBackend` where ``backend``
        names an engine whose extra is not installed."""
        precision = self.eager.precision
        if self.eager.device.type != "cpu" or precision.method == "autocast":
            return None
        cpu = cpu_class()
        dtype_name = str(precision.dtype).removeprefix("torch.")
        # the missing extra said before anything is built
        engines = wanted_engines(backend, dtype_name, cpu)
        if not self.eager.representation.ends_in_pooling:  # the copies end in pooling
            return None
        if not cpu.runs_natively(dtype_name):
            # an explicit bf16/fp16 where the CPU emulates it: its frozen graph's fused kernels
            # ran several times slower than the eager model and took over a minute to build
            # (docs/BENCHMARKS.md); eager keeps the layer boundaries queries get in at
            log.warning(
                "no frozen query graph: this CPU has no native matmul in the dtype asked for "
                "(emulated, slower than float32); queries and bulk run eager. "
                "EMBEDFLEET_DTYPE=auto or float32 is faster here",
                dtype=dtype_name,
                cpu=cpu.describe(),
            )
            return None
        choice: Int8Choice = "auto" if int8 is True else "off" if int8 is False else int8
        # an engine named whose copy holds the bar is kept: torch's copies are not built then
        named = [] if backend == "auto" else self.backend_candidates(engines, openvino_precision)
        kept: ForwardPath
        timings: dict[str, float] = {}
        if named:
            kept = named[0]
        else:
            kept, timings = self.torch_path(choice)
        if backend == "auto" and (others := self.backend_candidates(engines, openvino_precision)):
            kept, raced = self.keep_fastest(kept, others, BACKEND_MIN_GAIN)
            timings |= raced
        log.info(
            "forward path chosen",
            path=kept.name,
            cpu=cpu.describe(),
            candidates=",".join(cpu_paths(cpu, cpp_compiler_available()) + engines),
            gated=",".join(f"{name}:{r.passed}" for name, r in self.gate_reports.items()),
            backend=backend,
            **milliseconds(timings),
            **{
                f"{engine}_{field}": value
                for engine, cost in self.backend_costs.items()
                for field, value in cost.log_fields().items()
            },
        )
        return kept

    def torch_path(self, choice: Int8Choice) -> tuple[ForwardPath, dict[str, float]]:
        """torch's path: the frozen graph (or the eager model), or an int8 copy ``choice``
        names that passes its gate (under ``auto``: where the race keeps it); the seconds timed
        by path."""
        candidates = self.int8_candidates(choice)
        kept: ForwardPath = self.build_frozen() or self.eager
        if candidates and choice == "auto":
            return self.keep_fastest(kept, candidates)
        return (candidates[0] if candidates else kept), {}

    def through(self, copy: FrozenForward | Int8Forward | BackendForward) -> CopyPath:
        """``copy`` as a forward path, named as logged."""
        if isinstance(copy, Int8Forward):
            return CopyPath(copy, self.sentence, f"{copy.name} ({self.precision_name} around it)")
        if isinstance(copy, FrozenForward):
            return CopyPath(copy, self.sentence, f"{self.precision_name} frozen")
        return CopyPath(copy, self.sentence, f"{copy.name} {copy.precision}")

    def build_frozen(self) -> CopyPath | None:
        """The frozen graph, kept only where it embeds the probe batches like the eager model."""
        example = self.batch_of(["a query", "a longer query, so the batch pads"])
        # single texts (no padding) and padded batches of mixed lengths
        probe = [[PROBE_TEXTS[0]], [PROBE_TEXTS[-1]], list(PROBE_TEXTS[:4]), list(PROBE_TEXTS)]
        frozen = build_checked(
            build=lambda: freeze(self.eager.model, (example.input_ids, example.attention_mask)),
            eager=self.eager.embed,
            frozen=lambda forward, batch: self.through(forward).embed(batch),
            probe_batches=[self.batch_of(texts) for texts in probe],
            min_cosine=frozen_min_cosine(self.eager.precision.dtype),
        )
        return self.through(frozen) if frozen is not None else None

    def backend_candidates(self, engines: Sequence[str], openvino_precision: str) -> list[CopyPath]:
        """The copies of ``engines`` (workers/model/backends.py), built, each kept only if it
        holds the bar on the held-out set (in :attr:`gate_reports` either way) against float32's
        vectors, or where no float32 vectors are computed (an explicit dtype) the eager
        model's."""
        if not engines:
            return []
        reference = self.float32_heldout()
        if reference is None:
            reference = embed_in_batches(
                lambda texts: self.eager.embed(self.batch_of(texts)), GATE_TEXTS
            )
        kept: list[CopyPath] = []
        for engine in engines:
            copy = self.build_backend(engine, openvino_precision)
            if copy is not None and self.gate(copy, reference).passed:
                kept.append(self.through(copy))
        return kept

    def build_backend(self, engine: str, openvino_precision: str) -> BackendForward | None:
        """``engine``'s copy of the model (its cost in :attr:`backend_costs`), or None where it
        cannot be built here (said at warning: torch's path serves)."""
        example = self.batch_of(["a query", "a longer query, so the batch pads"])
        inputs = (example.input_ids, example.attention_mask)
        threads = torch.get_num_threads()  # the worker's (EMBEDFLEET_THREADS, the cgroup's)
        try:
            copy: BackendForward
            if engine == "openvino":
                from embedfleet.workers.model.openvino import build_openvino

                copy = build_openvino(
                    self.float32_model(),
                    inputs,
                    threads=threads,
                    precision=openvino_precision,
                    layers=layer_stack,  # cut there where it can be: queries get in between
                )
            else:
                from embedfleet.workers.model.onnxruntime import build_onnxruntime

                copy = build_onnxruntime(self.float32_model(), inputs, threads=threads)
        except Exception as error:  # an op the exporter lacks, a plugin that fails, ...
            log.warning(
                "backend copy not used: it could not be built here; torch's path serves",
                backend=engine,
                error=repr(error)[:300],
            )
            return None
        self.backend_costs[engine] = copy.cost
        return copy

    def float32_heldout(self) -> np.ndarray | None:
        """float32's vectors of the held-out set, to gate other paths on: kept from `auto`'s
        probe, or computed now where the model is float32 under `auto`; None with an explicit
        dtype (nothing is gated then)."""
        if not self.auto_dtype:
            return None
        if self.parity is not None and self.parity.heldout_reference is not None:
            return self.parity.heldout_reference
        if self.eager.precision != FP32:
            return None
        return embed_in_batches(lambda texts: self.eager.embed(self.batch_of(texts)), GATE_TEXTS)

    def int8_candidates(self, choice: Int8Choice) -> list[CopyPath]:
        """The int8 copies ``choice`` names that this CPU runs, built, each kept only if it
        passes the held-out gate (in :attr:`gate_reports` either way)."""
        if choice == "off":
            return []
        reference = self.float32_heldout()
        if reference is None:
            log.info(
                "int8 compute not used: it is gated against float32's vectors of the held-out "
                "set, which only EMBEDFLEET_DTYPE=auto computes (not an explicit dtype)"
            )
            return []
        wanted = list(INT8_PATHS.values()) if choice == "auto" else [INT8_PATHS[choice]]
        runnable = _runnable_int8(wanted, forced=choice != "auto")
        kept: list[CopyPath] = []
        for name in wanted:
            if name not in runnable:
                continue
            copy = self.build_int8(name)
            if copy is not None and self.gate(copy, reference).passed:
                kept.append(self.through(copy))
        return kept

    def build_int8(self, name: str) -> Int8Forward | None:
        """The int8 copy ``name`` (``int8-w8a8``, ``int8-dynamic``), or None where it cannot be
        built here (said at warning)."""
        model = self.eager.model
        try:
            dynamic = name != W8A8Forward.name
            return build_int8(model, layer_stack, self.run_copy, PROBE_TEXTS, dynamic=dynamic)
        except Exception as error:  # an untraceable model, a compiler that fails, ...
            log.warning(
                "int8 compute not used: the int8 copy could not be built here; set "
                "EMBEDFLEET_CPU_INT8=false to skip the attempt",
                path=name,
                error=repr(error)[:300],
            )
            return None

    @torch.inference_mode()
    def run_copy(self, model: torch.nn.Module, texts: Sequence[str]) -> None:
        """``model`` (a copy of the loaded one) over ``texts`` in one padded batch, in the
        loaded model's precision: what an int8 copy is calibrated with."""
        batch = self.batch_of(list(texts))
        with self.eager.precision.context(self.eager.device):
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)

    def gate(self, copy: Int8Forward | BackendForward, reference: np.ndarray) -> GateReport:
        """Hold ``copy`` to the float32 bar on the held-out set (never the probe texts its
        smoothing was calibrated on). A W8A8 copy compiles here: one single text first, then
        padded batches, so both compiled shapes are made now rather than at a query (an engine
        copy's first shapes are made here too)."""
        path = self.through(copy)
        try:
            path.embed(self.batch_of(list(GATE_TEXTS[:1])))
            vectors = embed_in_batches(
                lambda texts: path.embed(self.batch_of(list(texts))), GATE_TEXTS, PROBE_BATCH
            )
        except Exception as error:  # inductor fails to compile, an engine's kernel fails, ...
            log.warning(
                "int8 compute not used: the int8 copy does not run here (torch.compile needs a "
                "C++ compiler on a CPU); set EMBEDFLEET_CPU_INT8=false to skip the attempt"
                if isinstance(copy, Int8Forward)
                else "backend copy not used: it does not run here; torch's path serves",
                path=copy.name,
                error=repr(error)[:300],
            )
            vectors = np.full_like(reference, np.nan)
        report = gate(copy.name, reference, vectors)
        self.gate_reports[copy.name] = report
        return report

    def keep_fastest(
        self,
        baseline: ForwardPath,
        candidates: Sequence[CopyPath],
        min_gain: float = INT8_MIN_GAIN,
    ) -> tuple[ForwardPath, dict[str, float]]:
        """Time one bulk-shaped batch through each copy that passed the gate (int8, or another
        engine's) and through ``baseline`` (the frozen graph, or the eager model where the graph
        was not kept, or the int8 copy kept); the fastest where at least ``min_gain`` faster
        than ``baseline``, and the seconds measured by path."""
        batch = self.batch_of(list(BULK_PROBE_TEXTS))
        contenders: dict[str, ForwardPath] = {baseline.name: baseline}
        for candidate in candidates:
            contenders[candidate.copy_name] = candidate
        runs = {name: functools.partial(path.serve, batch) for name, path in contenders.items()}
        seconds = best_of_interleaved(runs, 5)
        fastest = min(seconds, key=seconds.__getitem__)
        if seconds[fastest] > seconds[baseline.name] * (1 - min_gain):
            fastest = baseline.name  # a tie keeps the baseline (int8: without its parity cost)
        log.info("forward paths timed", **milliseconds(seconds), kept=fastest, min_gain=min_gain)
        return contenders[fastest], seconds


def _runnable_int8(wanted: Sequence[str], *, forced: bool) -> list[str]:
    """The int8 copies of ``wanted`` this CPU runs, saying why the W8A8 copy is not tried, or
    that it is tried where ``forced`` (EMBEDFLEET_CPU_INT8_PATH=w8a8) on a CPU it is slow on."""
    compiler = cpp_compiler_available()
    runnable = cpu_paths(cpu_class(), compiler)
    if W8A8Forward.name in wanted and not compiler:
        log.info(
            "int8 W8A8 copy not tried: torch.compile builds its CPU kernels with a C++ "
            "compiler ($CXX, g++ or clang++), and none is on PATH (the CPU image has none)"
        )
    elif W8A8Forward.name in wanted and W8A8Forward.name not in runnable:
        if not forced:
            log.info(
                "int8 W8A8 copy not tried: this CPU has no int8 dot-product instructions "
                "(AVX512-VNNI, AVX-VNNI or AMX), where its int8 matmul runs slower than "
                "float32"
            )
        else:  # the operator's choice, said
            runnable = [*runnable, W8A8Forward.name]
            log.warning(
                "int8 W8A8 copy forced on a CPU without int8 dot-product instructions "
                "(AVX512-VNNI, AVX-VNNI or AMX): its int8 matmul runs slower than float32 "
                "here; EMBEDFLEET_CPU_INT8_PATH=auto leaves it out"
            )
    return runnable


def milliseconds(seconds: dict[str, float]) -> dict[str, float]:
    """Log fields ``<path>_ms`` (``bfloat16_frozen_ms``, ``int8_w8a8_ms``) of timed paths."""
    return {
        f"{name.replace(' ', '_').replace('-', '_')}_ms": round(value * 1000, 1)
        for name, value in seconds.items()
    }


def best_of_interleaved(runs: Mapping[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Each run's shortest of ``rounds`` timed calls, taken in turn (A B C, A B C, ...) after
    one untimed call each, so a burst of contention slows every contender alike."""
    for run in runs.values():
        run()
    best = dict.fromkeys(runs, math.inf)
    for _ in range(rounds):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def best_of(run: Callable[[], object], repeat: int) -> float:
    """The shortest of ``repeat`` timed calls, after one untimed (warm-up) call."""
    run()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)
