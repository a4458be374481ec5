"""The query stage on CUDA: its own copy of the model, a high-priority stream, CUDA graphs.

On a CPU, queries are served at the transformer-layer boundaries of the bulk pass, through
forward pre-hooks on the bulk model (``Encoder.set_layer_callback``). On CUDA that does not
work: a hook fires when the host *launches* a layer, not when the GPU runs it. The host enqueues
a whole bulk forward in milliseconds and then waits in the device-to-host copy, where no hook
fires, so a query arriving then (nearly always) waits for the whole batch; and a query served
from a hook would queue on the same stream behind the layers already launched. Hooks also rule
out CUDA graphs.

So on CUDA (the choice made here) the layer hooks are not installed at all. Queries are served
from a thread of their own (``workers/queries.py``), on a stream with the device's highest
priority, through a deep copy of the model that shares nothing with the bulk model: the GPU's
block scheduler runs the query's kernels ahead of the bulk's queued ones, so a query waits for
the bulk kernels already running (microseconds to a few milliseconds), not for the batch. The
copy costs a small embedder's weights twice (MiniLM: 45 MB in fp16) and keeps whatever the bulk
path does to its model (hooks, attention switches for the varlen path) away from the graphs.

CUDA graphs: a short query's forward is launch-bound (a MiniLM pass is ~100 kernels of a few
microseconds each); one replay launches them all at once. A graph has static shapes, so a query
batch is padded up to a bucket (batch 1-16 x length 16-512, right padding only) and its vectors
are taken from the real rows. A graph is kept only where its replay beat the eager pass at
capture time; a failed capture leaves every query on the stream, eager.

Everything that decides (buckets, padding, which path serves) is a pure function, tested on a
CPU; the class that touches CUDA is small and runs only where ``device.type == "cuda"``.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from embedfleet.shared.logging import get_logger
from embedfleet.shared.settings.query_stage import Engine
from embedfleet.workers.model.precision import Precision
from embedfleet.workers.model.tokenizer import EncodeBatch, TextTokenizer

log = get_logger("embedfleet.cuda_queries")

# Which path served a query batch (reported per worker as embedfleet_queries_served_total):
# graph/stream on CUDA (this module), frozen on a CPU (workers/model/frozen.py), eager otherwise.
QueryPath = Literal["graph", "stream", "frozen", "int8", Engine, "eager"]
# EMBEDFLEET_CUDA_QUERY_LANE: how queries run on their own copy of the model on CUDA
CudaQueryMode = Literal["graph", "stream", "off"]

BATCH_BUCKETS = (1, 2, 4, 8, 16)
LENGTH_BUCKETS = (16, 32, 64, 128, 256, 512)
# Beyond the highest the stream's scheduler maps any value to it (torch.cuda.Stream's contract).
HIGHEST_PRIORITY = -100
TIMING_RUNS = 5  # replays and eager passes per bucket when deciding whether its graph wins


@dataclass(frozen=True, order=True)
class Shape:
    """A graph's static input shape: rows x tokens."""

    batch: int
    length: int


def bucket_for(value: int, buckets: Iterable[int]) -> int | None:
    """The smallest bucket that holds ``value``; None when none does."""
    return min((bucket for bucket in buckets if bucket >= value), default=None)


def length_buckets(max_length: int, buckets: Iterable[int] = LENGTH_BUCKETS) -> tuple[int, ...]:
    """The length buckets for a model: those under its maximum, and one at the maximum (capped
    at the largest configured) so that the longest query it takes still fits a graph."""
    configured = sorted(buckets)
    kept = {bucket for bucket in configured if bucket < max_length}
    kept.add(min(max_length, configured[-1]))
    return tuple(sorted(kept))


def graph_shapes(max_length: int) -> list[Shape]:
    """Every bucket a graph is captured for, largest first (later, smaller captures then reuse
    the memory pool the largest one grew)."""
    shapes = [Shape(b, n) for b in BATCH_BUCKETS for n in length_buckets(max_length)]
    return sorted(shapes, reverse=True)


def shape_for(rows: int, longest: int, shapes: Iterable[Shape]) -> Shape | None:
    """The smallest captured shape a batch of ``rows`` texts, ``longest`` tokens, fits."""
    fitting = [s for s in shapes if s.batch >= rows and s.length >= longest]
    return min(fitting, key=lambda s: (s.batch * s.length, s.length), default=None)


def choose_path(
    rows: int, longest: int, graphs: Iterable[Shape], *, pad_left: bool
) -> tuple[QueryPath, Shape | None]:
    """Which CUDA path serves a batch: the graph of the smallest bucket it fits, else the
    stream (eager). Left-padded models never use a graph: extra left padding moves the real
    tokens' positions in some architectures, which right padding never does."""
    shape = None if pad_left else shape_for(rows, longest, graphs)
    return ("graph", shape) if shape is not None else ("stream", None)


def pad_to_shape(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, shape: Shape, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A right-padded batch grown to ``shape``: padding columns masked out, and padding rows of
    one masked-in pad token (a row with every key masked is 0/0 in some attention kernels; its
    vector is dropped either way)."""
    rows, length = input_ids.shape
    if rows > shape.batch or length > shape.length:
        raise ValueError(f"a {rows}x{length} batch does not fit {shape}")
    ids = torch.full((shape.batch, shape.length), pad_id, dtype=input_ids.dtype)
    mask = torch.zeros((shape.batch, shape.length), dtype=attention_mask.dtype)
    ids[:rows, :length] = input_ids
    mask[:rows, :length] = attention_mask
    mask[rows:, 0] = 1
    return ids, mask


def graph_wins(graph_seconds: list[float], eager_seconds: list[float]) -> bool:
    """Keep a bucket's graph when its median replay is no slower than the eager pass's."""
    return float(np.median(graph_seconds)) <= float(np.median(eager_seconds))


# --- CUDA only ---------------------------------------------------------------------------
Vectors = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], np.ndarray]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor  # static, on the device: each replay reads these
    attention_mask: torch.Tensor
    hidden: torch.Tensor  # static output: overwritten by the next replay


class CudaQueryRunner:
    """Query forward passes on their own model copy and stream. One thread at a time."""

    def __init__(
        self,
        model: torch.nn.Module,
        vectors: Vectors,
        precision: Precision,
        device: torch.device,
        *,
        pad_id: int,
        pad_left: bool,
        max_length: int,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"the CUDA query path needs a CUDA device, not {device}")
        self.device = device
        self.vectors = vectors  # pooling and head: read-only modules, safe beside the bulk
        self.precision = precision
        self.pad_id = pad_id
        self.pad_left = pad_left
        self.max_length = max_length
        self.model = copy.deepcopy(model).eval()
        for module in self.model.modules():  # the copy must never call the bulk's hooks
            module._forward_pre_hooks.clear()
            module._forward_hooks.clear()
        self.stream = torch.cuda.Stream(device=device, priority=HIGHEST_PRIORITY)
        self.graphs: dict[Shape, _Graph] = {}

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        # No autocast cache: cached casts of the weights would be freed after capture.
        if self.precision.method == "autocast":
            return torch.autocast("cuda", dtype=self.precision.dtype, cache_enabled=False)
        return contextlib.nullcontext()

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    @torch.inference_mode()
    def capture(self) -> int:
        """Capture a graph per bucket, keep those that beat eager; the number kept. Any failure
        drops them all (the stream serves every query). Call before serving, on one thread."""
        if self.pad_left:
            log.info("CUDA query path on its stream; no graphs for a left-padded model")
            return 0
        pool = torch.cuda.graph_pool_handle()
        started = time.perf_counter()
        try:
            for shape in graph_shapes(self.max_length):
                captured = self._capture(shape, pool)
                if graph_wins(self._time_replay(captured), self._time_eager(captured)):
                    self.graphs[shape] = captured
        except Exception as error:  # a capture failure is no reason to refuse queries
            self.graphs.clear()
            torch.cuda.synchronize(self.device)
            log.warning("CUDA graph capture failed; queries run on the stream", error=repr(error))
            return 0
        log.info(
            "CUDA query path: graphs captured",
            kept=len(self.graphs),
            of=len(graph_shapes(self.max_length)),
            seconds=round(time.perf_counter() - started, 2),
            stream_priority=self.stream.priority,
        )
        return len(self.graphs)

    def _capture(self, shape: Shape, pool: torch.cuda._POOL_HANDLE) -> _Graph:
        # static inputs: one real token a row until a replay copies a batch in
        ids = torch.full((shape.batch, shape.length), self.pad_id, device=self.device)
        mask = torch.zeros_like(ids)
        mask[:, 0] = 1
        with torch.cuda.stream(self.stream):
            for _ in range(2):  # kernels chosen, workspaces allocated, before capture
                self._forward(ids, mask)
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=self.stream):
            hidden = self._forward(ids, mask)
        return _Graph(graph, ids, mask, hidden)

    def _time_replay(self, captured: _Graph) -> list[float]:
        return self._timed(lambda: captured.graph.replay())

    def _time_eager(self, captured: _Graph) -> list[float]:
        return self._timed(lambda: self._forward(captured.input_ids, captured.attention_mask))

    def _timed(self, run: Callable[[], object]) -> list[float]:
        seconds = []
        with torch.cuda.stream(self.stream):
            for _ in range(TIMING_RUNS):
                started = time.perf_counter()
                run()
                self.stream.synchronize()
                seconds.append(time.perf_counter() - started)
        return seconds

    @torch.inference_mode()
    def embed(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompts: torch.Tensor | None
    ) -> tuple[np.ndarray, QueryPath]:
        """Vectors for a padded CPU batch, and the path that computed them."""
        rows, longest = input_ids.shape
        path, shape = choose_path(rows, longest, self.graphs, pad_left=self.pad_left)
        with torch.cuda.stream(self.stream):
            if shape is not None:
                captured = self.graphs[shape]
                ids, mask = pad_to_shape(input_ids, attention_mask, shape, self.pad_id)
                captured.input_ids.copy_(ids, non_blocking=True)
                captured.attention_mask.copy_(mask, non_blocking=True)
                captured.graph.replay()
                # pooled over the real rows; the mask's padding columns keep padding out
                hidden, mask_rows = captured.hidden[:rows], captured.attention_mask[:rows]
                return self.vectors(hidden, mask_rows, prompts), path
            ids = input_ids.to(self.device, non_blocking=True)
            mask = attention_mask.to(self.device, non_blocking=True)
            return self.vectors(self._forward(ids, mask), mask, prompts), path


class CudaQueryPath:
    """The query stage's :class:`CudaQueryRunner` as a forward path (workers/model/forward.py):
    served from its own thread, beside the bulk model, and never for bulk batches."""

    kind: Literal["cuda"] = "cuda"

    def __init__(self, runner: CudaQueryRunner, name: str) -> None:
        self.runner = runner
        # the bulk model's path, as logged before this path was prepared: this path itself
        # is told apart in the query stage's "served_on"
        self.name = name

    @classmethod
    def prepare(
        cls,
        model: torch.nn.Module,
        vectors: Vectors,
        precision: Precision,
        device: torch.device,
        *,
        mode: CudaQueryMode,
        text: TextTokenizer,
        name: str,
    ) -> CudaQueryPath:
        """The CUDA query path for ``model`` (its own copy; ``vectors``: the sentence pipeline on
        hidden states), its CUDA graphs captured where ``mode`` is ``graph``."""
        runner = CudaQueryRunner(
            model,
            vectors,
            precision,
            device,
            pad_id=text.pad_id,
            pad_left=text.pad_left,
            max_length=text.max_length,
        )
        if mode == "graph":
            runner.capture()
        return cls(runner, name)

    def serve(self, batch: EncodeBatch) -> tuple[np.ndarray, QueryPath]:
        return self.runner.embed(batch.input_ids, batch.attention_mask, batch.prompt_lengths)
