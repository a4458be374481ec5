"""The OpenVINO copy of the model (``EMBEDFLEET_CPU_BACKEND=openvino``, the ``openvino`` extra).

``openvino.convert_model`` takes the float32 transformer (workers/model/backends.py's
:class:`~embedfleet.workers.model.backends.HiddenStates`) with an example batch and leaves the
batch and sequence dimensions dynamic; the CPU plugin compiles it with its default performance
hint. Its default inference precision is bf16 on CPUs with AMX or AVX512-BF16 (f32 elsewhere):
``EMBEDFLEET_OPENVINO_PRECISION`` overrides it. Issue 43 measured the bare forward at 754 texts/s
in bf16 against torch bf16 eager's 570 on an AMX Xeon (2 threads, min cosine 0.99996 against
float32). Compiled once at start on the worker's torch threads (``INFERENCE_NUM_THREADS``), which
the two engines take in turn on the model thread, never at once.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import numpy as np
import torch

from embedfleet.shared.logging import get_logger
from embedfleet.workers.model.backends import BuildCost, HiddenStates, require, resident_mib, timed

log = get_logger("embedfleet.openvino")

NAME = "openvino"
# EMBEDFLEET_OPENVINO_PRECISION -> INFERENCE_PRECISION_HINT ("default": the plugin's own)
PRECISION_HINTS = {"bf16": "bf16", "f32": "f32"}


class OpenVinoForward:
    """``(input_ids, attention_mask) -> last_hidden_state`` through the compiled OpenVINO model
    (float32 out, whatever it computes in)."""

    name = NAME

    def __init__(self, compiled: Any, precision: str, cost: BuildCost) -> None:
        self._compiled = compiled
        self._output = compiled.output(0)
        # what the CPU plugin computes in (bf16 / f32), as it reports after compiling
        self.precision = precision
        self.cost = cost

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # the compiled model's own infer request (the model thread is its only caller); its
        # outputs come back copied (share_outputs=False), so the next call cannot overwrite them
        hidden = self._compiled(
            {"input_ids": input_ids.numpy(), "attention_mask": attention_mask.numpy()},
            share_inputs=True,
        )[self._output]
        return torch.from_numpy(np.asarray(hidden, dtype=np.float32))


def build_openvino(
    model: torch.nn.Module,
    example: tuple[torch.Tensor, torch.Tensor],
    *,
    threads: int,
    precision: str = "default",
) -> OpenVinoForward:
    """Convert ``model`` (the loaded transformer, any dtype: converted from a float32 copy) on
    ``example`` (input_ids, attention_mask, padded) and compile it for the CPU on ``threads``."""
    ov = require(NAME)
    rss_before = resident_mib()
    wrapped = HiddenStates(model).eval()
    input_ids, attention_mask = example

    def convert(module: torch.nn.Module) -> Any:
        with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
            # it traces the model: TracerWarnings about shape checks constant for these inputs
            warnings.simplefilter("ignore")
            return ov.convert_model(
                module,
                # both dimensions of both inputs are left dynamic (batch, sequence)
                example_input={"input_ids": input_ids, "attention_mask": attention_mask},
            )

    converted, export_s = timed(functools.partial(convert, wrapped))
    del wrapped  # the float32 copy: OpenVINO holds its own weights
    config: dict[str, Any] = {"INFERENCE_NUM_THREADS": threads}
    if precision in PRECISION_HINTS:
        config["INFERENCE_PRECISION_HINT"] = PRECISION_HINTS[precision]
    compiled, compile_s = timed(lambda: ov.Core().compile_model(converted, "CPU", config))
    computes_in = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()  # bf16, f32
    cost = BuildCost(export_s, compile_s, resident_mib() - rss_before)
    log.info(
        "backend copy made",
        backend=NAME,
        version=ov.__version__,
        inference_precision=computes_in,
        performance_hint=str(compiled.get_property("PERFORMANCE_HINT")),
        threads=threads,
        **cost.log_fields(),
    )
    return OpenVinoForward(compiled, computes_in, cost)
