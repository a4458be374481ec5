"""A dense model's token states (a chunk's ``token_states``, TEI's /embed_all) on the worker's
side, with the packaged MiniLM: computed on the eager model whatever path queries take, shaped
as sentence-transformers' ``output_value="token_embeddings"``, on either padding side, kept
apart from the pooled vector in the content key, and refused where the bulk path packs its
batches (the varlen layout gives pooled vectors alone)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.protocol import Chunk, decode_result, encode_result
from embedfleet.shared.settings import Settings
from embedfleet.workers.calibration import CalibrationStore
from embedfleet.workers.model.encoder import Encoder
from embedfleet.workers.model.heads import TOKEN_STATES, HeadLayout, TokenHeadModule
from embedfleet.workers.model.model_dir import TokenHeads
from embedfleet.workers.output import OutputOptionError, Outputs

MODEL = "all-MiniLM-L6-v2"
TEXTS = ["hello world", "a longer sentence about token states and pooling", "x"]


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    return Encoder(MODEL, device="cpu", dtype="float32")


def outputs(encoder: Encoder, **settings: object) -> Outputs:
    return Outputs(Settings(**settings), encoder, CalibrationStore(None, None, encoder.name))  # type: ignore[arg-type]


class PooledCopy:
    """A query path that ends in pooling, as the frozen, int8 and engine copies do."""

    name, kind = "stand-in copy", "frozen"

    def serve(self, batch: object) -> tuple[np.ndarray, str]:
        raise AssertionError("a batch that asks for token states went to a pooled copy")


def test_token_states_are_sentence_transformers_token_embeddings(encoder: Encoder) -> None:
    """Through the worker's output stage and the wire: each chunk that asks gets every token's
    state ([CLS] and [SEP] included) in float32 beside its pooled vector; a chunk of the same
    batch that does not ask gets its pooled vector alone. The batch runs eager although the
    query path is a copy that ends in pooling."""
    from sentence_transformers import SentenceTransformer

    out = outputs(encoder)
    chunks = [Chunk(id=str(i), text=text, token_states=True) for i, text in enumerate(TEXTS)]
    chunks[2] = Chunk(id="2", text=TEXTS[2])
    batch = encoder.collate(encoder.tokenize(TEXTS))
    batch.heads = out.heads_for(chunks)
    assert batch.heads == ("dense", TOKEN_STATES)
    encoder.query_path = PooledCopy()  # type: ignore[assignment]
    try:
        rows, path = encoder.serve_query(batch)
    finally:
        encoder.query_path = encoder.eager
    assert path == "eager"
    results = [
        decode_result(encode_result(result))
        for result in out.results(chunks, rows, [False] * len(chunks))
    ]
    model = SentenceTransformer(str(resolve_model_path(MODEL)), device="cpu")
    theirs = model.encode(TEXTS, output_value="token_embeddings")
    pooled = model.encode(TEXTS)
    for result, states, vector in zip(results[:2], theirs[:2], pooled[:2], strict=True):
        assert result.multivector is not None and result.multivector.dtype == "float32"
        np.testing.assert_allclose(result.multivector.floats(), states.numpy(), atol=1e-5)
        np.testing.assert_allclose(result.vector, vector, atol=2e-3)  # the fp16 vector
    assert results[2].multivector is None
    np.testing.assert_allclose(results[2].vector, pooled[2], atol=2e-3)


def test_left_padding_keeps_each_rows_own_states() -> None:
    """The packed row holds the real tokens first on either padding side: a left-padded batch
    (a decoder's tokenizer) gives the same states as the right-padded one."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 8)
    right_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    left_hidden = torch.cat([hidden[:1, 3:], hidden[:1, :3]], dim=1)  # the pads moved first
    left_hidden = torch.cat([left_hidden, hidden[1:]])
    left_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    module = TokenHeadModule(TokenHeads())
    layout = HeadLayout(dense_dim=8, colbert_dim=0, vocab_size=0, hidden_dim=8)
    ids = torch.zeros(2, 5, dtype=torch.int64)
    wanted = ("dense", TOKEN_STATES)
    right = module(hidden[:, 0], hidden, ids, right_mask, wanted).numpy()
    left = module(hidden[:, 0], left_hidden, ids, left_mask, wanted).numpy()
    for row in range(2):
        states = layout.unpack(right[row]).token_states
        assert states is not None and states.shape == (int(right_mask[row].sum()), 8)
        np.testing.assert_array_equal(states, hidden[row, : states.shape[0]].numpy())
        np.testing.assert_array_equal(layout.unpack(left[row]).token_states, states)


def test_token_states_have_a_content_key_of_their_own(encoder: Encoder) -> None:
    """The vector cache never answers token states with a pooled vector, nor the reverse."""
    out = outputs(encoder)
    pooled = out.content_key(Chunk(id="a", text="same"), "")
    states = out.content_key(Chunk(id="b", text="same", token_states=True), "")
    assert pooled is not None and states is not None and pooled != states


def test_token_states_are_refused_where_they_cannot_be_computed(encoder: Encoder) -> None:
    """On the bulk path of a worker that packs its batches (varlen), and with long inputs
    embedded whole: refused with the reason and the way out, never answered without them."""
    asks = Chunk(id="a", text="t", token_states=True)
    packed = outputs(encoder, layout="varlen")
    with pytest.raises(OutputOptionError, match="EMBEDFLEET_LAYOUT=padded"):
        packed.prompt_for(asks, "document")
    assert packed.prompt_for(asks, "query") == ""  # the query stage's batches are padded
    assert outputs(encoder).prompt_for(asks, "document") == ""
    with pytest.raises(OutputOptionError, match="window_overlap"):
        outputs(encoder).prompt_for(
            Chunk(id="a", text="t", token_states=True, window_overlap=8), "document"
        )
