"""Sparse (SPLADE) weights and cross-encoder scores, as sentence-transformers computes them.

Tiny random-weight models (tests/model_zoo.py: a BERT with its MLM head under SpladePooling, a
BERT with a classification head), saved by sentence-transformers; the worker's path (tokenize,
length-sorted padded batches, forward, head, the results the worker writes) against
``SparseEncoder.encode`` (same non-zero indices, values within float tolerance, and
``max_active_dims``) and ``CrossEncoder.predict`` (scores within 1e-4, the same order).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from embedfleet.shared.protocol import Chunk, decode_result, encode_result
from embedfleet.shared.settings import Settings
from embedfleet.workers.batcher import plan_batches
from embedfleet.workers.calibration import CalibrationStore
from embedfleet.workers.encoder import Encoder
from embedfleet.workers.model_dir import read_model_spec
from embedfleet.workers.output import Outputs
from tests.model_zoo import corpus_lines, cross_encoder_dir, splade_dir

SCORE_TOLERANCE = 1e-4
WEIGHT_TOLERANCE = 1e-4


def texts() -> list[str]:
    lines = corpus_lines()
    return ["hi", "What does the garbage collector do?", *lines[5:4000:400], " ".join(lines[:60])]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zoo-representations")


def fleet_rows(encoder: Encoder, tokens: list) -> np.ndarray:  # type: ignore[type-arg]
    """The worker's batching: length-sorted batches under a token budget, padded."""
    rows = np.zeros((len(tokens), encoder.dim), dtype=np.float32)
    for planned in plan_batches([t.length for t in tokens], token_budget=256, max_batch=5):
        rows[planned.positions] = encoder.embed(
            encoder.collate([tokens[p] for p in planned.positions])
        )
    return rows


def outputs(encoder: Encoder) -> Outputs:
    # no calibration is read: sparse weights and scores are never quantized
    return Outputs(Settings(), encoder, CalibrationStore(None, None, encoder.name))  # type: ignore[arg-type]


# --- sparse ---------------------------------------------------------------------------
@pytest.mark.parametrize(("strategy", "activation"), [("max", "relu"), ("sum", "log1p_relu")])
def test_splade_matches_sparse_encoder(zoo: Path, strategy: str, activation: str) -> None:
    from sentence_transformers import SparseEncoder

    model_dir = splade_dir(zoo, strategy=strategy, activation=activation)
    assert read_model_spec(model_dir).representation == "sparse"
    encoder = Encoder(str(model_dir), device="cpu")
    assert encoder.card.representations == ("sparse",)
    inputs = texts()
    chunks = [Chunk(id=f"c{i}", text=text) for i, text in enumerate(inputs)]
    tokens = encoder.tokenize(inputs)
    # through the results the worker writes, on the wire and back
    results = [
        decode_result(encode_result(r))
        for r in outputs(encoder).results(
            chunks, fleet_rows(encoder, tokens), [t.truncated for t in tokens]
        )
    ]
    theirs = SparseEncoder(str(model_dir), device="cpu").encode(inputs, batch_size=4)
    theirs = theirs.to_dense().numpy()
    assert results[-1].truncated and not results[0].truncated
    for row, result in enumerate(results):
        assert result.sparse is not None
        expected = np.flatnonzero(theirs[row])
        assert expected.size > 0
        np.testing.assert_array_equal(result.sparse.indices, expected, err_msg=inputs[row])
        np.testing.assert_allclose(
            result.sparse.values, theirs[row][expected], rtol=WEIGHT_TOLERANCE, atol=1e-5
        )
        assert result.sparse.dim == theirs.shape[1]
    print(
        f"SPARSE {strategy}/{activation}: {np.mean([r.sparse.indices.size for r in results]):.0f} active"
    )


def test_max_active_dims_matches_sparse_encoder(zoo: Path) -> None:
    from sentence_transformers import SparseEncoder

    model_dir = splade_dir(zoo)
    encoder = Encoder(str(model_dir), device="cpu")
    inputs = texts()
    tokens = encoder.tokenize(inputs)
    chunks = [Chunk(id=f"c{i}", text=t, max_active_dims=7) for i, t in enumerate(inputs)]
    results = outputs(encoder).results(chunks, fleet_rows(encoder, tokens), [False] * len(inputs))
    theirs = SparseEncoder(str(model_dir), device="cpu").encode(inputs, max_active_dims=7)
    theirs = theirs.to_dense().numpy()
    for row, result in enumerate(results):
        assert result.sparse is not None and result.sparse.indices.size == 7
        np.testing.assert_array_equal(result.sparse.indices, np.flatnonzero(theirs[row]))
        np.testing.assert_allclose(
            result.sparse.values, theirs[row][result.sparse.indices], rtol=1e-4
        )


# --- rerank ---------------------------------------------------------------------------
def pairs() -> list[tuple[str, str]]:
    lines = corpus_lines()
    query = "How do I catch an exception?"
    documents = [*lines[7:4000:300], " ".join(lines[200:260]), "try except"]
    return [(query, document) for document in documents] + [(lines[3], lines[4])]


def test_cross_encoder_matches_predict(zoo: Path) -> None:
    from sentence_transformers import CrossEncoder

    model_dir = cross_encoder_dir(zoo)
    assert read_model_spec(model_dir).representation == "rerank"
    encoder = Encoder(str(model_dir), device="cpu")
    assert encoder.card.representations == ("rerank",) and encoder.dim == 1
    queries, documents = zip(*pairs(), strict=True)
    tokens = encoder.tokenize_pairs(queries, documents)
    assert any(t.truncated for t in tokens) and any(t.type_ids and 1 in t.type_ids for t in tokens)
    chunks = [Chunk(id=f"p{i}", text=q, pair=d) for i, (q, d) in enumerate(pairs())]
    results = [
        decode_result(encode_result(r))
        for r in outputs(encoder).results(
            chunks, fleet_rows(encoder, tokens), [t.truncated for t in tokens]
        )
    ]
    ours = np.array([r.score for r in results])
    theirs = CrossEncoder(str(model_dir), device="cpu").predict(pairs(), batch_size=4)
    np.testing.assert_allclose(ours, theirs, atol=SCORE_TOLERANCE)
    assert np.ptp(theirs) > 100 * SCORE_TOLERANCE  # the scores differ enough to rank by
    assert list(np.argsort(-ours, kind="stable")) == list(np.argsort(-theirs, kind="stable"))
    print(f"RERANK max |diff| {np.abs(ours - theirs).max():.2e}, spread {np.ptp(theirs):.4f}")


def test_cross_encoder_with_two_labels_matches_predict(zoo: Path) -> None:
    from sentence_transformers import CrossEncoder

    model_dir = cross_encoder_dir(zoo, num_labels=2)
    encoder = Encoder(str(model_dir), device="cpu")
    queries, documents = zip(*pairs(), strict=True)
    ours = fleet_rows(encoder, encoder.tokenize_pairs(queries, documents))
    theirs = CrossEncoder(str(model_dir), device="cpu").predict(pairs())
    assert ours.shape == theirs.shape == (len(pairs()), 2)
    np.testing.assert_allclose(ours, theirs, atol=SCORE_TOLERANCE)


def test_options_the_model_does_not_serve_are_refused(zoo: Path) -> None:
    sparse = outputs(Encoder(str(splade_dir(zoo)), device="cpu"))
    rerank = outputs(Encoder(str(cross_encoder_dir(zoo)), device="cpu"))
    for out, chunk, reason in [
        (sparse, Chunk(id="a", text="x", pair="y"), "serves sparse, not rerank"),
        (sparse, Chunk(id="a", text="x", representations=("dense",)), "not dense"),
        (sparse, Chunk(id="a", text="x", dimensions=8), "shape dense vectors"),
        (rerank, Chunk(id="a", text="x"), "give the document as 'pair'"),
        (rerank, Chunk(id="a", text="x", pair="y", max_active_dims=3), "prunes sparse"),
    ]:
        with pytest.raises(ValueError, match=reason):
            out.prompt_for(chunk, "document")
    sparse.prompt_for(Chunk(id="a", text="x", representations=("sparse",)), "document")
    rerank.prompt_for(Chunk(id="a", text="x", pair="y"), "query")
