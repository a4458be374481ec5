"""workers/model/sparse.py: SpladePooling's weights, log(1 + relu(logits)) of the real tokens,
max- or sum-pooled, twice log1p for log1p_relu, padding never counted."""

from __future__ import annotations

import math

import pytest
import torch

from embedfleet.workers.model.sparse import splade_pool

# one text, three positions (the last is padding), a vocabulary of three
LOGITS = torch.tensor([[[1.0, -2.0, 0.5], [3.0, 0.0, -1.0], [50.0, 50.0, 50.0]]])
MASK = torch.tensor([[1, 1, 0]])


@pytest.mark.parametrize(
    ("strategy", "activation", "expected"),
    [
        ("max", "relu", [math.log1p(3.0), 0.0, math.log1p(0.5)]),
        ("sum", "relu", [math.log1p(1.0) + math.log1p(3.0), 0.0, math.log1p(0.5)]),
        ("max", "log1p_relu", [math.log1p(math.log1p(3.0)), 0.0, math.log1p(math.log1p(0.5))]),
    ],
)
def test_splade_weights_of_the_real_tokens(
    strategy: str, activation: str, expected: list[float]
) -> None:
    weights = splade_pool(LOGITS.clone(), MASK, strategy, activation)
    torch.testing.assert_close(weights, torch.tensor([expected]))


def test_every_weight_is_non_negative_and_negatives_are_zero() -> None:
    weights = splade_pool(-torch.ones(2, 4, 5), torch.ones(2, 4, dtype=torch.int64), "max", "relu")
    assert weights.shape == (2, 5)
    assert torch.count_nonzero(weights) == 0
