"""workers/model/multivector.py: BGE-M3-style token heads beside the packaged model's dense
pipeline (random head weights): what it gives, the heads a batch computes, the special ids the
sparse weights leave out, and the dense vector alone when no chunk asks for more."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.settings import PACKAGED_MODEL
from embedfleet.workers.model.base import Forward
from embedfleet.workers.model.dense import Dense
from embedfleet.workers.model.model_dir import (
    LinearWeights,
    TokenHeads,
    UnsupportedModelError,
    read_model_spec,
)
from embedfleet.workers.model.multivector import MultiVector

PACKAGED: Path = resolve_model_path(PACKAGED_MODEL)
CPU = torch.device("cpu")


def build(padding_side: str = "right") -> MultiVector:
    torch.manual_seed(0)
    heads = TokenHeads(
        sparse=LinearWeights(torch.randn(1, 384), torch.zeros(1)),
        colbert=LinearWeights(torch.randn(8, 384), None),
    )
    tokenizer = AutoTokenizer.from_pretrained(PACKAGED)
    tokenizer.padding_side = padding_side
    dense = Dense(read_model_spec(PACKAGED), CPU, 384)
    return MultiVector(dense, heads, tokenizer, AutoConfig.from_pretrained(PACKAGED), CPU, PACKAGED)


def test_it_gives_the_dense_vector_and_each_heads_representation() -> None:
    multi = build()
    assert multi.representations == ("dense", "sparse", "multivector")
    layout = multi.layout
    assert layout is not None
    assert (layout.dense_dim, layout.colbert_dim, layout.vocab_size) == (384, 8, 30522)
    # [PAD] 0, [UNK] 100, [CLS] 101: BERT declares no EOS token
    assert multi.token_heads.get_buffer("unused").tolist() == [0, 100, 101]


def test_a_batch_computes_the_union_of_its_chunks_heads_in_order() -> None:
    multi = build()
    assert multi.heads_for([[], ["dense"]]) is None, "the dense vector alone"
    assert multi.heads_for([["multivector"], ["sparse"]]) == ("dense", "sparse", "multivector")


def test_without_heads_the_vectors_are_the_dense_pipelines() -> None:
    multi = build()
    hidden = torch.randn(2, 5, 384)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    ids = torch.tensor([[101, 7, 8, 9, 102], [101, 7, 102, 0, 0]])
    forward = Forward(SimpleNamespace(last_hidden_state=hidden), ids, mask)
    with torch.no_grad():
        torch.testing.assert_close(multi.vectors(forward), multi.dense.pooled(hidden, mask))
        packed = multi.vectors(Forward(forward.output, ids, mask, heads=("dense", "sparse")))
    assert multi.layout is not None
    row = multi.layout.unpack(packed[1].numpy())
    assert row.sparse is not None and row.multivector is None
    assert 101 not in row.sparse.indices.tolist(), "CLS is left out of the sparse weights"


def test_a_tokenizer_padding_on_the_left_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="pads on the left"):
        build(padding_side="left")
