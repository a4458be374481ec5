"""Sorting and token-budget batching (pure logic)."""

from __future__ import annotations

import random
import types

import pytest

from embedfleet.shared.settings import Settings
from embedfleet.workers.batcher import padding_waste, plan_batches
from embedfleet.workers.worker import MIN_SLICED_TOKENS, SLICE_HEADROOM, Worker
from loadtest.host_pipeline import masked_window_plan


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


class _SlicingEncoder:
    """What Worker._token_cap reads from the encoder: pure logic, no model."""

    layer_count = 6
    device = types.SimpleNamespace(type="cpu")
    name = "slicing"
    pooling = types.SimpleNamespace(normalize=True)
    has_query_graph = False  # eager: sliced per layer
    computes_in_reduced_precision = True
    serves_queries_concurrently = False  # queries served at layer boundaries (CPU)


def test_frozen_bulk_sizes_whole_batches_to_the_slice() -> None:
    """Through the frozen copy (no layer boundaries) a query waits for the whole batch: the
    cap fits a whole batch, not one layer, in the slice target."""
    worker = _worker_with_speed(100, seconds_per_token=0.6e-3)
    worker.encoder.has_query_graph = True  # type: ignore[misc]
    assert worker._bulk_frozen()
    assert worker._token_cap() == max(MIN_SLICED_TOKENS, int(SLICE_HEADROOM * 0.100 / 0.6e-3))
    eager = _worker_with_speed(100, seconds_per_token=0.6e-3)
    assert not eager._bulk_frozen() and eager._token_cap() == int(SLICE_HEADROOM * 1000)
    off = _worker_with_speed(100, seconds_per_token=0.6e-3)
    off.settings = off.settings.model_copy(update={"frozen_bulk": False})
    off.encoder.has_query_graph = True  # type: ignore[misc]
    assert not off._bulk_frozen()


def _worker_with_speed(slice_ms: float, seconds_per_token: float | None) -> Worker:
    settings = Settings(slice_ms=slice_ms, token_budget=4096)
    worker = Worker(settings, _SlicingEncoder(), client=None, sink=None)  # type: ignore[arg-type]
    worker._seconds_per_token = seconds_per_token
    return worker


def test_batches_leave_headroom_under_the_slice_target() -> None:
    # 6 layers at 0.1 ms per token each: a 100 ms slice holds 1,000 tokens per layer; batches
    # are sized for SLICE_HEADROOM of that, so a slower-than-average layer still fits.
    assert 0 < SLICE_HEADROOM < 1
    worker = _worker_with_speed(100, seconds_per_token=0.6e-3)
    assert worker._token_cap() == int(SLICE_HEADROOM * 1000)
    assert worker._token_cap() * 0.1e-3 <= 0.100 * SLICE_HEADROOM + 1e-9


def test_token_cap_bounds() -> None:
    assert _worker_with_speed(100, None)._token_cap() == 4096  # nothing measured yet
    assert _worker_with_speed(0, 0.6e-3)._token_cap() == 4096  # slicing off
    assert _worker_with_speed(100, 60e-3)._token_cap() == MIN_SLICED_TOKENS  # very slow model
    assert _worker_with_speed(100, 1e-6)._token_cap() == 4096  # very fast model


def test_queries_served_concurrently_leave_bulk_batches_the_full_budget() -> None:
    """On the CUDA query lane queries never wait on a bulk layer: no slice target, whatever
    EMBEDFLEET_SLICE_MS says, and batches use the whole token budget."""
    for slice_ms in (-1, 20, 100):
        worker = _worker_with_speed(slice_ms, seconds_per_token=0.6e-3)
        worker.encoder.device = types.SimpleNamespace(type="cuda")  # type: ignore[misc]
        assert worker._token_cap() < 4096  # queries at layer boundaries: sliced
        worker.encoder.serves_queries_concurrently = True  # type: ignore[misc]
        assert worker.slice_seconds == 0 and worker._token_cap() == 4096


@pytest.mark.parametrize("seed", range(12))
def test_the_plan_is_the_masked_window_programme_s_tie_for_tie(seed: int) -> None:
    """The sliced programme (issue 29) cuts exactly where the masked one did, ties included:
    skewed and flat lengths, budgets that bind and budgets that do not, texts over the budget.
    The masked one is kept as the benchmark's "before" path (loadtest/host_pipeline.py)."""
    rng = random.Random(seed)
    count = rng.choice([1, 2, 17, 300, 1024])
    if seed % 3 == 0:
        lengths = [rng.choice([8, 8, 16, 64]) for _ in range(count)]  # many ties
    else:
        lengths = [min(512, int(rng.lognormvariate(3.8, 0.7)) + 3) for _ in range(count)]
    budget = rng.choice([64, 300, 4096, 131072])
    max_batch = rng.choice([1, 8, 128, 1024])
    planned = [batch.positions for batch in plan_batches(lengths, budget, max_batch)]
    reference = masked_window_plan(lengths, budget, max_batch)
    assert planned == [batch.positions for batch in reference]
