"""The dense representation: sentence-transformers' pipeline after the transformer.

Pooling over the last hidden states (the modes the model's Pooling config declares), then the
modules after it (Dense, Normalize: ``SentenceHead``, workers/model/model_dir.py), in float32.
Every model has this pipeline on its card; a dense model's vectors are its output, and every
copy of the model that ends in pooling (frozen, int8, the CUDA query path, the packed layout)
runs it on its own hidden states.

A batch whose chunks ask for the token states as well (``token_states``, TEI's ``/embed_all``)
gives packed rows instead (workers/model/heads.py): the pooled vector and every token's last
hidden state. Only the eager path computes them: the copies end in pooling (the encoder sends
such a batch to the eager model, ``Encoder.serve_query``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast

import torch
from transformers import AutoModel

from embedfleet.workers.model.base import Forward, Representation
from embedfleet.workers.model.heads import TOKEN_STATES, HeadLayout, TokenHeadModule
from embedfleet.workers.model.model_dir import ModelSpec, SentenceHead, TokenHeads

PoolingMode = Literal["mean", "cls", "lasttoken", "max", "weightedmean", "mean_sqrt_len_tokens"]


@dataclass(frozen=True)
class PoolingConfig:
    modes: tuple[str, ...]
    normalize: bool
    include_prompt: bool = True

    @property
    def mode(self) -> PoolingMode:
        """The single pooling mode (packed layouts support one mode only)."""
        return cast(PoolingMode, self.modes[0])


class Dense(Representation):
    """One vector per text: pooling, then the sentence head."""

    name = "dense"
    auto_model = AutoModel
    ends_in_pooling = True

    def __init__(self, spec: ModelSpec, device: torch.device, hidden_size: int) -> None:
        self.pooling = PoolingConfig(
            modes=spec.pooling_modes,
            normalize=spec.normalize,
            include_prompt=spec.include_prompt,
        )
        self.head = SentenceHead(spec).to(device).eval()
        self.dim = spec.output_dim(hidden_size)
        # the token states beside the pooled vector, where a batch asks for them
        self.token_states = TokenHeadModule(TokenHeads()).to(device).eval()
        self.layout = HeadLayout(
            dense_dim=self.dim, colbert_dim=0, vocab_size=0, hidden_dim=hidden_size
        )

    def heads_for(self, wanted: Sequence[Sequence[str]]) -> tuple[str, ...] | None:
        """("dense", "token_states") where a chunk asks for the token states; None (the
        pooled vectors alone, what every copy of the model gives) otherwise."""
        if any(TOKEN_STATES in names for names in wanted):
            return ("dense", TOKEN_STATES)
        return None

    def pooled(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pooling and the head, on the device the hidden states are on (float32)."""
        if prompt_lengths is not None:
            prompt_lengths = prompt_lengths.to(hidden.device)
        pooled = pool(hidden.float(), attention_mask, self.pooling.modes, prompt_lengths)
        return self.head(pooled)

    def vectors(self, forward: Forward) -> torch.Tensor:
        hidden = forward.output.last_hidden_state
        pooled = self.pooled(hidden, forward.attention_mask, forward.prompt_lengths)
        if forward.heads is None:
            return pooled
        return self.token_states(
            pooled, hidden, forward.input_ids, forward.attention_mask, forward.heads
        )


def pool(
    hidden: torch.Tensor,
    attention_mask: torch.Tensor,
    modes: str | tuple[str, ...],
    prompt_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """sentence-transformers' Pooling over a padded batch (left or right padding): each mode's
    vector, concatenated in the order given. ``prompt_lengths`` leaves each row's first
    prompt tokens out (``include_prompt: false``), keeping the other tokens' positions."""
    if isinstance(modes, str):
        modes = (modes,)
    seq_len = hidden.shape[1]
    positions = torch.arange(seq_len, device=hidden.device).unsqueeze(0)
    leading_pad = attention_mask.to(torch.int32).argmax(dim=1)  # 0 for right padding
    mask = attention_mask
    if prompt_lengths is not None:
        mask = mask.masked_fill(positions < (leading_pad + prompt_lengths).unsqueeze(1), 0)
    float_mask = mask.unsqueeze(-1).to(hidden.dtype)
    outputs: list[torch.Tensor] = []
    for mode in modes:
        if mode == "cls":  # the first token pooled over (after the prompt, if left out)
            first = mask.to(torch.int32).argmax(dim=1)
            outputs.append(hidden[torch.arange(hidden.shape[0], device=hidden.device), first])
        elif mode == "max":
            outputs.append(hidden.masked_fill(float_mask == 0, float("-inf")).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            counts = float_mask.sum(dim=1).clamp(min=1e-9)
            if mode == "mean_sqrt_len_tokens":
                counts = counts.sqrt()
            outputs.append((hidden * float_mask).sum(dim=1) / counts)
        elif mode == "weightedmean":  # weights 1, 2, ... from the first real token
            weights = (positions + 1 - leading_pad.unsqueeze(1)).to(hidden.dtype).unsqueeze(-1)
            weighted = float_mask * weights
            total = weighted.sum(dim=1).clamp(min=1e-9)
            outputs.append((hidden * weighted).sum(dim=1) / total)
        elif mode == "lasttoken":  # the last token pooled over, on either padding side
            values, from_end = mask.flip(1).max(dim=1)
            from_end = torch.where(values == 0, seq_len - 1, from_end)
            last = seq_len - from_end - 1
            rows = torch.arange(hidden.shape[0], device=hidden.device)
            outputs.append((hidden * float_mask)[rows, last])
        else:
            raise ValueError(f"unknown pooling mode {mode!r}")
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
