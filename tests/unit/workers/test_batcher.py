"""Sorting and token-budget batching (pure logic)."""

from __future__ import annotations

import random
import types

import numpy as np
import pytest

from embedfleet.shared.settings import Settings
from embedfleet.workers.batcher import padding_waste, plan_batches
from embedfleet.workers.cost_model import (
    SLICE_HEADROOM,
    TRUSTED_AFTER,
    Coefficients,
    Shape,
    SliceCost,
    SliceLimit,
)
from embedfleet.workers.worker import Worker
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
    """What Slices._slice_limit reads from the encoder: pure logic, no model."""

    layer_count = 6
    device = types.SimpleNamespace(type="cpu")
    name = "slicing"
    pooling = types.SimpleNamespace(normalize=True)
    has_query_graph = False  # eager: sliced per layer
    computes_in_reduced_precision = True
    computes_in_int8 = False
    engine: str | None = None  # torch computes (no ONNX Runtime or OpenVINO copy)
    serves_queries_concurrently = False  # queries served at layer boundaries (CPU)


# one slice: 0.1 ms per token (an eager layer, or a whole frozen batch), nothing else
_PER_TOKEN = Coefficients(0.0, 0.1e-3, 0.0)


def _worker(slice_ms: float, measured: bool = True) -> Worker:
    settings = Settings(slice_ms=slice_ms, token_budget=4096)
    worker = Worker(settings, _SlicingEncoder(), client=None, sink=None)  # type: ignore[arg-type]
    if measured:
        for path in ("eager", "frozen", "int8"):
            shapes = [Shape.padded(n, w) for n, w in ((64, 24), (8, 24), (4, 256))]
            cost = worker.slices._slice_cost(path)
            cost.seed([(s, _PER_TOKEN.seconds(s)) for s in shapes])
            for shape in shapes * 3:  # its own batches measured: the fit alone sizes them
                cost.observe(shape, _PER_TOKEN.seconds(shape))
    return worker


def test_each_forward_path_has_its_own_cost_model() -> None:
    """The frozen copy (no layer boundaries: the slice is the whole batch), the int8 copy,
    another engine's copy (by its name) and the eager model (the slice is one layer) are timed
    and sized apart."""
    worker = _worker(100)
    assert worker.slices.bulk_path() == "eager" and not worker.slices.bulk_frozen()
    worker.encoder.has_query_graph = True  # type: ignore[misc]
    assert worker.slices.bulk_frozen() and worker.slices.bulk_path() == "frozen"
    worker.encoder.engine = "openvino"  # type: ignore[misc]
    assert worker.slices.bulk_frozen() and worker.slices.bulk_path() == "openvino"
    worker.encoder.engine = None  # type: ignore[misc]
    worker.encoder.computes_in_int8 = True  # type: ignore[misc]
    assert worker.slices.bulk_path() == "int8"
    slow = SliceCost("int8")  # int8 here: much slower
    slow.seed([(Shape.padded(64, 24), 0.5)])
    for _ in range(TRUSTED_AFTER):
        slow.observe(Shape.padded(64, 24), 0.5)
    worker.slices.slice_costs["int8"] = slow
    int8_limit = worker.slices._slice_limit()
    worker.encoder.computes_in_int8 = False  # type: ignore[misc]
    frozen_limit = worker.slices._slice_limit()
    assert int8_limit is not None and frozen_limit is not None
    assert int8_limit.max_texts(np.array([24]))[0] < frozen_limit.max_texts(np.array([24]))[0]
    off = _worker(100)
    off.parts.settings = off.parts.settings.model_copy(update={"frozen_bulk": False})
    off.encoder.has_query_graph = True  # type: ignore[misc]
    assert not off.slices.bulk_frozen() and off.slices.bulk_path() == "eager"


def test_batches_leave_headroom_under_the_slice_target() -> None:
    # 0.1 ms per token per slice: a 100 ms slice holds 1,000 tokens; batches are sized for
    # SLICE_HEADROOM of that (until the spread of slices is measured), so a slower-than-average
    # slice still fits.
    assert 0 < SLICE_HEADROOM < 1
    limit = _worker(100).slices._slice_limit()
    assert limit is not None and limit.seconds == pytest.approx(SLICE_HEADROOM * 0.100)
    batches = plan_batches([50] * 200, 4096, 128, max_texts=limit.max_texts)
    for batch in batches:
        assert batch.padded_tokens * 0.1e-3 <= 0.100 * SLICE_HEADROOM + 1e-9
    fullest = max(len(batch.positions) for batch in batches)
    assert (fullest + 1) * 50 * 0.1e-3 > 0.100 * SLICE_HEADROOM  # as full as it may be


def test_no_limit_unmeasured_or_unsliced() -> None:
    assert _worker(100, measured=False).slices._slice_limit() is None  # nothing measured yet
    assert _worker(0).slices._slice_limit() is None  # slicing off


def test_queries_served_concurrently_leave_bulk_batches_the_full_budget() -> None:
    """On the CUDA query path queries never wait on a bulk layer: no slice target, whatever
    EMBEDFLEET_SLICE_MS says, and batches use the whole token budget."""
    for slice_ms in (-1, 20, 100):
        worker = _worker(slice_ms)
        worker.encoder.device = types.SimpleNamespace(type="cuda")  # type: ignore[misc]
        assert worker.slices._slice_limit() is not None  # queries at layer boundaries: sliced
        worker.encoder.serves_queries_concurrently = True  # type: ignore[misc]
        assert worker.slices.slice_seconds == 0 and worker.slices._slice_limit() is None


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


def _masked_plan_with_cap(lengths: list[int], budget: int, max_batch: int, cap) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """The masked programme with the slice limit's cap, as the worker planned before issue 29:
    the reference the sliced one must match with a cap too."""
    order = sorted(range(len(lengths)), key=lambda p: lengths[p], reverse=True)
    ordered = np.array([lengths[p] for p in order], dtype=np.int64)
    count = len(ordered)
    caps = cap(ordered)
    best = np.full(count + 1, np.inf)
    best[0] = 0.0
    start = np.zeros(count + 1, dtype=np.int64)
    for end in range(1, count + 1):
        first = max(0, end - max_batch)
        sizes = end - np.arange(first, end)
        widths = ordered[first:end]
        cost = best[first:end] + sizes * widths + 128
        over = (sizes * widths > budget) | (sizes > caps[first:end])
        cost[over & (sizes > 1)] = np.inf
        pick = int(np.argmin(cost))
        best[end] = cost[pick]
        start[end] = first + pick
    plan = []
    end = count
    while end > 0:
        begin = int(start[end])
        plan.append([order[k] for k in range(end - 1, begin - 1, -1)])
        end = begin
    return plan[::-1]


@pytest.mark.parametrize("seed", range(8))
def test_the_slice_limit_cuts_as_the_masked_programme_with_its_cap(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [min(256, int(rng.lognormvariate(3.8, 0.7)) + 3) for _ in range(rng.choice([5, 300]))]
    limit = SliceLimit(Coefficients(1e-3, 20e-6, 0.1e-6), rng.choice([0.005, 0.02, 0.06]))
    planned = plan_batches(lengths, 4096, 128, max_texts=limit.max_texts)
    assert [b.positions for b in planned] == _masked_plan_with_cap(
        lengths, 4096, 128, limit.max_texts
    )
