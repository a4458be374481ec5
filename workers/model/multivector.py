"""Dense, sparse and multi-vector from one forward pass: BGE-M3's token heads
(workers/model/heads.py) beside the dense pipeline.

A batch computes the heads its chunks want (:meth:`MultiVector.heads_for`); where that is the
dense vector alone, the output is the dense pipeline's, as for a dense model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch

from embedfleet.workers.model.base import Forward, Representation
from embedfleet.workers.model.dense import Dense
from embedfleet.workers.model.heads import ALL_HEADS, HeadLayout, TokenHeadModule
from embedfleet.workers.model.model_dir import TokenHeads, UnsupportedModelError


class MultiVector(Representation):
    """The dense vector, and the token heads' sparse weights and per-token vectors."""

    name = "dense"
    auto_model = Dense.auto_model

    def __init__(
        self,
        dense: Dense,
        heads: TokenHeads,
        tokenizer: Any,
        config: Any,
        device: torch.device,
        model_dir: Path,
    ) -> None:
        """``tokenizer``: the model's; the sparse weights leave out the ids of the CLS, EOS,
        PAD and UNK tokens it declares (FlagEmbedding's)."""
        if tokenizer.padding_side == "left":
            raise UnsupportedModelError(
                f"{model_dir}: sparse/ColBERT token heads are read after CLS at the first "
                "position; this tokenizer pads on the left"
            )
        special = tokenizer.special_tokens_map
        unused = [
            cast(int, tokenizer.convert_tokens_to_ids(special[name]))
            for name in ("cls_token", "eos_token", "pad_token", "unk_token")
            if isinstance(special.get(name), str)
        ]
        self.dense = dense
        self.dim = dense.dim
        self.extra = heads.representations
        self.token_heads = TokenHeadModule(heads, unused).to(device).eval()
        self.layout = HeadLayout(
            dense_dim=self.dim,
            colbert_dim=self.token_heads.colbert_dim,
            vocab_size=int(config.vocab_size),
            hidden_dim=int(config.hidden_size),
        )

    @property
    def representations(self) -> tuple[str, ...]:
        return ("dense", *self.extra)

    def heads_for(self, wanted: Sequence[Sequence[str]]) -> tuple[str, ...] | None:
        """The heads for chunks' ``wanted`` representations (one tuple per chunk, empty: the
        default, dense): None where that is the dense vector alone."""
        union = {name for names in wanted for name in names}
        if union <= {"dense"}:
            return None
        return tuple(name for name in ALL_HEADS if name in union or name == "dense")

    def vectors(self, forward: Forward) -> torch.Tensor:
        hidden = forward.output.last_hidden_state
        dense = self.dense.pooled(hidden, forward.attention_mask, forward.prompt_lengths)
        if forward.heads is None:
            return dense
        # every head on the same hidden states: one forward pass for all of them
        return self.token_heads(
            dense, hidden, forward.input_ids, forward.attention_mask, forward.heads
        )
