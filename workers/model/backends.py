"""Other engines as CPU forward paths (``EMBEDFLEET_CPU_BACKEND``): ONNX Runtime and OpenVINO.

Each is imported only when the setting names it, ``auto`` finds it installed, or ``default``
adopts it for the CPU class (:func:`adopted_engine`: OpenVINO where bf16 runs natively, which the
worker extra installs for that; ONNX Runtime is an extra of its own, ``'embedfleet[onnxruntime]'``):
the light client never needs them. A backend copy is built from a float32 copy of the
loaded transformer (workers/model/openvino.py, workers/model/onnxruntime.py), returns the last
hidden state like the frozen graph, and the sentence pipeline follows (workers/model/forward.py's
:class:`~embedfleet.workers.model.forward.CopyPath`). It is held to the one parity bar on the
held-out set and, under ``auto``, raced with torch's path at start (workers/model/choose.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol, TypeVar, get_args

import torch

from embedfleet.shared.settings.query_stage import CpuBackend, Engine
from embedfleet.workers.cpus import CpuClass, cpu_class
from embedfleet.workers.model.frozen import hook_free_copy
from embedfleet.workers.model.telemetry import without_telemetry

# the engines besides torch, each the name of its package and of the extra that installs it
ENGINES: tuple[Engine, ...] = get_args(Engine)

# What each engine's extra installs that its copy imports: ONNX Runtime's is built by torch's
# exporter, which needs onnx and (the dynamo exporter) onnxscript
MODULES: dict[str, tuple[str, ...]] = {
    "onnxruntime": ("onnxruntime", "onnx", "onnxscript"),
    "openvino": ("openvino",),
}


class MissingBackend(RuntimeError):
    """EMBEDFLEET_CPU_BACKEND names an engine whose extra is not installed."""


def installed(engine: str) -> bool:
    """Whether ``engine``'s packages can be imported here (without importing them)."""
    return all(importlib.util.find_spec(module) is not None for module in MODULES[engine])


def require(engine: str) -> ModuleType:
    """``engine``'s package, imported now, with every engine's telemetry off first (importing
    OpenVINO alone sends an event to Google Analytics, workers/model/telemetry.py): the one place
    the worker imports an engine; :class:`MissingBackend` naming the extra where it is not
    installed."""
    if engine not in ENGINES:
        raise ValueError(f"not a CPU backend: {engine!r} (one of {', '.join(ENGINES)})")
    if not installed(engine):
        missing = [m for m in MODULES[engine] if importlib.util.find_spec(m) is None]
        raise MissingBackend(
            f"EMBEDFLEET_CPU_BACKEND={engine} needs the {engine!r} extra ({', '.join(missing)} "
            f"not installed here): pip install 'embedfleet[worker,{engine}]', or set "
            "EMBEDFLEET_CPU_BACKEND=torch"
        )
    # again here, not only at the package's import: a caller that imported this module alone
    # (a benchmark, a probe) goes through here too
    without_telemetry()
    return importlib.import_module(engine)


def adopted_engine(cpu: CpuClass, precision: str) -> str | None:
    """The engine CPU_BACKEND=default takes on ``cpu``'s class for a model settled in
    ``precision`` (``bfloat16``, ``float32``), where its extra is installed: OpenVINO where bf16
    runs natively (AMX, AVX512-BF16) and the model computes in it (EMBEDFLEET_DTYPE auto or
    bfloat16; OpenVINO computes in bf16 there), measured there faster than torch's path through
    the whole fleet at parity and within the query stage's bound (docs/BENCHMARKS.md); none
    elsewhere. ONNX Runtime computes in float32 only: slower than torch's bf16 path on every
    bf16 class, but 1.6x torch's float32 path on Zen 5, and not yet measured on the AVX2-only
    classes, where float32 is the default (its copy is not cut at its layers: the query stage's
    bound is to measure there too)."""
    if cpu.fast_bf16 and precision == "bfloat16" and installed("openvino"):
        return "openvino"
    return None


def wanted_engines(backend: CpuBackend, precision: str, cpu: CpuClass | None = None) -> list[str]:
    """The engines a worker builds for ``backend``: the one named (its extra is required), every
    installed one under ``auto``, none under ``torch``, and under ``default`` the one adopted for
    ``cpu``'s class (this process's CPU where not given) and the model's ``precision`` (the
    dtype it settled in), if any."""
    if backend == "torch":
        return []
    if backend == "default":
        adopted = adopted_engine(cpu if cpu is not None else cpu_class(), precision)
        return [] if adopted is None else [adopted]
    if backend == "auto":
        return [engine for engine in ENGINES if installed(engine)]
    require(backend)
    return [backend]


class HiddenStates(torch.nn.Module):
    """The transformer as the engines take it: ``(input_ids, attention_mask) -> last hidden
    state``, a float32 copy without hooks or BERT's pooler (token type ids: the model's own
    zeros, as the other copies leave them)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = hook_free_copy(model).float()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


@dataclass(frozen=True)
class BuildCost:
    """What a backend copy cost to make: seconds to export (convert) and to compile (load into a
    session), and the growth of this process's resident memory across both, in MiB (the
    copy's weights and the engine's own buffers)."""

    export_s: float
    compile_s: float
    rss_mib: float

    def log_fields(self) -> dict[str, float]:
        return {
            "export_s": round(self.export_s, 2),
            "compile_s": round(self.compile_s, 2),
            "rss_mib": round(self.rss_mib, 1),
        }


class BackendForward(Protocol):
    """A backend copy: ``(input_ids, attention_mask) -> last_hidden_state`` (float32)."""

    name: str
    precision: str  # what it computes in, as the engine says: bf16, f32
    cost: BuildCost

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor: ...


def resident_mib() -> float:
    """This process's resident memory (VmRSS), in MiB; 0 where /proc is not there."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


Result = TypeVar("Result")


def timed(step: Callable[[], Result]) -> tuple[Result, float]:
    """``step()`` and the seconds it took."""
    started = time.perf_counter()
    result = step()
    return result, time.perf_counter() - started
