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
per input channel from the built-in probe texts. The copy is kept only if it matches float32 on
those texts with the bar ``auto`` holds bf16 to (workers/precision.py); the attention output
projection stays in bf16 (the layer whose rounding moved the vectors most, for the least speed).

Like the frozen graph it replaces (workers/frozen.py) the copy has no layer boundaries: bulk
batches through it are sized whole to the query slice.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence

import torch

from embedfleet.shared.logging import get_logger
from embedfleet.workers.frozen import hook_free_copy

log = get_logger("embedfleet.int8")

# SmoothQuant's migration strength and the layers left in bf16, chosen on the benchmark corpus
# with ``python -m loadtest.int8_compute --smooth A --keep P`` (docs/BENCHMARKS.md).
SMOOTHQUANT_ALPHA = 0.6
KEPT_IN_BF16: tuple[str, ...] = ("attention.output.dense",)


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
    kept: Sequence[str] = KEPT_IN_BF16,
) -> int:
    """Replace, in place, the linear layers under ``layers`` (all but those whose name
    contains a ``kept`` pattern) by W8A8 ones smoothed with ``ranges``; returns how many."""
    swapped = 0
    for name, module in list(layers.named_modules()):
        if not isinstance(module, torch.nn.Linear) or any(k in name for k in kept):
            continue
        smoothing = smoothing_factors(module, ranges[name], alpha) if name in ranges else None
        parent, _, attribute = name.rpartition(".")
        setattr(layers.get_submodule(parent), attribute, W8A8Linear(module, smoothing))
        swapped += 1
    return swapped


def cpp_compiler_available() -> bool:
    """Whether inductor can build CPU kernels here: a C++ compiler ($CXX, g++ or clang++) on
    PATH. Checked first, so a host without one (the CPU image) is not made to try."""
    candidates = [os.environ.get("CXX", ""), "g++", "clang++"]
    return any(name and shutil.which(name) for name in candidates)


class Int8Forward:
    """``(input_ids, attention_mask) -> last_hidden_state`` through the compiled int8 copy."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._compiled = torch.compile(model, dynamic=True)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self._compiled(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def build_int8(
    model: torch.nn.Module,
    layers_of: Callable[[torch.nn.Module], torch.nn.Module],
    run: Callable[[torch.nn.Module, Sequence[str]], object],
    calibration_texts: Sequence[str],
) -> Int8Forward:
    """An int8 copy of ``model`` (its own weights; the eager model is untouched), smoothed with
    the input ranges of its transformer layers (``layers_of``) while ``run`` embeds
    ``calibration_texts`` through the copy before it is quantized."""
    int8_model = hook_free_copy(model)
    layers = layers_of(int8_model)
    ranges = input_ranges(layers, lambda texts: run(int8_model, texts), calibration_texts)
    swapped = quantize_layers(layers, ranges)
    log.info("int8 copy made", linear_layers_in_int8=swapped, smoothquant_alpha=SMOOTHQUANT_ALPHA)
    return Int8Forward(int8_model)
