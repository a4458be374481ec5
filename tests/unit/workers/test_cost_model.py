"""The bulk slice's cost model (workers/cost_model.py) and the batch sizes it gives: pure logic,
no model, no Redis. The integration side (a real worker's slices on each forced path) is in
tests/integration/workers/test_slices.py."""

from __future__ import annotations

import random

import numpy as np
import pytest

from embedfleet.workers import cost_model
from embedfleet.workers.batcher import plan_batches, plan_packed_batches
from embedfleet.workers.cost_model import (
    HEADROOM_AFTER,
    MAX_HEADROOM,
    MIN_HEADROOM,
    SLICE_HEADROOM,
    TRUSTED_AFTER,
    UNPROVEN_MIN_TOKENS,
    Coefficients,
    Shape,
    SliceClock,
    SliceCost,
    SliceLimit,
    fit_nonnegative,
)

# A path whose attention matters: 1 ms fixed, 20 us per token, 0.1 us per pair of tokens (a
# 256-token row costs as much in attention as in its linear layers).
TRUE = Coefficients(fixed=1e-3, per_token=20e-6, per_square=0.1e-6)
SHAPES = [Shape.padded(n, w) for n, w in ((64, 24), (8, 24), (4, 256), (32, 64), (16, 128))]


def _seeded(
    coefficients: Coefficients = TRUE, path: str = "frozen", trusted: bool = False
) -> SliceCost:
    """A path's model seeded from three probe shapes; ``trusted``: and TRUSTED_AFTER running
    batches measured exactly as predicted (no floor left)."""
    cost = SliceCost(path)  # type: ignore[arg-type]
    cost.seed([(shape, coefficients.seconds(shape)) for shape in SHAPES[:3]])
    for n in range(TRUSTED_AFTER if trusted else 0):
        shape = SHAPES[n % len(SHAPES)]
        cost.observe(shape, coefficients.seconds(shape))
    return cost


def test_three_probe_shapes_tell_the_three_terms_apart() -> None:
    cost = _seeded()
    assert cost.cost is not None
    assert cost.cost.fixed == pytest.approx(TRUE.fixed, rel=1e-6)
    assert cost.cost.per_token == pytest.approx(TRUE.per_token, rel=1e-6)
    assert cost.cost.per_square == pytest.approx(TRUE.per_square, rel=1e-6)


def test_one_shape_seen_gives_a_cost_per_token_as_before() -> None:
    """Under-determined (every batch alike): the simplest model that explains it, the per-token
    cost the worker used before the cost model."""
    cost = SliceCost("eager")
    cost.seed([(Shape.padded(64, 24), 0.030)])
    assert cost.cost == Coefficients(0.0, pytest.approx(0.030 / (64 * 24)), 0.0)


def test_the_fit_never_goes_negative() -> None:
    """Times that a free least-squares fit would explain with a negative fixed cost (cheaper
    small batches than any linear law allows) give zero for it, not a negative prediction."""
    rows = np.stack([Shape.padded(n, 32).features() for n in (1, 2, 64, 128)])
    seconds = np.array([0.0001, 0.0002, 0.050, 0.100])
    fitted = fit_nonnegative(rows, seconds, np.ones(4))
    assert (fitted >= 0).all()
    assert Coefficients.from_array(fitted).seconds(Shape.padded(1, 8)) >= 0


def test_a_long_sequence_mix_gets_a_smaller_batch_whose_predicted_slice_fits() -> None:
    """The promise's arithmetic: sized from the model, a batch of 256-token texts holds fewer
    tokens than one of 32-token texts (attention costs more per token in long rows), and each
    predicted slice stays within headroom x target. One rate per token (the old sizing) would
    give both the same tokens and let the long batch overrun."""
    target = 0.050
    limit = _seeded(trusted=True).limit(target)
    assert limit is not None and limit.seconds == pytest.approx(SLICE_HEADROOM * target)
    assert limit.min_tokens == 0
    short, long_ = ([32] * 400, [256] * 400)
    plans = {
        name: plan_batches(lengths, 4096, 128, max_texts=limit.max_texts)
        for name, lengths in (("short", short), ("long", long_))
    }
    for batches in plans.values():
        for batch in batches:
            shape = Shape.padded(len(batch.positions), batch.longest)
            assert limit.predicted(shape) <= limit.seconds + 1e-12
    short_tokens = max(b.padded_tokens for b in plans["short"])
    long_tokens = max(b.padded_tokens for b in plans["long"])
    assert long_tokens < short_tokens
    # and each is as full as the limit allows: one more text would not fit
    for width, batches in ((32, plans["short"]), (256, plans["long"])):
        fullest = max(len(b.positions) for b in batches)
        assert limit.predicted(Shape.padded(fullest + 1, width)) > limit.seconds


def test_until_a_path_has_measured_its_own_batches_none_is_cut_below_the_old_floor() -> None:
    """A seed timed in a burst of contention (here: every probe 50x slow) would cut the first
    windows, planned from the seed alone, into single texts; until TRUSTED_AFTER running
    batches are measured, no batch is cut below UNPROVEN_MIN_TOKENS, then the fit alone rules."""
    slow = Coefficients(50 * TRUE.fixed, 50 * TRUE.per_token, 50 * TRUE.per_square)
    cost = _seeded(slow)
    limit = cost.limit(0.050)
    assert limit is not None and limit.min_tokens == UNPROVEN_MIN_TOKENS
    assert limit.max_texts(np.array([16]))[0] == UNPROVEN_MIN_TOKENS // 16
    assert limit.fits(UNPROVEN_MIN_TOKENS, UNPROVEN_MIN_TOKENS * 16)
    for n in range(TRUSTED_AFTER):
        shape = SHAPES[n % len(SHAPES)]
        cost.observe(shape, slow.seconds(shape))
    trusted = cost.limit(0.050)
    assert trusted is not None and trusted.min_tokens == 0
    assert trusted.max_texts(np.array([16]))[0] < UNPROVEN_MIN_TOKENS // 16


def test_max_texts_is_the_largest_count_that_fits_and_at_least_one() -> None:
    limit = SliceLimit(TRUE, 0.030)
    widths = np.array([8, 32, 128, 256, 512, 4096])
    counts = limit.max_texts(widths)
    for width, count in zip(widths, counts, strict=True):
        if count > 1:
            assert limit.predicted(Shape.padded(int(count), int(width))) <= 0.030
        assert limit.predicted(Shape.padded(int(count) + 1, int(width))) > 0.030
    assert counts[-1] == 1  # one text over the limit still gets a batch of its own
    assert list(counts) == sorted(counts, reverse=True)
    free = SliceLimit(Coefficients(0.0, 0.0, 0.0), 0.030)  # nothing costs: no cap
    assert (free.max_texts(widths) > 1_000_000).all()


def test_packed_batches_stay_inside_the_limit() -> None:
    rng = random.Random(3)
    lengths = [rng.randint(8, 256) for _ in range(300)]
    limit = SliceLimit(TRUE, 0.030)
    batches = plan_packed_batches(lengths, 1 << 20, 1024, fits=limit.fits)
    assert sorted(p for b in batches for p in b.positions) == list(range(300))
    for batch in batches:
        shape = Shape.packed([lengths[p] for p in batch.positions])
        assert len(batch.positions) == 1 or limit.predicted(shape) <= 0.030


def test_the_fit_follows_what_is_measured_while_running() -> None:
    """Seeded with one speed, then every batch runs twice as slow (the machine got busier for
    good): the predictions follow within a few dozen batches."""
    cost = _seeded()
    slower = Coefficients(2 * TRUE.fixed, 2 * TRUE.per_token, 2 * TRUE.per_square)
    rng = random.Random(0)
    for _ in range(60):
        shape = rng.choice(SHAPES)
        cost.observe(shape, slower.seconds(shape))
    for shape in SHAPES:
        assert cost.predict(shape) == pytest.approx(slower.seconds(shape), rel=0.15)


def test_one_stretched_slice_moves_the_model_a_bounded_step() -> None:
    cost = _seeded()
    shape = SHAPES[0]
    before = cost.predict(shape)
    assert before is not None
    cost.observe(shape, 10 * before)  # another process took a core for one batch
    after = cost.predict(shape)
    assert after is not None and before < after < 1.3 * before


def test_headroom_is_measured_from_the_spread_of_slices() -> None:
    cost = _seeded()
    assert cost.headroom == SLICE_HEADROOM  # too few slices measured to know their spread
    for _ in range(HEADROOM_AFTER):
        shape = SHAPES[1]
        cost.observe(shape, TRUE.seconds(shape))  # exactly as predicted: the most room
    assert cost.headroom == pytest.approx(MAX_HEADROOM)
    noisy = _seeded()
    rng = random.Random(1)
    for _ in range(40):  # one slice in five 2.5x its prediction
        shape = rng.choice(SHAPES)
        factor = 2.5 if rng.random() < 0.2 else 1.0
        noisy.observe(shape, factor * TRUE.seconds(shape))
    assert MIN_HEADROOM <= noisy.headroom < 0.5
    assert noisy.limit(0.1) is not None and noisy.limit(0.1).seconds < 0.05  # type: ignore[union-attr]


def test_no_limit_before_anything_is_measured_or_without_a_target() -> None:
    assert SliceCost("eager").limit(0.1) is None
    assert _seeded().limit(0) is None


def test_the_slice_clock_keeps_the_longest_stretch_without_the_queries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [0.0]
    monkeypatch.setattr(cost_model.time, "perf_counter", lambda: now[0])
    clock = SliceClock()
    clock.boundary()  # not running: nothing
    clock.start()
    for at in (1.0, 3.0):  # embeddings 1 s, a layer 2 s
        now[0] = at
        clock.boundary()
    now[0] = 10.0  # queries served at that boundary for 7 s
    clock.resume()
    now[0] = 11.5
    clock.boundary()
    now[0] = 12.0
    assert clock.stop() == pytest.approx(2.0)
    assert clock.boundaries == 3
    clock.start()  # a graph without boundaries: the whole pass
    now[0] = 16.0
    assert clock.stop() == pytest.approx(4.0)


def test_the_latency_benchmark_forces_each_path_with_real_settings() -> None:
    """loadtest.latency --paths: every path's environment names settings that exist and sets
    them to what the path needs (a misspelt variable would be ignored, and the path not
    forced)."""
    from embedfleet.shared.settings import Settings
    from loadtest.latency import PATHS, path_settings

    fields = {f"EMBEDFLEET_{name.upper()}" for name in Settings.model_fields}
    for path, env in PATHS.items():
        assert set(env) <= fields, path
    assert path_settings("eager").dtype == "float32"
    frozen = path_settings("frozen")
    assert frozen.dtype == "bfloat16" and frozen.frozen_bulk and not frozen.cpu_int8
    assert path_settings("int8").cpu_int8 and path_settings("varlen").layout == "varlen"
    assert path_settings("int8-w8a8").cpu_int8_choice == "w8a8"
    assert path_settings("int8-dynamic").cpu_int8_choice == "dynamic"
    assert not path_settings("eager-bf16").frozen_bulk
