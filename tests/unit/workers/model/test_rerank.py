"""workers/model/rerank.py with the packaged tokenizer: (query, document) pairs as the
tokenizer's pair encoding cuts them longest-first with their segment ids, a text alone as one
sequence, rows kept in order; the scores through the model's activation."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.settings import PACKAGED_MODEL
from embedfleet.workers.model.model_dir import ModelSpec
from embedfleet.workers.model.rerank import Rerank

CLS, SEP = 101, 102
PACKAGED: Path = resolve_model_path(PACKAGED_MODEL)


@pytest.fixture(scope="module")
def rerank() -> Rerank:
    spec = ModelSpec(PACKAGED, representation="rerank", score_activation="Sigmoid")
    return Rerank(spec, SimpleNamespace(num_labels=1), PACKAGED)


def test_scores_are_the_logits_through_the_models_activation(rerank: Rerank) -> None:
    assert rerank.dim == 1
    scores = rerank.activate(np.array([[0.0], [2.0]], dtype=np.float64))
    np.testing.assert_allclose(scores, [[0.5], [1 / (1 + np.exp(-2.0))]], rtol=1e-6)
    assert scores.dtype == np.float32


def test_pairs_and_texts_alone_keep_their_rows_order(rerank: Rerank) -> None:
    pair, alone = rerank.cut_pairs(["cat", "dog"], ["a cat sat", None], max_length=32)
    ids, cut, types = pair
    assert ids[0] == CLS and ids.count(SEP) == 2 and not cut
    assert types is not None and types[: ids.index(SEP) + 1] == [0] * (ids.index(SEP) + 1)
    assert set(types[ids.index(SEP) + 1 :]) == {1}, "the document's segment"
    alone_ids, alone_cut, alone_types = alone
    assert alone_ids.count(SEP) == 1, "one sequence, not the pair (text, '')"
    assert not alone_cut and alone_types == [0] * len(alone_ids)


def test_a_long_pair_is_cut_longest_first_to_the_maximum(rerank: Rerank) -> None:
    ((ids, cut, types),) = rerank.cut_pairs(["short query"], [" ".join(["word"] * 50)], 16)
    assert cut and len(ids) == 16 and ids[-1] == SEP
    assert types is not None and types.count(0) == 4, (
        "the query kept whole: [CLS] short query [SEP]"
    )
