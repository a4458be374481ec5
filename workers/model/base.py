"""The contract of one representation: what a model gives from one forward pass.

The encoder (workers/model/encoder.py) holds the tokenizer and the transformer (loaded by
workers/model/load.py) and the forward path chosen once at start (workers/model/forward.py);
what becomes of the transformer's output depends on the kind of model, and that is one small
class per representation (TEI's Python backend has one class per
head the same way): ``dense`` (workers/model/dense.py, the sentence-transformers pipeline),
``multivector`` (workers/model/multivector.py, BGE-M3's token heads beside the dense vector),
``sparse`` (workers/model/sparse.py, SPLADE) and ``rerank`` (workers/model/rerank.py, a
cross-encoder's score per pair). One is built at load; the eager path calls it once per batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from embedfleet.workers.model.heads import HeadLayout

# one (query, document) pair cut to fit: its token ids, whether it lost some, its segment ids
CutPair = tuple[list[int], bool, list[int] | None]


@dataclass(frozen=True)
class Forward:
    """One batch's forward pass, on the model's device: what a representation reads."""

    output: Any  # the transformer's output (its last hidden states, or its logits)
    input_ids: torch.Tensor  # (batch, seq)
    attention_mask: torch.Tensor  # (batch, seq)
    prompt_lengths: torch.Tensor | None = None  # (batch,), when pooling leaves prompts out
    # a multi-head model's heads to compute (workers/model/heads.py); None: its default
    heads: tuple[str, ...] | None = None


class Representation(ABC):
    """What the transformer's output becomes, for one kind of model."""

    name: ClassVar[str]
    # the transformers Auto class that loads the weights this representation reads
    auto_model: ClassVar[Any]
    # ends in the sentence pipeline's pooling, as the frozen, int8, CUDA-query and packed copies
    # of the model do: they are used only for such a model
    ends_in_pooling: ClassVar[bool] = False
    dim: int
    layout: HeadLayout | None = None  # where each head's values sit in a packed row

    @property
    def representations(self) -> tuple[str, ...]:
        """Everything one forward pass gives (the card's ``representations``)."""
        return (self.name,)

    def heads_for(self, wanted: Sequence[Sequence[str]]) -> tuple[str, ...] | None:
        """The heads a batch computes for its chunks' wanted representations; None: the one
        this representation gives."""
        return None

    @abstractmethod
    def vectors(self, forward: Forward) -> torch.Tensor:
        """One row per text from the transformer's output for the batch, on its device."""

    def activate(self, rows: np.ndarray) -> np.ndarray:
        """Rows of :meth:`vectors` as the model answers them by default: a cross-encoder's
        logits through its activation; any other representation's as they are."""
        return rows

    def cut_pairs(
        self, queries: Sequence[str], documents: Sequence[str | None], max_length: int
    ) -> list[CutPair]:
        """(query, document) pairs tokenized and cut to ``max_length``: a cross-encoder's (a
        document None: the query alone, one sequence)."""
        raise ValueError("pairs are scored by a cross-encoder; this model is not one")
