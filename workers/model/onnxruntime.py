"""The ONNX Runtime copy of the model (``EMBEDFLEET_CPU_BACKEND=onnxruntime``, the ``onnxruntime``
extra, which brings ``onnx`` and ``onnxscript`` for torch's exporter).

``torch.onnx.export`` with the dynamo exporter (torch 2.13's default; the legacy TorchScript one
exports this model too, deprecated) writes the float32 transformer (workers/model/backends.py's
:class:`~embedfleet.workers.model.backends.HiddenStates`) with dynamic batch and sequence
dimensions to a temporary directory, removed once the session has read it (a worker re-exports
at each start: a few seconds for a MiniLM). The session runs on ``CPUExecutionProvider`` with
every graph optimization, ``intra_op_num_threads`` = the worker's torch threads and one inter-op
thread (the model thread is its only caller). It computes in float32: ONNX Runtime's CPU kernels
for this graph have no bf16 path.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from embedfleet.shared.logging import get_logger
from embedfleet.workers.model.backends import BuildCost, HiddenStates, require, resident_mib, timed

log = get_logger("embedfleet.onnxruntime")

NAME = "onnxruntime"
# Both inputs and the output: dynamic in batch and sequence
_INPUTS = ("input_ids", "attention_mask")


class OnnxRuntimeForward:
    """``(input_ids, attention_mask) -> last_hidden_state`` through the ONNX Runtime session."""

    name = NAME
    precision = "f32"

    def __init__(self, session: Any, cost: BuildCost) -> None:
        self._session = session
        self._output = session.get_outputs()[0].name
        self.cost = cost

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        feeds = {"input_ids": input_ids.numpy(), "attention_mask": attention_mask.numpy()}
        (hidden,) = self._session.run([self._output], feeds)
        return torch.from_numpy(hidden)


def export_onnx(
    model: torch.nn.Module, example: tuple[torch.Tensor, torch.Tensor], path: Path
) -> None:
    """``model`` (as :class:`HiddenStates`) to ``path`` with torch's dynamo exporter."""
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    shapes = {name: {0: batch, 1: sequence} for name in _INPUTS}
    # the exporter prints its progress to stdout (not the worker's log), warns about shape
    # checks that hold for these inputs and logs each torchvision op it cannot register
    exporter_log = logging.getLogger("torch.onnx")
    level = exporter_log.level
    exporter_log.setLevel(logging.ERROR)
    with (
        torch.inference_mode(False),
        torch.no_grad(),
        contextlib.redirect_stdout(io.StringIO()),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            example,
            str(path),
            input_names=list(_INPUTS),
            output_names=["last_hidden_state"],
            dynamic_shapes=shapes,
            dynamo=True,
            verbose=False,
        )
    exporter_log.setLevel(level)


def build_onnxruntime(
    model: torch.nn.Module, example: tuple[torch.Tensor, torch.Tensor], *, threads: int
) -> OnnxRuntimeForward:
    """Export ``model`` (the loaded transformer, any dtype: exported from a float32 copy) on
    ``example`` (input_ids, attention_mask, padded) and open a CPU session on ``threads``."""
    ort = require(NAME)  # and onnx, onnxscript: torch's exporter's, in the same extra
    rss_before = resident_mib()
    wrapped = HiddenStates(model).eval()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    with tempfile.TemporaryDirectory(prefix="embedfleet-onnx-") as folder:
        path = Path(folder) / "model.onnx"
        _, export_s = timed(functools.partial(export_onnx, wrapped, example, path))
        del wrapped  # the float32 copy: the session holds its own weights
        session, compile_s = timed(
            lambda: ort.InferenceSession(
                str(path), sess_options=options, providers=["CPUExecutionProvider"]
            )
        )
    cost = BuildCost(export_s, compile_s, resident_mib() - rss_before)
    log.info(
        "backend copy made",
        backend=NAME,
        version=ort.__version__,
        inference_precision=OnnxRuntimeForward.precision,
        threads=threads,
        exporter="dynamo",
        **cost.log_fields(),
    )
    return OnnxRuntimeForward(session, cost)
