"""int8 compute for the bulk and query graph on a CPU (``EMBEDFLEET_CPU_INT8``).

A copy of the bf16 model whose transformer linear layers compute int8 x int8 (W8A8): weights
quantized once per output channel, inputs per token at each call, the int32 products scaled back
with the bias added in float32. On a CPU with VNNI the int8 matmul runs about twice the bf16 rate
(``python -m loadtest.int8_compute``), and ``torch.compile`` fuses the quantize and dequantize
steps around it, which eager PyTorch would run as separate passes over memory, slower than the
bf16 layer they replace.

Plain per-token int8 loses too much where a few input channels carry most of the range (BERT's
residual stream has such outliers): SmoothQuant moves part of each channel's range into the
weights (``x / s @ (w * s)^T`` is the same product), with ``s = max|x|^alpha / max|w|^(1-alpha)``
per input channel from the built-in probe texts. The output projections (attention output and
the feed-forward output, whose GELU inputs quantize worst) stay in the compute dtype.

**The gate.** The copy is kept only if it holds the bar of every precision (min cosine >= 0.99,
mean >= 0.999 against float32) on the held-out set of workers/model/heldout.py, never on the probe
texts it was calibrated on: calibrated and checked on the same 20 texts the copy with only the
attention output kept passed, and then fell to a mean of 0.9986-0.9987 (min 0.9948) on unseen
multilingual, long and odd inputs. Measured eagerly in float32 on the held-out set
(min / mean): attention output kept 0.99323 / 0.998580 (fails); both output projections kept
0.99871 / 0.999521 (holds); alpha 0.5 / 0.7 did worse than 0.6.

**The dynamic copy** (:func:`build_int8`, ``dynamic=True``): PyTorch's own CPU recipe for
BERT, ``torch.ao.quantization`` dynamic int8 Linear (FBGEMM / oneDNN kernels, AVX2 and up, no
compiler needed), per-channel weights, with the same smoothing divided out of its inputs. Its
inputs are quantized per tensor (one scale for a whole batch), which is what costs it parity:
on the held-out set per-tensor weights read 0.72 / 0.894, per-channel 0.90 / 0.966, smoothed
with the output projections kept 0.99306 / 0.998020 (alpha 0.75): below the bar for
all-MiniLM-L6-v2, so the gate rejects it there; it is tried because it is cheap to build and
another model may hold the bar with it. torch 2.13 deprecates this eager ``torch.ao`` API in
favour of torchao (not a dependency here); its warnings are silenced while the copy is built.

Like the frozen graph it replaces (workers/model/frozen.py) a copy has no layer boundaries: bulk
batches through it are sized whole to the query slice.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from embedfleet.shared.logging import get_logger
from embedfleet.workers.model.frozen import hook_free_copy

log = get_logger("embedfleet.int8")

# an int8 layer made from a float one and its smoothing (None: unsmoothed)
QuantizedLinear = Callable[[torch.nn.Linear, torch.Tensor | None], torch.nn.Module]

# SmoothQuant's migration strength and the layers left in the compute dtype, chosen on the
# held-out set (workers/model/heldout.py; the figures are in the module docstring). "output.dense"
# names both BERT output projections: attention.output.dense and the feed-forward output.
SMOOTHQUANT_ALPHA = 0.6
KEPT_IN_FLOAT: tuple[str, ...] = ("output.dense",)
# The dynamic copy's: its per-tensor inputs did best with more of the range in the weights.
DYNAMIC_SMOOTHQUANT_ALPHA = 0.75


class W8A8Linear(torch.nn.Module):
    """A linear layer computed as int8 x int8; returns the input's dtype.

    ``smoothing`` (per input channel) divides the inputs and multiplies the weights before
    either is quantized, which leaves the product unchanged and the inputs' range flatter.
    """

    # the buffers __init__ registers (Module.__getattr__ alone types them as Tensor | Module)
    smoothing: torch.Tensor | None
    weight_scale: torch.Tensor
    weight_codes: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: torch.nn.Linear, smoothing: torch.Tensor | None = None) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        if smoothing is not None:
            smoothing = smoothing.float()
            weight = weight * smoothing
        self.register_buffer("smoothing", smoothing)
        weight_scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127
        codes = (weight / weight_scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("weight_codes", codes.t().contiguous())  # (in, out) for _int_mm
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        if self.smoothing is not None:
            rows = rows / self.smoothing
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
        codes = (rows / scale).round().clamp(-127, 127).to(torch.int8)
        out = torch._int_mm(codes, self.weight_codes) * (scale * self.weight_scale)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


def input_ranges(
    layers: torch.nn.Module, run: Callable[[Sequence[str]], object], texts: Sequence[str]
) -> dict[str, torch.Tensor]:
    """Each linear layer's largest |input| per channel (names relative to ``layers``) while
    ``run`` embeds ``texts``, a few at a time."""
    ranges: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in layers.named_modules():
        if isinstance(module, torch.nn.Linear):

            def record(_module: torch.nn.Module, args: tuple, name: str = name) -> None:
                seen = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0).float()
                ranges[name] = torch.maximum(ranges[name], seen) if name in ranges else seen

            handles.append(module.register_forward_pre_hook(record))
    try:
        for start in range(0, len(texts), 4):
            run(texts[start : start + 4])
    finally:
        for handle in handles:
            handle.remove()
    return ranges


def smoothing_factors(
    linear: torch.nn.Linear, input_range: torch.Tensor, alpha: float
) -> torch.Tensor:
    """SmoothQuant's per-input-channel factor: ``max|x|^alpha / max|w|^(1 - alpha)``."""
    weight_range = linear.weight.detach().float().abs().amax(dim=0).clamp_min(1e-5)
    return input_range.clamp_min(1e-5) ** alpha / weight_range ** (1 - alpha)


def quantize_layers(
    layers: torch.nn.Module,
    ranges: dict[str, torch.Tensor],
    alpha: float = SMOOTHQUANT_ALPHA,
    kept: Sequence[str] = KEPT_IN_FLOAT,
    quantized: QuantizedLinear = W8A8Linear,
) -> int:
    """Replace, in place, the linear layers under ``layers`` (all but those whose name
    contains a ``kept`` pattern) by int8 ones (``quantized``; W8A8 unless told) smoothed with
    ``ranges``; returns how many."""
    swapped = 0
    for name, module in list(layers.named_modules()):
        if not isinstance(module, torch.nn.Linear) or any(k in name for k in kept):
            continue
        smoothing = smoothing_factors(module, ranges[name], alpha) if name in ranges else None
        parent, _, attribute = name.rpartition(".")
        setattr(layers.get_submodule(parent), attribute, quantized(module, smoothing))
        swapped += 1
    return swapped


def cpp_compiler_available() -> bool:
    """Whether inductor can build CPU kernels here: a C++ compiler ($CXX, g++ or clang++) on
    PATH. Checked first, so a host without one (the CPU image) is not made to try."""
    candidates = [os.environ.get("CXX", ""), "g++", "clang++"]
    return any(name and shutil.which(name) for name in candidates)


class Int8Forward:
    """``(input_ids, attention_mask) -> last_hidden_state`` through an int8 copy; ``name`` is
    the path's (``int8-w8a8``, ``int8-dynamic``), as logged and served."""

    name = "int8"

    def __init__(self, model: Callable[..., Any]) -> None:
        self._model = model  # the copy, or its compiled wrapper

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self._model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class W8A8Forward(Int8Forward):
    """The compiled W8A8 copy (``torch.compile`` fuses the quantize and dequantize steps)."""

    name = "int8-w8a8"

    def __init__(self, model: torch.nn.Module, compiled: bool = True) -> None:
        super().__init__(torch.compile(model, dynamic=True) if compiled else model)


class DynamicInt8Forward(Int8Forward):
    """The eager copy with PyTorch's dynamic int8 Linear layers."""

    name = "int8-dynamic"


def calibrated_copy(
    copy: torch.nn.Module,
    layers_of: Callable[[torch.nn.Module], torch.nn.Module],
    run: Callable[[torch.nn.Module, Sequence[str]], object],
    calibration_texts: Sequence[str],
) -> tuple[torch.nn.Module, torch.nn.Module, dict[str, torch.Tensor]]:
    """``copy`` (the model's own copy, to be quantized), its transformer layers
    (``layers_of``) and their linear layers' input ranges while ``run`` embeds
    ``calibration_texts`` through it: what both int8 paths smooth with."""
    layers = layers_of(copy)
    ranges = input_ranges(layers, lambda texts: run(copy, texts), calibration_texts)
    return copy, layers, ranges


class SmoothedDynamicLinear(torch.nn.Module):
    """PyTorch's dynamic int8 Linear (per-channel weights ``w * s``) on inputs ``x / s``."""

    smoothing: torch.Tensor

    def __init__(self, linear: torch.nn.Linear, smoothing: torch.Tensor | None) -> None:
        super().__init__()
        if smoothing is None:  # a layer calibration never reached: unsmoothed, as W8A8Linear
            smoothing = torch.ones(linear.in_features)
        scaled = torch.nn.Linear(linear.in_features, linear.out_features, linear.bias is not None)
        with torch.no_grad():
            scaled.weight.copy_(linear.weight.float() * smoothing)
            if linear.bias is not None:
                scaled.bias.copy_(linear.bias.float())
        # torch 2.13 deprecates torch.ao's eager quantization (for torchao) and warns at import
        # and at each quantized weight: known, and said once in the module docstring instead
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
            from torch.ao.quantization import per_channel_dynamic_qconfig

            scaled.qconfig = per_channel_dynamic_qconfig  # type: ignore[assignment]
            self.quantized = DynamicLinear.from_float(scaled)
        self.register_buffer("smoothing", smoothing.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantized(x.float() / self.smoothing).to(x.dtype)


def build_int8(
    model: torch.nn.Module,
    layers_of: Callable[[torch.nn.Module], torch.nn.Module],
    run: Callable[[torch.nn.Module, Sequence[str]], object],
    calibration_texts: Sequence[str],
    *,
    dynamic: bool = False,
    kept: Sequence[str] = KEPT_IN_FLOAT,
    compiled: bool = True,
) -> Int8Forward:
    """An int8 copy of ``model`` (its own weights; the eager model is untouched) whose
    transformer linear layers (``layers_of``; all but ``kept``) compute in int8, smoothed with
    the input ranges they see while ``run`` embeds ``calibration_texts`` through the copy
    before it is quantized.

    The W8A8 copy, compiled (``compiled=False``: eager, slow; for parity checks without a
    compile); ``dynamic``: PyTorch's dynamic int8 Linear layers in a float32 copy (``run``
    computes in float32 around it), the two copies' one difference in how they are built."""
    copy = hook_free_copy(model)
    int8_model, layers, ranges = calibrated_copy(
        copy.float() if dynamic else copy, layers_of, run, calibration_texts
    )
    alpha = DYNAMIC_SMOOTHQUANT_ALPHA if dynamic else SMOOTHQUANT_ALPHA
    quantized: QuantizedLinear = SmoothedDynamicLinear if dynamic else W8A8Linear
    swapped = quantize_layers(layers, ranges, alpha=alpha, kept=kept, quantized=quantized)
    forward = (
        DynamicInt8Forward(int8_model) if dynamic else W8A8Forward(int8_model, compiled=compiled)
    )
    # the dynamic layers' kernels are the quantized engine's (FBGEMM or oneDNN)
    engine = {"quantized_engine": torch.backends.quantized.engine} if dynamic else {}
    log.info(
        "int8 copy made",
        path=forward.name,
        linear_layers_in_int8=swapped,
        kept_in_float=",".join(kept),
        smoothquant_alpha=alpha,
        **engine,
    )
    return forward
