"""workers/model/heads.py: the rows a multi-head forward packs, and their unpacking: the dense
vector, the sparse weights (each id's largest, special ids left out), the ColBERT vectors after
CLS (unit rows) and the token states of the real tokens; token_weights on its own."""

from __future__ import annotations

import numpy as np
import torch

from embedfleet.workers.model.heads import HeadLayout, TokenHeadModule, token_weights
from embedfleet.workers.model.model_dir import LinearWeights, TokenHeads

HIDDEN = torch.tensor(
    [
        [[1.0, 0.0], [0.0, 2.0], [3.0, 1.0], [0.0, 0.0]],
        [[2.0, 2.0], [1.0, -5.0], [0.0, 0.0], [0.0, 0.0]],
    ]
)
IDS = torch.tensor([[101, 7, 7, 0], [101, 9, 0, 0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
DENSE = torch.tensor([[0.6, 0.8], [1.0, 0.0]])


def module() -> TokenHeadModule:
    heads = TokenHeads(
        sparse=LinearWeights(torch.tensor([[1.0, 1.0]]), None),  # weight = relu(h0 + h1)
        colbert=LinearWeights(torch.eye(2), torch.zeros(2)),
    )
    return TokenHeadModule(heads, unused_ids=[101, 0])  # CLS and PAD


def test_every_head_round_trips_through_a_packed_row() -> None:
    heads = module()
    assert heads.colbert_dim == 2
    with torch.inference_mode():  # as the worker runs its forward
        rows = heads(DENSE, HIDDEN, IDS, MASK, ("dense", "sparse", "multivector", "token_states"))
    layout = HeadLayout(dense_dim=2, colbert_dim=2, vocab_size=200, hidden_dim=2)
    first, second = (layout.unpack(row) for row in rows.numpy())
    np.testing.assert_allclose(first.dense, [0.6, 0.8])
    assert first.sparse is not None and second.sparse is not None
    # id 7 twice (weights 2 and 4): the largest kept; CLS left out
    assert (first.sparse.indices.tolist(), first.sparse.values.tolist()) == ([7], [4.0])
    assert second.sparse.indices.size == 0, "relu(1 - 5) is 0: nothing kept"
    assert first.multivector is not None and first.multivector.shape == (2, 2)
    np.testing.assert_allclose(
        first.multivector, [[0.0, 1.0], [3 / 10**0.5, 1 / 10**0.5]], rtol=1e-6
    )
    assert second.multivector is not None and second.multivector.shape == (1, 2)
    assert first.token_states is not None and second.token_states is not None
    np.testing.assert_array_equal(first.token_states, HIDDEN[0, :3].numpy())
    np.testing.assert_array_equal(second.token_states, HIDDEN[1, :2].numpy())


def test_only_the_heads_asked_for_are_packed() -> None:
    rows = module()(DENSE, HIDDEN, IDS, MASK, ("dense",))
    assert rows.shape == (2, 5 + 2), "the header and the dense vector alone"
    row = HeadLayout(2, 2, 200, 2).unpack(rows[0].numpy())
    assert (row.sparse, row.multivector, row.token_states) == (None, None, None)


def test_token_states_put_a_left_padded_rows_real_tokens_first() -> None:
    left_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    rows = TokenHeadModule(TokenHeads())(DENSE, HIDDEN, IDS, left_mask, ("token_states",))
    row = HeadLayout(2, 0, 0, 2).unpack(rows[0].numpy())
    assert row.token_states is not None
    np.testing.assert_array_equal(row.token_states, HIDDEN[0, 1:].numpy())


def test_token_weights_keep_each_ids_largest_positive_weight_in_id_order() -> None:
    vector = token_weights(
        np.array([0.5, 0.0, 2.0, 1.0, 0.25], np.float32), np.array([9, 3, 4, 9, 4]), 50
    )
    assert vector.indices.tolist() == [4, 9]
    assert vector.values.tolist() == [2.0, 1.0]
    assert (vector.indices.dtype, vector.values.dtype, vector.dim) == (np.uint32, np.float32, 50)
    empty = token_weights(np.zeros(3, np.float32), np.array([1, 2, 3]), 50)
    assert empty.indices.size == 0 and empty.dim == 50
