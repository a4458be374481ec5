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
import redis.asyncio as aioredis

from embedfleet.producer import Producer
from embedfleet.shared.protocol import Chunk, decode_result, encode_result
from embedfleet.shared.settings import Settings
from embedfleet.workers.batcher import plan_batches
from embedfleet.workers.calibration import CalibrationStore
from embedfleet.workers.model.encoder import Encoder
from embedfleet.workers.model.model_dir import read_model_spec
from embedfleet.workers.output import Outputs
from tests.conftest import WorkerLauncher
from tests.model_zoo import (
    classified_alone,
    corpus_lines,
    cross_encoder_dir,
    sample_texts,
    splade_dir,
)

SCORE_TOLERANCE = 1e-4
WEIGHT_TOLERANCE = 1e-4


def texts() -> list[str]:
    return sample_texts(5, 400)


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
@pytest.mark.parametrize(
    ("strategy", "activation", "modern"),
    [("max", "relu", False), ("sum", "log1p_relu", False), ("max", "relu", True)],
)
def test_splade_matches_sparse_encoder(
    zoo: Path, strategy: str, activation: str, modern: bool
) -> None:
    from sentence_transformers import SparseEncoder

    model_dir = splade_dir(zoo, strategy=strategy, activation=activation, modern=modern)
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
    active = np.mean([r.sparse.indices.size for r in results if r.sparse is not None])
    print(f"SPARSE {strategy}/{activation}: {active:.0f} of {theirs.shape[1]} active")


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


# texts a cross-encoder classifies alone: short, and one over the model's maximum (cut)
LONELY = ["a lonely query", "try except", " ".join(corpus_lines()[300:360])]


def test_a_text_alone_is_one_sequence_as_the_classification_pipeline_gives(zoo: Path) -> None:
    """A text without a document is tokenized alone (not as the pair (text, "")) and scored as
    AutoModelForSequenceClassification scores it, in a batch beside pairs too."""
    from transformers import AutoTokenizer

    model_dir = cross_encoder_dir(zoo, num_labels=2)
    encoder = Encoder(str(model_dir), device="cpu")
    mixed = [(text, None) for text in LONELY] + pairs()[:3]
    tokens = encoder.tokenize([q for q, _ in mixed], pairs=[d for _, d in mixed])
    alone = AutoTokenizer.from_pretrained(model_dir)(
        LONELY, truncation=True, max_length=encoder.max_length
    )
    assert [t.ids for t in tokens[:3]] == alone["input_ids"] and tokens[2].truncated
    ours = fleet_rows(encoder, tokens)
    np.testing.assert_allclose(ours[:3], classified_alone(model_dir, LONELY), atol=SCORE_TOLERANCE)
    as_pairs = fleet_rows(encoder, encoder.tokenize_pairs(LONELY, [""] * len(LONELY)))
    assert np.abs(as_pairs - ours[:3]).max() > 100 * SCORE_TOLERANCE  # another input


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
        (rerank, Chunk(id="a", text="x", pair="y", max_active_dims=3), "prunes sparse"),
    ]:
        with pytest.raises(ValueError, match=reason):
            out.prompt_for(chunk, "document")
    sparse.prompt_for(Chunk(id="a", text="x", representations=("sparse",)), "document")
    rerank.prompt_for(Chunk(id="a", text="x", pair="y"), "query")
    rerank.prompt_for(Chunk(id="a", text="x"), "query")  # a text alone: classified


# --- through Redis and a worker -------------------------------------------------------------
async def test_sparse_through_a_worker(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, zoo: Path
) -> None:
    """Query stream, interactive stream and bulk (a job's results stream) all give SparseEncoder's
    weights; the card says the fleet serves sparse."""
    from sentence_transformers import SparseEncoder

    model_dir = splade_dir(zoo)
    encoder = Encoder(str(model_dir), device="cpu")
    inputs = texts()
    async with Producer(settings, client) as producer, workers.run(settings, encoder=encoder):
        card = await producer.model_card()
        queried = await producer.embed_sparse(inputs[:3], timeout=30)
        pruned = await producer.embed_sparse(inputs[:3], timeout=30, max_active_dims=5)
        interactive = await producer.embed_sparse(inputs, timeout=60, lane="texts")
        chunks = [
            Chunk(id=f"d{i}", text=t, representations=("sparse",)) for i, t in enumerate(inputs)
        ]
        await producer.enqueue(chunks, job="sparse-job")
        await producer.wait_for_job("sparse-job", timeout=120)
        bulk = {r.id: r async for r in producer.results(job="sparse-job")}
        with pytest.raises(ValueError, match="serves sparse, not rerank"):
            await producer.rerank("q", ["d"], timeout=5)
    assert card is not None and card.representations == ("sparse",)
    theirs = SparseEncoder(str(model_dir), device="cpu").encode(inputs).to_dense().numpy()
    top5 = SparseEncoder(str(model_dir), device="cpu").encode(inputs[:3], max_active_dims=5)
    top5 = top5.to_dense().numpy()
    bulk_vectors = [bulk[f"d{i}"].sparse for i in range(len(inputs))]
    for row, vector in [*enumerate(queried), *enumerate(interactive), *enumerate(bulk_vectors)]:
        assert vector is not None
        np.testing.assert_array_equal(vector.indices, np.flatnonzero(theirs[row]))
        np.testing.assert_allclose(vector.values, theirs[row][vector.indices], rtol=1e-4, atol=1e-5)
    for row, vector in enumerate(pruned):
        np.testing.assert_array_equal(vector.indices, np.flatnonzero(top5[row]))


async def test_rerank_through_a_worker(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, zoo: Path
) -> None:
    """Pairs scored on the query stream and in bulk as CrossEncoder.predict scores them; a text
    without a document classified alone, one sequence, on both paths and beside pairs."""
    from sentence_transformers import CrossEncoder

    model_dir = cross_encoder_dir(zoo)
    encoder = Encoder(str(model_dir), device="cpu")
    query, documents = pairs()[0][0], [d for _, d in pairs()[:-1]]
    async with Producer(settings, client) as producer, workers.run(settings, encoder=encoder):
        scores = await producer.rerank(query, documents, timeout=30)
        chunks = [Chunk(id=f"p{i}", text=query, pair=d) for i, d in enumerate(documents)]
        await producer.enqueue(chunks, job="pairs")
        await producer.wait_for_job("pairs", timeout=120)
        bulk = {r.id: r.score async for r in producer.results(job="pairs")}
        alone = await producer.score_pairs(
            [(lonely, None) for lonely in LONELY] + [(query, documents[0])], timeout=30
        )
        await producer.enqueue(
            [Chunk(id=f"t{i}", text=lonely) for i, lonely in enumerate(LONELY)], job="alone"
        )
        await producer.wait_for_job("alone", timeout=120)
        bulk_alone = {r.id: r.score async for r in producer.results(job="alone")}
    theirs = CrossEncoder(str(model_dir), device="cpu").predict([(query, d) for d in documents])
    np.testing.assert_allclose(scores, theirs, atol=SCORE_TOLERANCE)
    np.testing.assert_allclose(
        [bulk[f"p{i}"] for i in range(len(documents))], theirs, atol=SCORE_TOLERANCE
    )
    assert list(np.argsort(-scores, kind="stable")) == list(np.argsort(-theirs, kind="stable"))
    reference = classified_alone(model_dir, LONELY)[:, 0]
    np.testing.assert_allclose(alone[:, 0], [*reference, theirs[0]], atol=SCORE_TOLERANCE)
    np.testing.assert_allclose(
        [bulk_alone[f"t{i}"] for i in range(len(LONELY))], reference, atol=SCORE_TOLERANCE
    )


def test_a_sparse_encoder_with_other_modules_is_refused(zoo: Path, tmp_path: Path) -> None:
    """A SparseEncoder the worker cannot reproduce (here: a module after SpladePooling) is
    refused at load, naming what it has, rather than served with different weights."""
    from embedfleet.workers.model.model_dir import UnsupportedModelError
    from tests.model_zoo import with_extra_module

    broken = with_extra_module(
        splade_dir(zoo), tmp_path / "broken", "sentence_transformers.base.modules.Normalize"
    )
    with pytest.raises(UnsupportedModelError, match="MLMTransformer \\+ SpladePooling only"):
        Encoder(str(broken), device="cpu")


def test_a_database_sink_is_refused_for_sparse_and_rerank_models(zoo: Path, tmp_path: Path) -> None:
    """Until the sinks store sparse vectors and scores, such a worker refuses to start with one
    (instead of failing every write); the results stream is accepted."""
    from embedfleet.workers.model.model_dir import UnsupportedModelError
    from embedfleet.workers.runtime import check_sink_holds

    encoder = Encoder(str(splade_dir(zoo)), device="cpu")
    lancedb = Settings(sink=f"lancedb://{tmp_path}/out")
    with pytest.raises(UnsupportedModelError, match="EMBEDFLEET_SINK=redis"):
        check_sink_holds(lancedb, encoder)
    check_sink_holds(Settings(sink="redis"), encoder)


def test_a_cross_encoder_without_sentence_transformers_files_matches_predict(zoo: Path) -> None:
    """A bare ``*ForSequenceClassification`` directory (a cross-encoder saved before
    sentence-transformers v4) is served as ``CrossEncoder(path)`` loads it."""
    from sentence_transformers import CrossEncoder

    cross_encoder_dir(zoo)
    bare = zoo / "hf-bert-cls-1"
    assert not (bare / "modules.json").exists()
    encoder = Encoder(str(bare), device="cpu")
    assert encoder.representation == "rerank"
    queries, documents = zip(*pairs(), strict=True)
    # the model's rows are its logits; its activation makes them CrossEncoder.predict's scores
    logits = fleet_rows(encoder, encoder.tokenize_pairs(queries, documents))
    ours = encoder.activate(logits)[:, 0]
    theirs = CrossEncoder(str(bare), device="cpu").predict(pairs())
    np.testing.assert_allclose(ours, theirs, atol=SCORE_TOLERANCE)
