"""The rerank representation: a cross-encoder's score per (query, document) pair, or per
text alone (a sequence classifier's input: TEI's single-text ``/predict``).

The transformer is loaded with its classification head; its rows are the logits, and the scores
are those through the activation the model declares (``activate``), as ``CrossEncoder.predict``
gives them, applied per chunk on the way out (workers/output.py), so a chunk may ask for the
logits themselves (``raw_scores``, TEI's). Pairs are tokenized with
the tokenizer's own pair encoding and cut ``longest_first``, as sentence-transformers'
``Transformer.tokenize`` cuts them; a text alone with the tokenizer called on it alone, cut to
the maximum, as the transformers text-classification pipeline tokenizes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
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
        return forward.output.logits.float()

    def activate(self, rows: np.ndarray) -> np.ndarray:
        """``CrossEncoder.predict``'s scores of logits ``rows`` (batch, labels): the model's
        activation, in float32 on the CPU, as CrossEncoder applies it."""
        logits = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
        with torch.no_grad():
            return self.activation(logits).numpy()

    def cut_pairs(
        self, queries: Sequence[str], documents: Sequence[str | None], max_length: int
    ) -> list[CutPair]:
        # a text without a document is tokenized alone, one sequence (TEI's single-text
        # /predict, the text-classification pipeline), never as the pair (text, ""): that adds
        # a [SEP] and another segment, and the model scores another input
        cuts: list[CutPair | None] = [None] * len(queries)
        paired = [row for row, document in enumerate(documents) if document is not None]
        alone = [row for row, document in enumerate(documents) if document is None]
        for rows, second in ((paired, [documents[row] for row in paired]), (alone, None)):
            if rows:
                firsts = [queries[row] for row in rows]
                for row, cut in zip(rows, self._cut(firsts, second, max_length), strict=True):
                    cuts[row] = cut
        return [cut for cut in cuts if cut is not None]

    def _cut(
        self, firsts: list[str], seconds: list[str | None] | None, max_length: int
    ) -> list[CutPair]:
        texts = (firsts,) if seconds is None else (firsts, seconds)
        whole = self.pair_tokenizer(*texts, truncation=False)
        cut = self.pair_tokenizer(*texts, truncation="longest_first", max_length=max_length)
        # segment ids where the tokenizer declares them (BERT's), as CrossEncoder passes them
        types = cut.get("token_type_ids")
        return [
            (list(ids), len(full) > len(ids), list(types[row]) if types is not None else None)
            for row, (ids, full) in enumerate(
                zip(cut["input_ids"], whole["input_ids"], strict=True)
            )
        ]
