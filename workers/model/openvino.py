"""The OpenVINO copy of the model (``EMBEDFLEET_CPU_BACKEND=openvino``, the ``openvino`` extra).

``openvino.convert_model`` takes the float32 transformer (workers/model/backends.py's
:class:`~embedfleet.workers.model.backends.HiddenStates`) with an example batch and leaves the
batch and sequence dimensions dynamic; the CPU plugin compiles it with its default performance
hint. Its default inference precision is bf16 on CPUs with AMX or AVX512-BF16 (f32 elsewhere):
``EMBEDFLEET_OPENVINO_PRECISION`` overrides it. Compiled once at start on the worker's torch
threads (``INFERENCE_NUM_THREADS``), which the two engines take in turn on the model thread,
never at once.

Where the architecture allows it (BERT's family: an ``embeddings`` module, then the layer stack,
each layer taking an additive attention mask) the copy is cut at its layer boundaries: the
embeddings and the mask in one compiled model, each transformer layer in its own. A bulk batch
then stops between layers, where the query stage serves what waits (:meth:`set_layer_callback`,
as the eager model's hooks do), so a slice is one layer, not the whole batch, and the batches
planned to fit the slice target stay large. The cut is checked against the whole model on the
example batch before anything is converted; where it differs (another architecture: rotary
positions, a final norm) the whole model is converted as one, without boundaries.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from embedfleet.shared.logging import get_logger
from embedfleet.workers.model.backends import BuildCost, HiddenStates, require, resident_mib, timed

log = get_logger("embedfleet.openvino")

NAME = "openvino"
# EMBEDFLEET_OPENVINO_PRECISION -> INFERENCE_PRECISION_HINT ("default": the plugin's own)
PRECISION_HINTS = {"bf16": "bf16", "f32": "f32"}
# how far the cut model's hidden states may stand from the whole model's, in float32 on the
# example batch (the same arithmetic in another order: ~1e-6 measured on MiniLM)
CUT_TOLERANCE = 1e-4


class Embeddings(torch.nn.Module):
    """The model up to its first layer: token embeddings, and the attention mask as the additive
    bias (0 where a token is real, float32's lowest where it is padding) every layer takes."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        embeddings = model.embeddings
        # (a Module attribute is typed Tensor | Module; cut_at_layers checked it is there)
        assert isinstance(embeddings, torch.nn.Module)
        self.embeddings = embeddings

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.embeddings(input_ids=input_ids)
        padding = 1.0 - attention_mask[:, None, None, :].to(hidden.dtype)
        return hidden, padding * torch.finfo(hidden.dtype).min


class Layer(torch.nn.Module):
    """One transformer layer: ``(hidden, mask bias) -> hidden``."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        out = self.layer(hidden, attention_mask=bias)
        return out[0] if isinstance(out, tuple) else out


def cut_at_layers(
    model: torch.nn.Module,
    layers: torch.nn.ModuleList,
    example: tuple[torch.Tensor, torch.Tensor],
) -> tuple[Embeddings, list[Layer]] | None:
    """``model`` (a float32 copy) as its embeddings and its layers, where running them in turn
    gives the whole model's hidden states on ``example``; None where it does not (or cannot)."""
    if not hasattr(model, "embeddings") or not len(layers):
        return None
    input_ids, attention_mask = example
    try:
        front, stages = Embeddings(model), [Layer(layer) for layer in layers]
        with torch.no_grad():
            whole = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            hidden, bias = front(input_ids, attention_mask)
            for stage in stages:
                hidden = stage(hidden, bias)
    except Exception as error:  # a layer that wants other arguments (rotary positions, ...)
        log.info("openvino copy not cut at its layers", error=repr(error)[:200])
        return None
    real = attention_mask.bool()  # padded positions' hidden states are never pooled
    if not torch.allclose(hidden[real], whole[real], atol=CUT_TOLERANCE, rtol=0):
        log.info("openvino copy not cut at its layers: the cut differs from the whole model")
        return None
    return front, stages


class OpenVinoForward:
    """``(input_ids, attention_mask) -> last_hidden_state`` through the compiled OpenVINO model
    (float32 out, whatever it computes in): one compiled model, or the embeddings and one per
    layer, with the layer callback called before each layer."""

    name = NAME

    def __init__(self, compiled: Any, layers: list[Any], precision: str, cost: BuildCost) -> None:
        # the whole model, or (with ``layers``) the embeddings and mask bias
        self._compiled = compiled
        self._layers = layers
        # what the CPU plugin computes in (bf16 / f32), as it reports after compiling
        self.precision = precision
        self.cost = cost
        self._callback: Callable[[], None] | None = None

    @property
    def layer_boundaries(self) -> int:
        """Where a query can get into a batch: before each compiled layer (0: uncut)."""
        return len(self._layers)

    def set_layer_callback(self, callback: Callable[[], None] | None) -> int:
        """Call ``callback`` before every layer of the cut copy (the query stage's boundary, as
        ``EagerPath.set_layer_callback``); the number of boundaries (0 where uncut)."""
        self._callback = callback if self._layers else None
        return self.layer_boundaries

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # each compiled model's own infer request (the model thread is its only caller: a
        # query served at a boundary runs to its end before the batch goes on); outputs come
        # back copied (share_outputs=False), so the next call cannot overwrite them
        inputs = {"input_ids": input_ids.numpy(), "attention_mask": attention_mask.numpy()}
        out = self._compiled(inputs, share_inputs=True)
        hidden = out[0]
        if self._layers:
            bias = out[1]
            for layer in self._layers:
                if self._callback is not None:
                    self._callback()
                hidden = layer({"hidden": hidden, "bias": bias}, share_inputs=True)[0]
        return torch.from_numpy(np.asarray(hidden, dtype=np.float32))


def build_openvino(
    model: torch.nn.Module,
    example: tuple[torch.Tensor, torch.Tensor],
    *,
    threads: int,
    precision: str = "default",
    layers: Callable[[torch.nn.Module], torch.nn.ModuleList] | None = None,
) -> OpenVinoForward:
    """Convert ``model`` (the loaded transformer, any dtype: converted from a float32 copy) on
    ``example`` (input_ids, attention_mask, padded) and compile it for the CPU on ``threads``;
    cut at its layer boundaries where ``layers`` (the model's layer stack) allows it."""
    ov = require(NAME)  # with OpenVINO's telemetry hidden first (workers/model/telemetry.py)
    rss_before = resident_mib()
    wrapped = HiddenStates(model).eval()
    cut = None if layers is None else cut_at_layers(wrapped.model, layers(wrapped.model), example)

    def convert(module: torch.nn.Module, example_input: dict[str, torch.Tensor]) -> Any:
        with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
            # it traces the model: TracerWarnings about shape checks constant for these inputs
            warnings.simplefilter("ignore")
            # every dimension of every input is left dynamic (batch, sequence)
            return ov.convert_model(module, example_input=example_input)

    input_ids, attention_mask = example
    first_inputs = {"input_ids": input_ids, "attention_mask": attention_mask}

    def convert_all(wrapped: HiddenStates, cut: tuple[Embeddings, list[Layer]] | None) -> list[Any]:
        if cut is None:
            return [convert(wrapped, first_inputs)]
        front, stages = cut
        with torch.no_grad():
            hidden, bias = front(input_ids, attention_mask)
        return [convert(front, first_inputs)] + [
            convert(stage, {"hidden": hidden, "bias": bias}) for stage in stages
        ]

    converted, export_s = timed(functools.partial(convert_all, wrapped, cut))
    del wrapped, cut  # the float32 copy: OpenVINO holds its own weights
    config: dict[str, Any] = {"INFERENCE_NUM_THREADS": threads}
    if precision in PRECISION_HINTS:
        config["INFERENCE_PRECISION_HINT"] = PRECISION_HINTS[precision]
    core = ov.Core()
    compiled, compile_s = timed(
        lambda: [core.compile_model(part, "CPU", config) for part in converted]
    )
    computes_in = compiled[0].get_property("INFERENCE_PRECISION_HINT").get_type_name()
    cost = BuildCost(export_s, compile_s, resident_mib() - rss_before)
    log.info(
        "backend copy made",
        backend=NAME,
        version=ov.__version__,
        inference_precision=computes_in,
        performance_hint=str(compiled[0].get_property("PERFORMANCE_HINT")),
        threads=threads,
        layer_boundaries=len(compiled) - 1,
        **cost.log_fields(),
    )
    return OpenVinoForward(compiled[0], compiled[1:], computes_in, cost)
