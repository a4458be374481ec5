"""workers/model/dense.py's pooling, against each mode computed by hand on a small batch, on
either padding side and with the prompt left out; the dense representation's heads."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from embedfleet.workers.model.dense import Dense, PoolingConfig, pool
from embedfleet.workers.model.model_dir import ModelSpec

# two texts, four positions, width 2: row 0 has three real tokens (right padding), row 1 two
HIDDEN = torch.tensor(
    [
        [[1.0, 0.0], [2.0, 4.0], [3.0, -1.0], [99.0, 99.0]],
        [[5.0, 1.0], [7.0, 3.0], [99.0, 99.0], [99.0, 99.0]],
    ]
)
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("mean", [[2.0, 1.0], [6.0, 2.0]]),
        ("max", [[3.0, 4.0], [7.0, 3.0]]),
        ("cls", [[1.0, 0.0], [5.0, 1.0]]),
        ("lasttoken", [[3.0, -1.0], [7.0, 3.0]]),
        (
            "mean_sqrt_len_tokens",
            [[6 / math.sqrt(3), 3 / math.sqrt(3)], [12 / math.sqrt(2), 4 / math.sqrt(2)]],
        ),
        # weights 1, 2, 3 from the first real token
        ("weightedmean", [[(1 + 4 + 9) / 6, (0 + 8 - 3) / 6], [(5 + 14) / 3, (1 + 6) / 3]]),
    ],
)
def test_each_mode_pools_the_real_tokens_alone(mode: str, expected: list[list[float]]) -> None:
    torch.testing.assert_close(pool(HIDDEN, MASK, mode), torch.tensor(expected))


@pytest.mark.parametrize("mode", ["mean", "max", "cls", "lasttoken", "weightedmean"])
def test_left_padding_pools_as_right_padding(mode: str) -> None:
    # row 1 moved to the right end, its padding first
    left = HIDDEN.clone()
    left[1] = torch.tensor([[99.0, 99.0], [99.0, 99.0], [5.0, 1.0], [7.0, 3.0]])
    left_mask = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1]])
    torch.testing.assert_close(pool(left, left_mask, mode), pool(HIDDEN, MASK, mode))


def test_modes_are_concatenated_in_the_order_given() -> None:
    both = pool(HIDDEN, MASK, ("cls", "mean"))
    assert both.shape == (2, 4)
    torch.testing.assert_close(
        both, torch.cat([pool(HIDDEN, MASK, "cls"), pool(HIDDEN, MASK, "mean")], 1)
    )


def test_a_prompt_left_out_leaves_its_tokens_out_of_the_pool() -> None:
    pooled = pool(HIDDEN, MASK, ("mean", "cls"), prompt_lengths=torch.tensor([1, 1]))
    torch.testing.assert_close(pooled, torch.tensor([[2.5, 1.5, 2.0, 4.0], [7.0, 3.0, 7.0, 3.0]]))


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown pooling mode 'median'"):
        pool(HIDDEN, MASK, "median")


def test_the_dense_representation_pools_then_normalizes() -> None:
    spec = ModelSpec(transformer_dir=Path("."), pooling_modes=("max",), normalize=True)
    dense = Dense(spec, torch.device("cpu"), hidden_size=2)
    assert dense.dim == 2 and dense.pooling == PoolingConfig(("max",), True, True)
    assert dense.pooling.mode == "max"
    vectors = dense.pooled(HIDDEN, MASK)
    torch.testing.assert_close(
        vectors, torch.nn.functional.normalize(torch.tensor([[3.0, 4.0], [7.0, 3.0]]))
    )
    assert dense.heads_for([["dense"], ["dense"]]) is None, "the pooled vectors alone"
    assert dense.heads_for([["dense"], ["token_states"]]) == ("dense", "token_states")
