"""The rerank representation: a cross-encoder's score per (query, document) pair.

The transformer is loaded with its classification head; the scores are its logits through the
activation the model declares, as ``CrossEncoder.predict`` gives them. Pairs are tokenized with
the tokenizer's own pair encoding and cut ``longest_first``, as sentence-transformers'
``Transformer.tokenize`` cuts them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from embedfleet.workers.model.base import CutPair, Forward, Representation
from embedfleet.workers.model.model_dir import ModelSpec


class Rerank(Representation):
    """``num_labels`` scores per pair."""

    name = "rerank"
    auto_model = AutoModelForSequenceClassification

    def __init__(self, spec: ModelSpec, config: Any, transformer_dir: Path) -> None:
        self.dim = int(config.num_labels)  # CrossEncoder.predict's scores
        self.activation = getattr(torch.nn, spec.score_activation)()
        # its own tokenizer instance: the pair call sets truncation on the backend, which the
        # encoder's single-text path configures itself
        self.pair_tokenizer = AutoTokenizer.from_pretrained(transformer_dir)

    def vectors(self, forward: Forward) -> torch.Tensor:
        return self.activation(forward.output.logits.float())

    def cut_pairs(
        self, queries: Sequence[str], documents: Sequence[str], max_length: int
    ) -> list[CutPair]:
        whole = self.pair_tokenizer(list(queries), list(documents), truncation=False)
        cut = self.pair_tokenizer(
            list(queries),
            list(documents),
            truncation="longest_first",
            max_length=max_length,
        )
        # segment ids where the tokenizer declares them (BERT's), as CrossEncoder passes them
        types = cut.get("token_type_ids")
        return [
            (list(ids), len(full) > len(ids), list(types[row]) if types is not None else None)
            for row, (ids, full) in enumerate(
                zip(cut["input_ids"], whole["input_ids"], strict=True)
            )
        ]
