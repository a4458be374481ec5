"""One forward pass, several representations: BGE-M3's token heads beside the dense vector.

A model directory with ``sparse_linear.pt`` / ``colbert_linear.pt`` (workers/model/model_dir.py,
``TokenHeads``) gives, from the same last hidden states:

- **dense**: the sentence-transformers pipeline (CLS pooling, Normalize for BGE-M3);
- **sparse**: ``relu(sparse_linear(h))``, one weight per token; a token id that occurs several
  times keeps its largest weight, and the CLS, EOS, PAD and UNK ids are left out (FlagEmbedding's
  ``_process_token_weights``);
- **multivector**: ``normalize(colbert_linear(h[1:]))`` for every real token after CLS
  (FlagEmbedding's ``_colbert_embedding`` and ``_process_colbert_vecs``);
- **token states** (``TOKEN_STATES``, any dense model: a chunk's ``token_states``, TEI's
  ``/embed_all``): ``h`` itself for every real token, special tokens included, in float32,
  before pooling (sentence-transformers' ``encode(..., output_value="token_embeddings")``).

The worker's stages pass one float32 matrix per batch from the model to the writer (the CPU
launch, the CUDA copy back, the query stage), so the heads a batch asked for travel packed in it,
one row per text (:class:`HeadLayout`): a header ``[tokens, seq, has_sparse, has_multivector,
has_token_states]``, the dense vector, then the per-position sparse weights and token ids (ids
are exact in float32 below 2**24), then the ``seq - 1`` per-token vectors, then the ``seq``
token states (the real tokens first, whichever side the tokenizer pads).
:meth:`HeadLayout.unpack` turns a row back into what the results carry. Only the heads some
chunk of the batch asked for are computed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from embedfleet.shared.protocol import SparseVector
from embedfleet.workers.model.model_dir import TokenHeads

HEADER = 5  # tokens, seq, has_sparse, has_multivector, has_token_states
# the last hidden state of every token: a head of every model with a dense pipeline, asked by a
# chunk's ``token_states`` (shared/protocol.py), not one of the card's representations
TOKEN_STATES = "token_states"
# the heads of a model, in the order a batch computes them
ALL_HEADS = ("dense", "sparse", "multivector", TOKEN_STATES)


class TokenHeadModule(torch.nn.Module):
    """The sparse and ColBERT linears, float32, on the model's device (none for a dense model:
    its token states alone)."""

    def __init__(self, heads: TokenHeads, unused_ids: Iterable[int] = ()) -> None:
        super().__init__()
        self.sparse = heads.sparse.linear() if heads.sparse is not None else None
        self.colbert = heads.colbert.linear() if heads.colbert is not None else None
        self.register_buffer("unused", torch.tensor(sorted(set(unused_ids)), dtype=torch.int64))

    @property
    def colbert_dim(self) -> int:
        return int(self.colbert.out_features) if self.colbert is not None else 0

    def forward(
        self,
        dense: torch.Tensor,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        wanted: Sequence[str],
    ) -> torch.Tensor:
        """The packed rows (:class:`HeadLayout`) of one padded (right-padded) batch."""
        rows, seq = input_ids.shape
        hidden = hidden.float()
        mask = attention_mask.to(hidden.dtype)
        sparse = "sparse" in wanted and self.sparse is not None
        multi = "multivector" in wanted and self.colbert is not None
        states = TOKEN_STATES in wanted
        header = torch.stack(
            [
                mask.sum(dim=1),
                torch.full((rows,), float(seq), device=hidden.device),
                torch.full((rows,), float(sparse), device=hidden.device),
                torch.full((rows,), float(multi), device=hidden.device),
                torch.full((rows,), float(states), device=hidden.device),
            ],
            dim=1,
        )
        parts = [header, dense.float()]
        if sparse:
            assert self.sparse is not None
            weights = torch.relu(self.sparse(hidden)).squeeze(-1) * mask
            unused = torch.isin(input_ids, self.get_buffer("unused").to(input_ids.device))
            parts += [weights.masked_fill(unused, 0.0), input_ids.to(hidden.dtype)]
        if multi:
            assert self.colbert is not None
            vectors = torch.nn.functional.normalize(self.colbert(hidden[:, 1:]), dim=-1)
            parts.append((vectors * mask[:, 1:, None]).reshape(rows, -1))
        if states:
            # the real tokens first, in order (a stable sort of the padding to the end), so
            # that a row's first ``tokens`` states are its own on either padding side
            order = torch.argsort((attention_mask == 0).to(torch.int8), dim=1, stable=True)
            real_first = hidden.gather(1, order[:, :, None].expand(-1, -1, hidden.shape[-1]))
            parts.append(real_first.reshape(rows, -1))
        return torch.cat(parts, dim=1)


@dataclass(frozen=True)
class HeadRow:
    """One text's representations, unpacked from its row."""

    dense: np.ndarray  # float32 (dense_dim,)
    sparse: SparseVector | None
    multivector: np.ndarray | None  # float32 (tokens - 1, colbert_dim), unit rows
    token_states: np.ndarray | None  # float32 (tokens, hidden_dim)


@dataclass(frozen=True)
class HeadLayout:
    """How a multi-head model's rows are packed (see the module docstring)."""

    dense_dim: int
    colbert_dim: int
    vocab_size: int
    hidden_dim: int  # the transformer's, a token state's width

    def unpack(self, row: np.ndarray) -> HeadRow:
        row = np.asarray(row, dtype=np.float32)
        tokens, seq = int(row[0]), int(row[1])
        has_sparse, has_multi, has_states = bool(row[2]), bool(row[3]), bool(row[4])
        at = HEADER + self.dense_dim
        dense = row[HEADER:at]
        sparse = None
        if has_sparse:
            weights, ids = row[at : at + seq], row[at + seq : at + 2 * seq]
            at += 2 * seq
            sparse = token_weights(weights[:tokens], ids[:tokens].astype(np.int64), self.vocab_size)
        multi = None
        if has_multi:
            width = (seq - 1) * self.colbert_dim
            multi = row[at : at + width].reshape(seq - 1, self.colbert_dim)[: tokens - 1]
            at += width
        states = None
        if has_states:
            width = seq * self.hidden_dim
            states = row[at : at + width].reshape(seq, self.hidden_dim)[:tokens]
        return HeadRow(dense=dense, sparse=sparse, multivector=multi, token_states=states)


def token_weights(weights: np.ndarray, ids: np.ndarray, vocab_size: int) -> SparseVector:
    """Per-token weights as one sparse vector over the vocabulary: each id's largest weight,
    zeros left out, indices ascending."""
    keep = weights > 0
    weights, ids = weights[keep], ids[keep]
    if ids.size == 0:
        return SparseVector(
            indices=np.zeros(0, np.uint32), values=np.zeros(0, np.float32), dim=vocab_size
        )
    order = np.lexsort((-weights, ids))  # by id, the largest weight first
    ids, weights = ids[order], weights[order]
    first = np.concatenate([[True], ids[1:] != ids[:-1]])
    return SparseVector(
        indices=ids[first].astype(np.uint32),
        values=weights[first].astype(np.float32),
        dim=vocab_size,
    )
