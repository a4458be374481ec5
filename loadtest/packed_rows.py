"""The ``rows`` layout, a benchmark contender the worker does not run.

Texts packed first-fit-decreasing into rows of a fixed width; positions restart at 0 for each
text and a boolean block-diagonal mask keeps texts from attending to each other. The linear
layers see no padding, but attention is computed over the whole row (the mask only zeroes the
cross terms), so wide rows of short texts cost more attention than they save. Works with stock
SDPA on any device.

On a 2-core Intel Xeon rows of 256 beat *eager* sorted padded micro-batches in bf16 (1.38-1.87x
per window, 2 threads; 0.89x with one thread) and lost in fp32 (0.90x); docs/BENCHMARKS.md.
The worker's bf16 bulk on CPU has since moved to the frozen, pre-packed copy
(EMBEDFLEET_FROZEN_BULK), against which rows was never measured, so the worker keeps padded
batches on CPU (``workers.model.packing.preferred_layout``) and rows lives here, for
``python -m loadtest.bench --engines`` to measure again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from embedfleet.workers.model.encoder import Encoder, Tokenized
from embedfleet.workers.model.packing import check_packed_pooling, pool_packed, takes_token_types


def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """First-fit-decreasing: positions grouped into rows whose lengths sum to at most ``width``.

    A text longer than ``width`` gets a row of its own (the row is then that wide).
    """
    rows: list[list[int]] = []
    free: list[int] = []
    for position in sorted(range(len(lengths)), key=lambda p: lengths[p], reverse=True):
        length = lengths[position]
        for row, room in enumerate(free):
            if length <= room:
                rows[row].append(position)
                free[row] -= length
                break
        else:
            rows.append([position])
            free.append(max(0, width - length))
    return rows


def plan_rows(lengths: Sequence[int], token_budget: int, width: int) -> list[list[int]]:
    """Positions packed into rows ``width`` tokens wide, ``token_budget // width`` rows a batch.

    Each inner list is one batch for :func:`collate_rows` (with the same ``width``).
    """
    rows = pack_rows(lengths, width)
    per_batch = max(1, token_budget // width)
    return [
        [position for row in rows[start : start + per_batch] for position in row]
        for start in range(0, len(rows), per_batch)
    ]


@dataclass
class RowsBatch:
    """Texts packed into rows. Vectors come out in the order of the items given to collate."""

    input_ids: torch.Tensor  # (rows, width) int64
    position_ids: torch.Tensor  # (rows, width) int64, restarting at 0 for each text
    attention_mask: torch.Tensor  # (rows, 1, width, width) bool, block-diagonal
    token_index: torch.Tensor  # (real tokens,) flat index into rows*width, text by text
    lengths: torch.Tensor  # (texts,) int64
    # counted once when collated, as the worker's varlen batches are (workers/model/packing.py)
    size: int  # texts
    real_tokens: int

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())


def collate_rows(items: Sequence[Tokenized], width: int, pad_id: int = 0) -> RowsBatch:
    """Pack ``items`` into rows ``width`` tokens wide with a block-diagonal attention mask."""
    rows = pack_rows([item.length for item in items], width)
    width = max(width, max(item.length for item in items))
    input_ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    position_ids = np.zeros((len(rows), width), dtype=np.int64)
    # Segment number per token; padding is its own segment (-1) so that no query row of the
    # mask is all False (SDPA returns NaN for a query that may attend to nothing).
    segments = np.full((len(rows), width), -1, dtype=np.int64)
    starts = np.zeros(len(items), dtype=np.int64)
    lengths = np.array([item.length for item in items], dtype=np.int64)
    for row, positions in enumerate(rows):
        column = 0
        for position in positions:
            item = items[position]
            end = column + item.length
            input_ids[row, column:end] = item.ids
            position_ids[row, column:end] = np.arange(item.length)
            segments[row, column:end] = position
            starts[position] = row * width + column
            column = end
    token_index = np.concatenate(
        [np.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)]
    )
    segment_tensor = torch.from_numpy(segments)
    mask = (segment_tensor[:, :, None] == segment_tensor[:, None, :]).unsqueeze(1)
    return RowsBatch(
        input_ids=torch.from_numpy(input_ids),
        position_ids=torch.from_numpy(position_ids),
        attention_mask=mask,
        token_index=torch.from_numpy(token_index),
        lengths=torch.from_numpy(lengths),
        size=len(items),
        real_tokens=int(lengths.sum()),
    )


def pool_rows(hidden: torch.Tensor, batch: RowsBatch, mode: str) -> torch.Tensor:
    """Per-text pooling over a packed (rows, width, dim) output: same as ``dense.pool``."""
    device = hidden.device
    tokens = hidden.reshape(-1, hidden.shape[-1])[batch.token_index.to(device)]
    lengths = batch.lengths.to(device)
    owner = torch.repeat_interleave(torch.arange(batch.size, device=device), lengths)
    first = lengths.cumsum(0) - lengths
    return pool_packed(tokens, owner, first, lengths, mode)


class RowsEncoder:
    """Runs packed rows through an :class:`Encoder`'s model, precision and pooling."""

    def __init__(self, encoder: Encoder, width: int | None = None) -> None:
        check_packed_pooling(encoder)
        self.encoder = encoder
        self.width = width or encoder.max_length
        self._model = encoder._model  # borrowed: same weights, same precision
        self._token_types = takes_token_types(self._model)

    def collate(self, items: Sequence[Tokenized]) -> RowsBatch:
        return collate_rows(items, self.width, self.encoder.pad_id)

    @torch.inference_mode()
    def embed(self, batch: RowsBatch) -> np.ndarray:
        """Vectors in item order: float32, (texts, dim), normalised if the model says so."""
        device = self.encoder.device
        input_ids = batch.input_ids.to(device)
        kwargs: dict[str, torch.Tensor] = {
            "input_ids": input_ids,
            "position_ids": batch.position_ids.to(device),
            "attention_mask": batch.attention_mask.to(device),
        }
        # zeros of the row's shape (see workers.model.packing.takes_token_types)
        if self._token_types:
            kwargs["token_type_ids"] = torch.zeros_like(input_ids)
        with self.encoder.precision.context(device):
            hidden = self._model(**kwargs).last_hidden_state
        pooled = pool_rows(hidden.float(), batch, self.encoder.pooling.mode)
        return self.encoder.head(pooled).cpu().numpy()
