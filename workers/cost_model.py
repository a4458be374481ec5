"""How long a bulk slice takes, per forward path and batch shape, fitted while the worker runs;
and the batch sizes that keep every slice inside the query stage's slice target.

On a CPU a query waits at most one *slice* of bulk compute (``EMBEDFLEET_SLICE_MS``): one
transformer layer of an eager batch (queries are served at its layer boundaries), the whole
batch through the frozen or int8 copy (a graph without boundaries). So the worker must know, for
the path it runs and for the batch it is about to plan, how long the longest slice will take.

One number per token (what the worker had before) cannot: a forward pass has a fixed cost, a
cost per token (the linear layers) and a cost per pair of tokens a row attends over (attention,
which grows with the square of the row's length), and the paths weigh them differently (the
int8 copy's linear layers are cheaper per token, its quantize steps a fixed cost). A batch of
long texts then overran a slice that a batch of short texts with as many tokens fitted. Hence,
per path::

    seconds = fixed + per_token * tokens + per_square * squares

where, for a padded batch of ``n`` texts ``w`` tokens wide, ``tokens = n * w`` and
``squares = n * w**2`` (padding is attended over too); for a packed (varlen) batch, the texts'
own lengths: ``tokens = sum(len)``, ``squares = sum(len**2)``.

**Fitted online** (:class:`SliceCost`): seeded at start from a few timed probe batches of
different shapes (which tell the three terms apart, and fade as running batches come in), then
every bulk forward's measured longest slice is one more observation. The fit is non-negative
least squares on *relative* errors over the seed and the most recent observations: a 5 ms
slice mispredicted by 5 ms matters as much as a 100 ms one by 100 ms. Each observation enters
clipped to [1/CLIP, CLIP] times the prediction of the moment, so a slice stretched tenfold by
another process taking a core moves the model a bounded step, while a lasting change (the
machine got slower) moves it within a few dozen batches.

**Headroom** (:attr:`SliceCost.headroom`): batches are sized so the *predicted* slice is at most
``headroom x target``. The fit predicts the typical slice; what must stay inside the target is
nearly every slice. So the headroom is measured too: SAFETY over the 90th percentile of recent
(measured / predicted) ratios, unclipped, within [MIN_HEADROOM, MAX_HEADROOM]; SLICE_HEADROOM
until enough ratios are known. A noisy machine gets smaller batches; a quiet one, fuller ones.

Until a path has measured TRUSTED_AFTER of its own batches, none is cut below
UNPROVEN_MIN_TOKENS: the first windows are planned from the seed alone, and one seed timed in a
burst of contention must not cut a whole window into single texts.

**Sizing** (:class:`SliceLimit`): an immutable snapshot of one path's coefficients and limit
that the planner reads on the tokenizer thread while the event loop refits (a new snapshot is
swapped in whole). For a padded batch it gives the most texts of each width that fit; for a
packed batch whether a running (tokens, squares) sum still fits.

Pure logic, no torch: tests/unit/workers/test_cost_model.py checks the fit and the sizing.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from embedfleet.shared.settings.query_stage import Engine

BulkPath = Literal["eager", "frozen", "int8", Engine, "varlen"]
"""The forward path of a bulk batch: the eager model (sliced per layer, padded), the frozen or
int8 copy (no layer boundaries: the whole batch is one slice), another engine's copy (ONNX
Runtime's whole, OpenVINO's cut at its layers: one layer a slice), or the packed varlen layout
(eager, sliced per layer)."""

# Until this many slices of a path are measured, batches are sized with SLICE_HEADROOM; with
# fewer, a 90th percentile is one sample. The share of the target the predicted slice may take
# then: the per-batch spread measured on a 2-core VM put half the slices over their prediction
# and about one in ten 1.5x over it.
HEADROOM_AFTER = 16
SLICE_HEADROOM = 0.6
# Once measured: SAFETY / q90(measured / predicted), within these bounds. The floor keeps a
# burst of contention (another process on a core: slices 10x their prediction) from cutting
# batches to single texts; the ceiling leaves a margin for the slice after the measured ones.
HEADROOM_SAFETY = 0.9
MIN_HEADROOM = 0.25
MAX_HEADROOM = 0.9
HEADROOM_QUANTILE = 90
# Observations kept per path (besides the seed), and the range of measured / predicted an
# observation enters the fit with (see the module docstring).
RECENT = 48
CLIP = 2.0
# Until a path has this many running observations its batches are never cut below
# UNPROVEN_MIN_TOKENS (the old sizing's floor): the first windows are planned from the seed
# alone, a window of up to 1,024 texts at once, and a seed timed while another process held a
# core (probe slices 40-80x their quiet time were seen on a shared 2-core VM) cut a whole window
# into single texts. Once the path has measured its own batches, the fit is trusted alone.
TRUSTED_AFTER = 8
UNPROVEN_MIN_TOKENS = 512
# Recent observations weigh less with age: halved every HALF_LIFE batches.
HALF_LIFE = 24
# Each seed observation counts as SEED_WEIGHT recent ones at first, halved every SEED_HALF_LIFE
# observations down to SEED_FLOOR: the running batches then decide the fit (the seed was timed
# once, at start), while the seed still holds the three terms apart when they all look alike
# (a sorted window's batches share their token count).
SEED_WEIGHT = 2.0
SEED_FLOOR = 0.1
SEED_HALF_LIFE = 8


@dataclass(frozen=True)
class Shape:
    """What a bulk forward computes, as the cost model sees it."""

    tokens: int
    squares: int

    @classmethod
    def padded(cls, texts: int, longest: int) -> Shape:
        """A right-padded batch: every row is ``longest`` wide and attends over all of it."""
        return cls(texts * longest, texts * longest * longest)

    @classmethod
    def packed(cls, lengths: Sequence[int]) -> Shape:
        """A varlen batch: each text attends over its own tokens only."""
        return cls(int(sum(lengths)), int(sum(length * length for length in lengths)))

    def features(self) -> np.ndarray:
        return np.array([1.0, float(self.tokens), float(self.squares)])


@dataclass(frozen=True)
class Coefficients:
    fixed: float
    per_token: float
    per_square: float

    def seconds(self, shape: Shape) -> float:
        return self.fixed + self.per_token * shape.tokens + self.per_square * shape.squares

    @classmethod
    def from_array(cls, values: np.ndarray) -> Coefficients:
        return cls(float(values[0]), float(values[1]), float(values[2]))


_NO_CAP = float(1 << 40)  # "any number of texts", still an int64


@dataclass(frozen=True)
class SliceLimit:
    """One path's coefficients and the longest predicted slice a batch may have: what the
    planner reads (workers/batcher.py), immutable so another thread may refit meanwhile."""

    cost: Coefficients
    seconds: float  # headroom x slice target
    min_tokens: int = 0  # never cut below this many tokens (UNPROVEN_MIN_TOKENS, or none)

    def max_texts(self, widths: np.ndarray) -> np.ndarray:
        """The most texts a padded batch of each width may hold (at least 1: a text cannot be
        split; a single text over the limit gets its own batch; at least ``min_tokens``)."""
        widths = np.asarray(widths, dtype=np.float64)
        per_text = self.cost.per_token * widths + self.cost.per_square * widths * widths
        room = self.seconds - self.cost.fixed
        with np.errstate(divide="ignore", invalid="ignore"):
            fitting = np.where(per_text > 0, np.floor(room / np.maximum(per_text, 1e-300)), _NO_CAP)
            floor = np.floor(self.min_tokens / np.maximum(widths, 1))
        return np.clip(np.maximum(fitting, floor), 1, _NO_CAP).astype(np.int64)

    def fits(self, tokens: int, squares: int) -> bool:
        """Whether a packed batch with these sums stays inside the limit."""
        return (
            tokens <= self.min_tokens or self.cost.seconds(Shape(tokens, squares)) <= self.seconds
        )

    def predicted(self, shape: Shape) -> float:
        return self.cost.seconds(shape)


class SliceCost:
    """One forward path's slice time, fitted from what it measured (see the module docstring).

    ``observe`` and ``seed`` run on the event loop; ``limit`` may be called from any thread
    (it reads two attributes that the event loop replaces whole, never mutates).
    """

    def __init__(self, path: BulkPath) -> None:
        self.path = path
        self._seed: list[tuple[np.ndarray, float]] = []
        self._recent: deque[tuple[np.ndarray, float]] = deque(maxlen=RECENT)
        self._ratios: deque[float] = deque(maxlen=RECENT)
        self._cost: Coefficients | None = None
        self._headroom = SLICE_HEADROOM
        self.observed = 0

    @property
    def cost(self) -> Coefficients | None:
        """The fitted coefficients; None until something was measured."""
        return self._cost

    @property
    def headroom(self) -> float:
        """Share of the slice target a batch's predicted slice may take."""
        return self._headroom

    def _measure_headroom(self) -> None:
        if len(self._ratios) < HEADROOM_AFTER:
            return
        spread = float(np.percentile(np.asarray(self._ratios), HEADROOM_QUANTILE))
        self._headroom = min(MAX_HEADROOM, max(MIN_HEADROOM, HEADROOM_SAFETY / max(spread, 1e-9)))

    def predict(self, shape: Shape) -> float | None:
        return None if self._cost is None else self._cost.seconds(shape)

    def seed(self, samples: Sequence[tuple[Shape, float]]) -> None:
        """Timed probe batches of different shapes, before any real batch: they stay in the fit
        for as long as the worker runs, with less weight as running batches are measured."""
        self._seed = [(shape.features(), seconds) for shape, seconds in samples if seconds > 0]
        self._refit()

    def observe(self, shape: Shape, seconds: float) -> None:
        """One bulk forward's longest slice, measured."""
        if seconds <= 0:
            return
        self.observed += 1
        predicted = self.predict(shape)
        if predicted is not None and predicted > 0:
            ratio = seconds / predicted
            self._ratios.append(ratio)
            self._measure_headroom()
            seconds = predicted * min(CLIP, max(1 / CLIP, ratio))
        self._recent.append((shape.features(), seconds))
        self._refit()

    def limit(self, target_seconds: float) -> SliceLimit | None:
        """What a batch planned now may cost: None before anything was measured."""
        cost = self._cost
        if cost is None or target_seconds <= 0:
            return None
        floor = UNPROVEN_MIN_TOKENS if self.observed < TRUSTED_AFTER else 0
        return SliceLimit(cost, self.headroom * target_seconds, floor)

    def _refit(self) -> None:
        rows: list[np.ndarray] = []
        targets: list[float] = []
        weights: list[float] = []
        seed_weight = max(SEED_FLOOR, SEED_WEIGHT * 0.5 ** (self.observed / SEED_HALF_LIFE))
        for features, seconds in self._seed:
            rows.append(features)
            targets.append(seconds)
            weights.append(seed_weight)
        age_decay = 0.5 ** (1 / HALF_LIFE)
        for age, (features, seconds) in enumerate(reversed(self._recent)):
            rows.append(features)
            targets.append(seconds)
            weights.append(age_decay**age)
        if not rows:
            return
        fitted = fit_nonnegative(np.stack(rows), np.asarray(targets), np.asarray(weights))
        self._cost = Coefficients.from_array(fitted)


# Subsets of (fixed, per_token, per_square) tried, fewer terms first and the per-token cost first
# among equals: what an under-determined fit (one shape seen) falls back to.
_SUBSETS: tuple[tuple[int, ...], ...] = ((1,), (0,), (2,), (0, 1), (1, 2), (0, 2), (0, 1, 2))


def fit_nonnegative(rows: np.ndarray, seconds: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Coefficients >= 0 minimising sum(weight * ((rows @ c - seconds) / seconds)**2).

    Three unknowns: every subset of them is solved by least squares and the best non-negative
    solution kept (exact non-negative least squares, 7 tiny solves). Columns are scaled to unit
    size first (tokens and squares differ by orders of magnitude). With fewer distinct shapes
    than unknowns the smallest subsets explain the data, so one observation gives a per-token
    cost alone, as the worker had before.
    """
    scale = np.sqrt(weights) / seconds
    design = rows * scale[:, None]
    target = seconds * scale
    norms = np.linalg.norm(design, axis=0)
    norms[norms == 0] = 1.0
    design = design / norms
    best: np.ndarray | None = None
    best_error = math.inf
    columns = design.shape[1]
    for subset in _SUBSETS:
        picked = list(subset)
        solution, *_ = np.linalg.lstsq(design[:, picked], target, rcond=None)
        if np.any(solution < 0):
            continue
        full = np.zeros(columns)
        full[picked] = solution
        error = float(np.sum((design @ full - target) ** 2))
        # strictly better only: on a tie (an under-determined fit) the earlier, simpler wins
        if error < best_error - 1e-12 * max(1.0, best_error if best_error < math.inf else 1.0):
            best, best_error = full, error
    if best is None:  # unreachable with positive data: some single column fits with c >= 0
        return np.zeros(columns)
    return best / norms


class SliceClock:
    """The longest stretch of one bulk forward between two points where a query could get in.

    Used on the model thread only: ``start`` before the forward pass, ``boundary`` at each
    layer boundary (the query stage's layer hook), ``resume`` after queries served there (their
    time is not bulk compute), ``stop`` after the pass. Through a graph without boundaries the
    longest stretch is the whole pass.
    """

    def __init__(self) -> None:
        self._running = False
        self._mark = 0.0
        self._longest = 0.0
        self.boundaries = 0

    def start(self) -> None:
        self._running = True
        self._longest = 0.0
        self.boundaries = 0
        self._mark = time.perf_counter()

    def boundary(self) -> None:
        if not self._running:
            return
        now = time.perf_counter()
        self._longest = max(self._longest, now - self._mark)
        self._mark = now
        self.boundaries += 1

    def resume(self) -> None:
        if self._running:
            self._mark = time.perf_counter()

    def stop(self) -> float:
        """The longest stretch, in seconds (the last one, to the end of the pass, included)."""
        if not self._running:
            return 0.0
        now = time.perf_counter()
        self._longest = max(self._longest, now - self._mark)
        self._running = False
        return self._longest
