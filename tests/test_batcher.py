"""Sorting and token-budget batching (pure logic)."""

from __future__ import annotations

import random

import pytest

from workers.batcher import padding_waste, plan_batches


@pytest.mark.parametrize("seed", range(5))
def test_every_position_once_and_budget_respected(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(3, 256) for _ in range(700)]
    batches = plan_batches(lengths, token_budget=4096, max_batch=64)
    positions = [p for batch in batches for p in batch.positions]
    assert sorted(positions) == list(range(700))
    for batch in batches:
        assert len(batch.positions) <= 64
        assert batch.padded_tokens <= 4096
        assert batch.longest == max(lengths[p] for p in batch.positions)
        assert batch.real_tokens == sum(lengths[p] for p in batch.positions)


def test_sorting_cuts_padding_against_arrival_order() -> None:
    rng = random.Random(1)
    lengths = [min(256, int(rng.lognormvariate(3.8, 0.6)) + 3) for _ in range(1000)]
    planned = plan_batches(lengths, token_budget=1 << 30, max_batch=32)
    arrival_padded = sum(
        max(lengths[i : i + 32]) * len(lengths[i : i + 32]) for i in range(0, 1000, 32)
    )
    arrival_waste = 1 - sum(lengths) / arrival_padded
    assert padding_waste(planned) < 0.10 and padding_waste(planned) < arrival_waste / 3


def test_text_longer_than_budget_gets_its_own_batch() -> None:
    batches = plan_batches([500, 10, 10], token_budget=100, max_batch=8)
    assert [b.positions for b in batches] == [[0], [2, 1]]


def test_rejects_nonsense_limits() -> None:
    with pytest.raises(ValueError):
        plan_batches([1], token_budget=0, max_batch=1)
