"""workers/model/int8.py's parts on small layers: the input ranges the calibration records,
SmoothQuant's factors, and the swap of linear layers for int8 ones, which keeps each layer's
output (the model's copy as a whole: tests/integration/workers/test_int8.py)."""

from __future__ import annotations

import torch

from embedfleet.workers.model.int8 import (
    SmoothedDynamicLinear,
    W8A8Linear,
    input_ranges,
    quantize_layers,
    smoothing_factors,
)


def small_layers() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16, bias=False)
    )


def test_the_ranges_are_each_input_channels_largest_magnitude_over_every_call() -> None:
    layers = torch.nn.Sequential(torch.nn.Linear(2, 2))
    inputs = {"a": torch.tensor([[1.0, -3.0]]), "b": torch.tensor([[-2.0, 0.5]])}
    with torch.no_grad():
        ranges = input_ranges(layers, lambda texts: [layers(inputs[t]) for t in texts], ["a", "b"])
    assert list(ranges) == ["0"]
    torch.testing.assert_close(ranges["0"], torch.tensor([2.0, 3.0]))
    assert not layers[0]._forward_pre_hooks, "the hooks are removed after"


def test_smoothing_balances_the_input_range_against_the_weights() -> None:
    linear = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.tensor([[4.0, 1.0]]))
    factors = smoothing_factors(linear, torch.tensor([16.0, 1.0]), alpha=0.5)
    torch.testing.assert_close(factors, torch.tensor([16**0.5 / 4**0.5, 1.0]))


def test_int8_layers_keep_each_layers_output() -> None:
    layers = small_layers()
    x = torch.randn(20, 64)
    with torch.no_grad():
        expected = layers(x)
        ranges = input_ranges(layers, lambda _: layers(x), ["all"])
        assert quantize_layers(layers, ranges, kept=("2",)) == 1, "the kept layer stays float"
        assert isinstance(layers[0], W8A8Linear) and isinstance(layers[2], torch.nn.Linear)
        cosine = torch.nn.functional.cosine_similarity(layers(x), expected)
    assert float(cosine.min()) > 0.999


def test_the_dynamic_int8_layer_keeps_the_output_smoothed_or_not() -> None:
    linear = small_layers()[0]
    x = torch.randn(20, 64)
    with torch.no_grad():
        expected = linear(x)
        smoothing = smoothing_factors(linear, x.abs().amax(dim=0), alpha=0.75)
        for layer in (
            SmoothedDynamicLinear(linear, smoothing),
            SmoothedDynamicLinear(linear, None),
        ):
            cosine = torch.nn.functional.cosine_similarity(layer(x), expected)
            assert float(cosine.min()) > 0.999
