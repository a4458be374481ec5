"""Sort a window of tokenized texts by length and cut it into micro-batches by a token budget.

Pure logic, no I/O: sorting the whole window read from the stream (hundreds of entries) puts
texts of similar length together, so a right-padded batch computes almost no padding.

Where to cut is chosen, not greedy. Filling each batch to the budget in length order leaves
the sparse long tail of a skewed corpus in batches whose texts differ by a hundred tokens (12%
padding on a 512-text window of the benchmark corpus); cutting everywhere wastes nothing but
pays a forward pass's fixed cost per text. :func:`plan_batches` minimises the total
``padded tokens + batches x BATCH_COST_TOKENS`` over every way of cutting the sorted window
(an exact dynamic programme, O(window x max_batch), a few ms per 512 texts), so it cuts where
lengths jump and fills where they are even.

Beside the token budget, a batch may be bounded by time: where queries wait on bulk work (a
CPU), the worker passes the query slice's limit from its cost model (workers/cost_model.py):
``max_texts(widths)``, the most texts a padded batch of each width may hold, or for packed
batches ``fits(tokens, squares)``. A batch of long texts then holds fewer tokens than one of
short texts, as its attention costs more per token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

# The fixed cost of one forward pass (Python dispatch of ~100 modules, kernel launches, small
# GEMMs running below peak), in tokens of compute it is worth. Measured on the benchmark
# machine (docs/BENCHMARKS.md): a 1x8 batch costs as much as ~50 (fp32) to ~100 (bf16) tokens
# of a large batch. Larger means fewer, fuller batches; 0 would cut at every length change.
BATCH_COST_TOKENS = 128


@dataclass(frozen=True)
class PlannedBatch:
    """Positions (into the window) of the texts in one micro-batch, shortest first (longest
    first when packed)."""

    positions: list[int]
    longest: int
    real_tokens: int
    # varlen (workers/model/packing.py): every text end to end in one row, no padding computed
    packed: bool = False

    @property
    def padded_tokens(self) -> int:
        """Tokens the forward pass computes: padding included, unless the batch is packed."""
        return self.real_tokens if self.packed else self.longest * len(self.positions)


def plan_batches(
    lengths: Sequence[int],
    token_budget: int,
    max_batch: int,
    *,
    batch_cost_tokens: int = BATCH_COST_TOKENS,
    max_texts: Callable[[np.ndarray], np.ndarray] | None = None,
) -> list[PlannedBatch]:
    """Group positions so that ``len(batch) * longest <= token_budget`` and ``len <= max_batch``,
    cut where it costs least (see the module docstring). ``max_texts``: the most texts a batch
    of each width may hold (the query slice's limit), as an array for an array of widths; it
    must not grow with the width (a wider text never allows more texts), which keeps the
    batches that fit a suffix, as the budget does.

    A single text longer than the budget still gets a batch of its own (it cannot be split).
    Batches come out longest first, so the largest allocation happens at the start of a window.
    """
    if token_budget < 1 or max_batch < 1:
        raise ValueError("token_budget and max_batch must be positive")
    if not lengths:
        return []
    order, ordered = _longest_first(lengths)
    widths = ordered.tolist()  # scalars from a list: numpy scalar access costs more per step
    # the most texts a batch led by each text may hold, where time bounds it: (j - i) shrinks
    # and cap[i] grows as i grows, so the batches that fit are still those from ``low`` on
    cap = None if max_texts is None else np.asarray(max_texts(ordered), dtype=np.int64).tolist()
    start = _cheapest_cuts(ordered, widths, cap, token_budget, max_batch, batch_cost_tokens)
    return _planned(order, ordered, widths, start)


def _longest_first(lengths: Sequence[int]) -> tuple[list[int], np.ndarray]:
    """The window's positions longest first, equal lengths in window order (a stable sort, as
    ``sorted(reverse=True)``), and their lengths in that order."""
    window = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-window, kind="stable")
    return order.tolist(), window[order]


# above this many runs of equal widths in a step's window, their costs are one numpy call
_RUNS_IN_PYTHON = 24


def _cheapest_cuts(
    ordered: np.ndarray,
    widths: list[int],
    cap: list[int] | None,
    token_budget: int,
    max_batch: int,
    batch_cost_tokens: int,
) -> list[int]:
    """``start[j]``: where the last batch of the cheapest plan of the j longest texts begins
    (``ordered``, longest first; ``widths`` the same as a list; ``cap``: ``max_texts``'s)."""
    count = len(widths)
    # best[j]: least cost of batching the j longest texts; start[j]: where the last batch of
    # that best plan begins. A batch [i, j) is as wide as its first (longest) text, widths[i],
    # and costs best[i] + (j - i) * widths[i] + batch_cost_tokens = base[i] + j * widths[i]
    # + batch_cost_tokens, with base[i] = best[i] - i * widths[i] (known once best[i] is).
    # The batches [i, j) that fit the budget are those from some ``low`` on: (j - i) and
    # widths[i] both shrink as i grows. Of those only the first of each run of equal widths
    # is costed (``_RunCosts``). Integer costs, exact.
    runs = _RunCosts(ordered, widths)
    best = [0] * (count + 1)
    start = [0] * (count + 1)
    low = pick = 0
    for end in range(1, count + 1):
        low = max(low, end - max_batch)
        while low < end - 1 and (
            (end - low) * widths[low] > token_budget or (cap is not None and end - low > cap[low])
        ):
            low += 1
        # the cheapest start never moves back as ``end`` grows (``_RunCosts``): from the last
        pick, least = runs.cheapest(max(low, pick), end)
        best[end] = least + batch_cost_tokens
        start[end] = pick
        if end < count:
            runs.known(end, best[end] - end * widths[end])
    return start


class _RunCosts:
    """The cheapest start of a batch ending at ``end``, costing one candidate per run of equal
    widths (issue 53: costing the whole slice [low, end) was ~9 µs a text at CUDA's window of
    8192).

    Why that is the slice's answer, tie for tie: best[i + 1] >= best[i] + widths[i] (the
    (i+1)-th text taken out of the best plan of i + 1 texts leaves a plan of i that fits and
    costs at least widths[i] less), so within a run of width w, base[i] = best[i] - i * w never
    falls as i grows. A run's first start in the window is then its least cost, and the
    earliest among equals: the one numpy's argmin over the slice picked. Across runs, the
    earliest wins a tie here too (a later run must be strictly cheaper).

    And the earliest cheapest start of [start, end) never lies before that of [start, end - 1):
    the costs best[i] + (end - i) * widths[i] form a Monge array (for i < i' and end < end',
    the two crossed sums differ by (end' - end) * (widths[i'] - widths[i]) <= 0, widths
    falling), whose rows' leftmost minima never move left, and the feasible starts [low, end)
    only move right. So each step costs the runs from the last pick on: a batch's few widths."""

    def __init__(self, ordered: np.ndarray, widths: list[int]) -> None:
        self.widths = widths
        self.base = [0] * (len(widths) + 1)
        self.firsts = [0, *(np.flatnonzero(np.diff(ordered)) + 1).tolist()]  # run by run
        self.run_widths = np.array([widths[first] for first in self.firsts], dtype=np.int64)
        self.run_width_list = self.run_widths.tolist()
        self.run_base = np.zeros(len(self.firsts), dtype=np.int64)
        self.after_low = 1  # the first run that starts after ``low``
        self.begun = 1  # the runs that start before ``end``

    def known(self, position: int, base: int) -> None:
        """``base[position]``, once ``best[position]`` is known (positions in order)."""
        self.base[position] = base
        if self.begun < len(self.firsts) and self.firsts[self.begun] == position:
            self.run_base[self.begun] = base
            self.begun += 1

    def cheapest(self, low: int, end: int) -> tuple[int, int]:
        """(start, cost less the batch's fixed cost) of the cheapest batch [start, end) with
        start >= ``low``, the earliest start among equals."""
        firsts, base = self.firsts, self.base
        while self.after_low < self.begun and firsts[self.after_low] <= low:
            self.after_low += 1
        begin, stop = self.after_low, self.begun
        pick, least = low, base[low] + end * self.widths[low]
        if stop - begin > _RUNS_IN_PYTHON:
            costs = self.run_base[begin:stop] + end * self.run_widths[begin:stop]
            at = int(costs.argmin())
            if int(costs[at]) < least:
                pick, least = firsts[begin + at], int(costs[at])
            return pick, least
        widths = self.run_width_list
        for run in range(begin, stop):
            cost = base[firsts[run]] + end * widths[run]
            if cost < least:
                pick, least = firsts[run], cost
        return pick, least


def _planned(
    order: list[int], ordered: np.ndarray, widths: list[int], start: list[int]
) -> list[PlannedBatch]:
    """The batches ``start`` cuts, longest first, each one's positions shortest first."""
    batches: list[PlannedBatch] = []
    end = len(ordered)
    while end > 0:
        begin = start[end]
        positions = order[begin:end][::-1]  # shortest first
        batches.append(
            PlannedBatch(
                positions=positions,
                longest=widths[begin],
                real_tokens=int(ordered[begin:end].sum()),
            )
        )
        end = begin
    batches.reverse()
    return batches


def plan_packed_batches(
    lengths: Sequence[int],
    token_budget: int,
    max_batch: int,
    fits: Callable[[int, int], bool] | None = None,
) -> list[PlannedBatch]:
    """For the varlen layout, where real tokens are all that is computed: positions grouped,
    longest first, so each batch holds at most ``token_budget`` real tokens and ``max_batch``
    texts (a text over the budget alone); ``fits(tokens, squares)``, where given, must hold of
    the batch's sums of lengths and squared lengths too (the query slice's limit)."""
    if token_budget < 1 or max_batch < 1:
        raise ValueError("token_budget and max_batch must be positive")
    order, ordered = _longest_first(lengths)
    widths = ordered.tolist()
    batches: list[PlannedBatch] = []
    begin = tokens = squares = 0  # the open batch: order[begin:at], its sums
    for at, length in enumerate(widths):
        if at > begin and (
            at - begin >= max_batch
            or tokens + length > token_budget
            or (fits is not None and not fits(tokens + length, squares + length * length))
        ):
            batches.append(_packed(order[begin:at], widths[begin], tokens))
            begin, tokens, squares = at, 0, 0
        tokens += length
        squares += length * length
    if widths:
        batches.append(_packed(order[begin:], widths[begin], tokens))
    return batches


def _packed(positions: list[int], longest: int, tokens: int) -> PlannedBatch:
    return PlannedBatch(positions, longest=longest, real_tokens=tokens, packed=True)


def padding_waste(batches: Sequence[PlannedBatch]) -> float:
    """Fraction of computed tokens that are padding."""
    padded = sum(batch.padded_tokens for batch in batches)
    real = sum(batch.real_tokens for batch in batches)
    return 0.0 if padded == 0 else 1.0 - real / padded
