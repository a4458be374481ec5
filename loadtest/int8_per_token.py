"""Per-token int8 through FBGEMM's dynamic kernel, against the worker's dynamic copy and float32.

    python -m loadtest.int8_per_token

The worker's dynamic int8 copy (workers/model/int8.py) quantizes each linear layer's whole input
with one scale, which costs it parity. Dividing each token's row by its own max first (the one scale
then suits every row) and multiplying the output rows back gives per-token input codes through the
same kernel. This prints, per scheme, the held-out gate's verdict (min / mean cosine against
float32, workers/model/heldout.py) and the speed-up over the float32 frozen graph on the worker's
64-text bulk probe (best of 3, interleaved). Figures: docs/BENCHMARKS.md (stop 36). An experiment,
not a worker path: no scheme here was adopted.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Sequence

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from embedfleet.workers.model import int8
from embedfleet.workers.model.choose import best_of_interleaved
from embedfleet.workers.model.encoder import Encoder
from embedfleet.workers.model.forward import layer_stack
from embedfleet.workers.model.precision import BULK_PROBE_TEXTS, PROBE_TEXTS


class PerTokenDynamicLinear(torch.nn.Module):
    """FBGEMM's dynamic int8 linear on rows scaled to a max of 1 (per-token codes), the rows'
    scales multiplied back with the bias added after."""

    def __init__(self, linear: torch.nn.Linear, smoothing: torch.Tensor, reduce_range: bool):
        super().__init__()
        scaled = torch.nn.Linear(linear.in_features, linear.out_features, bias=False)
        with torch.no_grad():
            scaled.weight.copy_(linear.weight.float() * smoothing)
        with warnings.catch_warnings():  # torch.ao's deprecation (workers/model/int8.py)
            warnings.simplefilter("ignore")
            from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
            from torch.ao.quantization import per_channel_dynamic_qconfig

            scaled.qconfig = per_channel_dynamic_qconfig  # type: ignore[assignment]
            self.packed = DynamicLinear.from_float(scaled)._packed_params._packed_params
        self.register_buffer("inverse_smoothing", 1 / smoothing.float())
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.register_buffer("bias", bias)
        self.reduce_range = reduce_range

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.float() * self.inverse_smoothing
        scale = rows.abs().amax(-1, keepdim=True).clamp_min(1e-12)
        out = torch.ops.quantized.linear_dynamic(rows / scale, self.packed, self.reduce_range)
        return out * scale if self.bias is None else torch.addcmul(self.bias, out, scale)


def build(encoder: Encoder, kept: Sequence[str], alpha: float, scheme: str):
    """A float32 copy with the linear layers (all but ``kept``) swapped for ``scheme``'s."""
    copy, layers, ranges = int8.calibrated_copy(
        int8.hook_free_copy(encoder._model).float(),
        layer_stack,
        encoder.paths.run_copy,
        PROBE_TEXTS,
    )
    swapped = 0
    for name, module in list(layers.named_modules()):
        if not isinstance(module, torch.nn.Linear) or any(k in name for k in kept):
            continue
        smoothing = int8.smoothing_factors(module, ranges[name], alpha)
        parent, _, attribute = name.rpartition(".")
        replacement: torch.nn.Module = (
            int8.SmoothedDynamicLinear(module, smoothing)
            if scheme == "per-tensor"
            else PerTokenDynamicLinear(module, smoothing, reduce_range=scheme == "per-token 7-bit")
        )
        setattr(layers.get_submodule(parent), attribute, replacement)
        swapped += 1
    return int8.DynamicInt8Forward(copy), swapped


SCHEMES = (
    ("per-tensor", 0.75, ("output.dense",)),
    ("per-token 7-bit", 0.6, ("output.dense",)),
    ("per-token 8-bit", 0.6, ("output.dense",)),
    ("per-token 8-bit", 0.6, ("attention.output.dense",)),
    ("per-token 8-bit", 0.6, ()),
)


def main() -> None:
    encoder = Encoder(dtype="auto")
    encoder.prepare_query_graph("off")
    reference = encoder.paths.float32_heldout()
    assert reference is not None, "auto kept a reduced precision here: nothing to gate against"
    batch = encoder.collate(encoder.tokenize(list(BULK_PROBE_TEXTS)))
    baseline = encoder.query_path
    assert encoder.has_query_graph
    runs = {"float32 frozen": lambda: baseline.serve(batch)}
    verdicts = {}
    for scheme, alpha, kept in SCHEMES:
        forward, swapped = build(encoder, kept, alpha, scheme)
        report = encoder.paths.gate(forward, reference)
        label = f"{scheme}, alpha {alpha}, kept {','.join(kept) or 'nothing'} ({swapped} int8)"
        verdicts[label] = report
        runs[label] = functools.partial(encoder.paths.through(forward).embed, batch)
    seconds = best_of_interleaved(runs, 3)
    print("| scheme | min | mean | bar | batch ms | speed-up |\n|---|---:|---:|---|---:|---:|")
    for label, took in seconds.items():
        report = verdicts.get(label)
        gate = (
            f"{report.min_cosine:.5f} | {report.mean_cosine:.6f} | "
            f"{'holds' if report.passed else 'fails'}"
            if report
            else "1 | 1 | -"
        )
        print(f"| {label} | {gate} | {took * 1000:.0f} | {seconds['float32 frozen'] / took:.2f} |")


if __name__ == "__main__":
    main()
