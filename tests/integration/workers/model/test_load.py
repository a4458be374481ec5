"""workers/model/load.py: the class each spec's model is loaded as, and the card the packaged
model's load publishes (the session's shared encoder, loaded once)."""

from __future__ import annotations

from pathlib import Path

import torch

from embedfleet.workers.model.dense import Dense
from embedfleet.workers.model.encoder import Encoder
from embedfleet.workers.model.load import representation_class
from embedfleet.workers.model.model_dir import LinearWeights, ModelSpec, TokenHeads
from embedfleet.workers.model.multivector import MultiVector
from embedfleet.workers.model.rerank import Rerank
from embedfleet.workers.model.sparse import Sparse


def test_each_spec_is_loaded_as_its_representation() -> None:
    here = Path(".")
    assert representation_class(ModelSpec(here)) is Dense
    assert representation_class(ModelSpec(here, representation="sparse")) is Sparse
    assert representation_class(ModelSpec(here, representation="rerank")) is Rerank
    heads = TokenHeads(sparse=LinearWeights(torch.ones(1, 4), None))
    assert representation_class(ModelSpec(here, token_heads=heads)) is MultiVector


def test_the_packaged_models_card(encoder: Encoder) -> None:
    loaded = encoder.loaded
    card = loaded.card("served-name")
    assert (card.name, card.dim, card.max_length, card.hidden_size) == (
        "served-name",
        384,
        256,
        384,
    )
    assert (card.normalize, card.pooling, card.include_prompt) == (True, ("mean",), True)
    assert (card.architecture, card.representations) == ("BertModel", ("dense",))
    assert card.tokenizer_fingerprint == loaded.text.fingerprint != ""
    assert loaded.representation is loaded.sentence, "a dense model's vectors are its pipeline's"
    assert not loaded.model.training
