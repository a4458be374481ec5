"""The sparse representation (SPLADE): one weight per vocabulary entry, from the MLM head.

The transformer is loaded with its masked-language-model head (vocabulary logits); the
weights are sentence-transformers' SpladePooling of them (its strategy and activation, read
from the model directory).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForMaskedLM

from embedfleet.workers.model.base import Forward, Representation
from embedfleet.workers.model.model_dir import ModelSpec


class Sparse(Representation):
    """A vocabulary-wide weight vector per text, mostly zeros."""

    name = "sparse"
    auto_model = AutoModelForMaskedLM

    def __init__(self, spec: ModelSpec, config: Any) -> None:
        self.strategy = spec.splade_strategy
        self.activation = spec.splade_activation
        self.dim = int(config.vocab_size)  # one weight per vocabulary entry

    def vectors(self, forward: Forward) -> torch.Tensor:
        logits = forward.output.logits.float()
        return splade_pool(logits, forward.attention_mask, self.strategy, self.activation)


def splade_pool(
    logits: torch.Tensor, attention_mask: torch.Tensor, strategy: str, activation: str
) -> torch.Tensor:
    """sentence-transformers' SpladePooling over a padded batch: ``log(1 + relu(logits))``
    (twice log1p for ``log1p_relu``) of the real tokens, max- or sum-pooled over the sequence:
    (batch, vocab), mostly zeros. Padding counts as 0, as SpladePooling masks it (every
    weight is >= 0, so a zero never wins a max over a real one)."""
    # in place on the logits (the caller's to spend): they are (batch, seq, vocab) wide, a
    # copy per step would triple the peak memory of the widest tensor the worker makes
    weights = logits.mul_(attention_mask.unsqueeze(-1).to(logits.dtype)).relu_().log1p_()
    if activation == "log1p_relu":
        weights = weights.log1p_()
    return weights.amax(dim=1) if strategy == "max" else weights.sum(dim=1)
