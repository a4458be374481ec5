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
    order = sorted(range(len(lengths)), key=lambda position: lengths[position], reverse=True)
    ordered = np.array([lengths[p] for p in order], dtype=np.int64)
    widths = ordered.tolist()  # scalars from a list: numpy scalar access costs more per step
    # the most texts a batch led by each text may hold, where time bounds it: (j - i) shrinks
    # and cap[i] grows as i grows, so the batches that fit are still those from ``low`` on
    cap = None if max_texts is None else np.asarray(max_texts(ordered), dtype=np.int64).tolist()
    start = _cheapest_cuts(ordered, widths, cap, token_budget, max_batch, batch_cost_tokens)
    return _planned(order, ordered, widths, start)


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
    count = len(ordered)
    # best[j]: least cost of batching the j longest texts; start[j]: where the last batch of
    # that best plan begins. A batch [i, j) is as wide as its first (longest) text, ordered[i],
    # and costs best[i] + (j - i) * ordered[i] + batch_cost_tokens = base[i] + j * ordered[i]
    # + batch_cost_tokens, with base[i] = best[i] - i * ordered[i] (known once best[i] is).
    # The batches [i, j) that fit the budget are those from some ``low`` on: (j - i) and
    # ordered[i] both shrink as i grows. So each step is one slice, not a masked window
    # (issue 29: the masked window cost ~40 µs a text on a loaded host, at CUDA's window as at
    # the CPU's; this is the same plan, tie for tie, in a fraction of it). Integer costs, exact.
    best = [0] * (count + 1)
    base = np.zeros(count + 1, dtype=np.int64)  # base[0] = best[0] - 0 = 0
    start = [0] * (count + 1)
    low = 0
    for end in range(1, count + 1):
        low = max(low, end - max_batch)
        while low < end - 1 and (
            (end - low) * widths[low] > token_budget or (cap is not None and end - low > cap[low])
        ):
            low += 1
        cost = base[low:end] + end * ordered[low:end]
        pick = int(cost.argmin())
        best[end] = int(cost[pick]) + batch_cost_tokens
        start[end] = low + pick
        if end < count:
            base[end] = best[end] - end * widths[end]
    return start


def _planned(
    order: list[int], ordered: np.ndarray, widths: list[int], start: list[int]
) -> list[PlannedBatch]:
    """The batches ``start`` cuts, longest first, each one's positions shortest first."""
    batches: list[PlannedBatch] = []
    end = len(ordered)
    while end > 0:
        begin = start[end]
        positions = [order[k] for k in range(end - 1, begin - 1, -1)]  # shortest first
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
    batches: list[PlannedBatch] = []
    current: list[int] = []
    tokens = 0
    squares = 0

    def close() -> None:
        longest = lengths[current[0]]
        batches.append(PlannedBatch(current, longest=longest, real_tokens=tokens, packed=True))

    for position in sorted(range(len(lengths)), key=lambda p: lengths[p], reverse=True):
        length = lengths[position]
        if current and (
            len(current) >= max_batch
            or tokens + length > token_budget
            or (fits is not None and not fits(tokens + length, squares + length * length))
        ):
            close()
            current, tokens, squares = [], 0, 0
        current.append(position)
        tokens += length
        squares += length * length
    if current:
        close()
    return batches


def padding_waste(batches: Sequence[PlannedBatch]) -> float:
    """Fraction of computed tokens that are padding."""
    padded = sum(batch.padded_tokens for batch in batches)
    real = sum(batch.real_tokens for batch in batches)
    return 0.0 if padded == 0 else 1.0 - real / padded
