"""Sort a window of tokenized texts by length and cut it into micro-batches by a token budget.

Pure logic, no I/O: sorting the whole window read from the stream (hundreds of entries) puts
texts of similar length together, so a right-padded batch computes almost no padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PlannedBatch:
    """Positions (into the window) of the texts in one micro-batch, shortest first."""

    positions: list[int]
    longest: int
    real_tokens: int

    @property
    def padded_tokens(self) -> int:
        return self.longest * len(self.positions)


def plan_batches(lengths: Sequence[int], token_budget: int, max_batch: int) -> list[PlannedBatch]:
    """Group positions so that ``len(batch) * longest <= token_budget`` and ``len <= max_batch``.

    A single text longer than the budget still gets a batch of its own (it cannot be split).
    Batches come out longest first, so the largest allocation happens at the start of a window.
    """
    if token_budget < 1 or max_batch < 1:
        raise ValueError("token_budget and max_batch must be positive")
    order = sorted(range(len(lengths)), key=lambda position: lengths[position], reverse=True)
    batches: list[PlannedBatch] = []
    current: list[int] = []
    longest = 0
    real = 0
    for position in order:
        length = lengths[position]
        # Sorted descending: the first text of a batch is its longest.
        width = longest if current else length
        if current and (len(current) + 1 > max_batch or (len(current) + 1) * width > token_budget):
            batches.append(PlannedBatch(positions=current[::-1], longest=longest, real_tokens=real))
            current, real = [], 0
        if not current:
            longest = length
        current.append(position)
        real += length
    if current:
        batches.append(PlannedBatch(positions=current[::-1], longest=longest, real_tokens=real))
    return batches


def padding_waste(batches: Sequence[PlannedBatch]) -> float:
    """Fraction of computed tokens that are padding."""
    padded = sum(batch.padded_tokens for batch in batches)
    real = sum(batch.real_tokens for batch in batches)
    return 0.0 if padded == 0 else 1.0 - real / padded
