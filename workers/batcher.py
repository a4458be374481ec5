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
    # varlen (workers/packing.py): every text end to end in one row, no padding computed
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
    of each width may hold (the query slice's limit), as an array for an array of widths.

    A single text longer than the budget still gets a batch of its own (it cannot be split).
    Batches come out longest first, so the largest allocation happens at the start of a window.
    """
    if token_budget < 1 or max_batch < 1:
        raise ValueError("token_budget and max_batch must be positive")
    if not lengths:
        return []
    order = sorted(range(len(lengths)), key=lambda position: lengths[position], reverse=True)
    ordered = np.array([lengths[p] for p in order], dtype=np.int64)
    count = len(ordered)
    # best[j]: least cost of batching the j longest texts; start[j]: where the last batch of
    # that best plan begins. A batch [i, j) is as wide as its first (longest) text, ordered[i].
    # the most texts a batch led by each text may hold, where time bounds it
    cap = None if max_texts is None else np.asarray(max_texts(ordered), dtype=np.int64)
    best = np.full(count + 1, np.inf)
    best[0] = 0.0
    start = np.zeros(count + 1, dtype=np.int64)
    for end in range(1, count + 1):
        first = max(0, end - max_batch)
        sizes = end - np.arange(first, end)
        widths = ordered[first:end]
        cost = best[first:end] + sizes * widths + batch_cost_tokens
        over = sizes * widths > token_budget
        if cap is not None:
            over |= sizes > cap[first:end]
        cost[over & (sizes > 1)] = np.inf
        pick = int(np.argmin(cost))
        best[end] = cost[pick]
        start[end] = first + pick
    batches: list[PlannedBatch] = []
    end = count
    while end > 0:
        begin = int(start[end])
        positions = [order[k] for k in range(end - 1, begin - 1, -1)]  # shortest first
        batches.append(
            PlannedBatch(
                positions=positions,
                longest=int(ordered[begin]),
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
