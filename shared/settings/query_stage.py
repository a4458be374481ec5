"""Query stage settings: how queries get ahead of bulk work, and the forward paths they take.

The names follow docs/GLOSSARY.md; EMBEDFLEET_CUDA_QUERY_LANE keeps its old word (a settings name).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from embedfleet.shared.settings.section import Section

# EMBEDFLEET_CPU_BACKEND: the engine of a CPU worker's forward path (workers/model/backends.py)
# the CPU engines besides torch (workers/model/backends.py), each its package's and its extra's
# name: the one list of them, which the settings, the forward paths and the slice metric use
Engine = Literal["onnxruntime", "openvino"]
CpuBackend = Literal["default", "torch", Engine, "auto"]


class QueryStageSettings(Section):
    """The worker's query stage (queries between bulk slices, or beside them on CUDA) and the
    forward paths (frozen, int8, varlen) queries and bulk batches run through."""

    title: ClassVar[str] = "Query stage and forward paths"

    slice_ms: float = -1
    """Longest stretch of bulk compute a query may wait behind: one transformer layer of an eager
    batch, a whole batch through the frozen or int8 copy (no layer boundaries); batches are sized
    to fit from a cost model of each path, fitted while the worker runs (workers/cost_model.py).
    -1 = auto (100 on CPU, 20 on CUDA), 0 = no limit (bulk-only workers). Applies only where
    queries are served between bulk layers: not on the CUDA query path
    (EMBEDFLEET_CUDA_QUERY_LANE graph or stream), where queries run beside the bulk pass and bulk
    batches use the full token budget."""
    frozen_queries: bool = True
    """On CPU, queries run through a frozen TorchScript copy of the model (weights pre-packed once):
    about half the time of the eager pass for a short text. Kept only if it matches the eager model
    at startup; `false` runs queries eager."""
    frozen_bulk: bool = True
    """On CPU in bf16/fp16, bulk batches run through the same frozen copy as queries (needs
    FROZEN_QUERIES): eager reduced-precision linear layers are slow there (docs/BENCHMARKS.md). The
    copy has no layer boundaries, so bulk batches are sized whole to the query slice instead of one
    layer. `false`: eager, sliced per layer. Where the CPU emulates the dtype (bf16 without
    AVX512-BF16 or AMX) no frozen copy is built at all: its kernels ran slower than eager there."""
    cpu_int8: bool = True
    """On CPU with DTYPE=auto (whether it kept bf16 or float32), the frozen copy (queries, and bulk
    with FROZEN_BULK) may compute its linear layers in int8 (CPU_INT8_PATH): kept if it holds the
    bar `auto` holds bf16 to against float32 on the held-out parity set and a timed batch runs
    faster than the bf16/float32 copy; vectors are further from float32 than bf16's
    (docs/BENCHMARKS.md). The W8A8 copy is compiled (`torch.compile`, which needs a C++ compiler:
    the CPU image has none) at start-up: up to about a minute on 2 cores. `false`: no int8 copy, no
    compile."""
    cpu_int8_path: Literal["auto", "w8a8", "dynamic"] = "auto"
    """Which int8 copies CPU_INT8 tries. `auto`: every one this CPU can run (`dynamic`: PyTorch's
    dynamic int8 Linear, FBGEMM/oneDNN kernels on AVX2 and up; `w8a8`: SmoothQuant W8A8 compiled
    with `torch.compile`, needs a C++ compiler and int8 dot-product instructions, VNNI or AMX: below
    them its int8 matmul is slower than float32), each kept only if it holds the float32 bar on the
    held-out parity set (multilingual, long and odd texts none was calibrated on), the fastest of
    those and the frozen copy on a timed batch at start. `w8a8` / `dynamic`: only that copy, used
    whenever it holds the bar (no timing race): to force a path for a benchmark (`w8a8` is built
    even without VNNI/AMX then, with a warning)."""
    cpu_backend: CpuBackend = "default"
    """The engine of a CPU worker's forward path (queries, and bulk through the same copy; needs
    FROZEN_QUERIES). `default`: the engine adopted for this CPU class (docs/BENCHMARKS.md):
    OpenVINO where bf16 runs natively (AMX, AVX512-BF16) and its extra is installed (the worker
    extra installs it), held to the bar as below; torch elsewhere. `torch`: the frozen graph or
    an int8 copy above. `onnxruntime` / `openvino`: a
    copy of the model exported to that engine at start (its extra: `pip install
    'embedfleet[worker,openvino]'`; a worker whose extra is missing stops with that error), kept
    if it holds the float32 bar on the held-out parity set, else torch's path with a warning.
    `auto`: every installed engine is built, gated and timed against torch's path at start, and
    kept only where at least 10% faster. OpenVINO computes in bf16 where the CPU has it
    (OPENVINO_PRECISION); ONNX Runtime in float32. Export and compile times and memory are
    logged (`backend copy made`). No effect on CUDA."""
    openvino_precision: Literal["default", "bf16", "f32"] = "default"
    """OpenVINO's inference precision hint for CPU_BACKEND=openvino (or auto): `default` is
    OpenVINO's own (bf16 on CPUs with AMX or AVX512-BF16, else f32); `f32` for float32's
    numbers."""
    layout: Literal["auto", "padded", "varlen"] = "auto"
    """How bulk batches are laid out for the forward pass. `auto`: `varlen` on CUDA (every text of a
    batch end to end in one row, attention per text: no padding computed), `padded` on CPU (sorted,
    right-padded micro-batches; varlen measured slower there). Forcing `varlen` on CPU runs the CUDA
    path's code, slowly; `padded` on CUDA is the fallback if a varlen kernel misbehaves
    (docs/BENCHMARKS.md)."""
    cuda_query_lane: Literal["graph", "stream", "off"] = "graph"
    """On CUDA, queries run on their own model copy, on a high-priority stream, from their own
    thread beside the bulk pass (no layer hooks): `graph` also replays a CUDA graph per batch x
    length bucket where it beat eager at startup (a failed capture falls back to `stream`);
    `stream` without graphs; `off` serves them on the bulk model as on a CPU. No effect on a
    CPU."""
    query_only: bool = False
    """Serve only the query stream (dedicated query replicas)."""
    reply_ttl_s: int = Field(default=60, ge=1)
    """Reply keys expire after this long if the caller has gone."""

    @property
    def cpu_int8_choice(self) -> Literal["auto", "w8a8", "dynamic", "off"]:
        """The int8 copies a CPU worker tries (``Encoder.prepare_query_graph``): CPU_INT8_PATH,
        or ``off`` where CPU_INT8 is false."""
        return self.cpu_int8_path if self.cpu_int8 else "off"
