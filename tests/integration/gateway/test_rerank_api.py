"""The gateway's sparse and rerank routes over a real Redis, a real worker and real HTTP.

TEI's ``/embed_sparse`` and ``/rerank`` and the Cohere/Jina-shaped ``/v1/rerank``, each against
sentence-transformers on the same tiny random-weight model directory (tests/model_zoo.py), and
each refused in its dialect where the served model lacks the representation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from embedfleet.server import ServerProcess, isolated_settings
from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.settings import Settings
from embedfleet.workers.model.encoder import Encoder
from tests.conftest import WorkerLauncher
from tests.gateway_support import running_gateway
from tests.model_zoo import classified_alone, corpus_lines, cross_encoder_dir, splade_dir

QUERY = "How do I catch an exception?"


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zoo-gateway")


def documents() -> list[str]:
    lines = corpus_lines()
    return [*lines[11:4000:500], "try except finally"]


@contextlib.asynccontextmanager
async def fleet(
    redis_server: ServerProcess, tmp_path: Path, model_dir: Path
) -> AsyncIterator[httpx.AsyncClient]:
    """A worker serving ``model_dir`` in this process, a gateway for it, an HTTP client."""
    settings: Settings = isolated_settings(redis_server.url, model=str(model_dir), block_ms=100)
    encoder = Encoder(str(model_dir), device="cpu")
    launcher = WorkerLauncher(settings, lambda: encoder, tmp_path)
    async with launcher.run(settings, encoder=encoder):
        # the gateway's thread starts beside this loop, which the worker runs on
        with running_gateway(settings) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                yield http


async def test_tei_embed_sparse_matches_sparse_encoder(
    redis_server: ServerProcess, tmp_path: Path, zoo: Path
) -> None:
    from sentence_transformers import SparseEncoder

    model_dir = splade_dir(zoo)
    inputs = ["hi", *documents()]
    async with fleet(redis_server, tmp_path, model_dir) as http:
        answer = await http.post("/embed_sparse", json={"inputs": inputs})
        one = await http.post("/embed_sparse", json={"inputs": "hi"})
        refused = await http.post("/rerank", json={"query": QUERY, "texts": ["a"]})
        refused_v1 = await http.post(
            "/v1/rerank", json={"model": model_dir.name, "query": QUERY, "documents": ["a"]}
        )
        dense = await http.post("/embed", json={"inputs": "hi"})
        dense_v1 = await http.post("/v1/embeddings", json={"model": model_dir.name, "input": "hi"})
        info = await http.get("/info")
    assert answer.status_code == 200, answer.text
    theirs = SparseEncoder(str(model_dir), device="cpu").encode(inputs).to_dense().numpy()
    for row, weights in enumerate(answer.json()):
        indices = [w["index"] for w in weights]
        assert indices == list(np.flatnonzero(theirs[row]))
        np.testing.assert_allclose(
            [w["value"] for w in weights], theirs[row][indices], rtol=1e-3, atol=1e-4
        )
    # one string is one input (TEI's untagged inputs), padded alone: the same weights
    assert [w["index"] for w in one.json()[0]] == [w["index"] for w in answer.json()[0]]
    # TEI's answer to a rerank on a model that is no reranker: 424, its error body
    assert refused.status_code == 424 and refused.json()["error_type"] == "Backend"
    assert "not a cross-encoder" in refused.json()["error"]
    assert refused_v1.status_code == 400
    assert refused_v1.json()["error"]["code"] == "representation_not_served"
    assert dense.status_code == 424 and "/embed_sparse" in dense.json()["error"]
    assert dense_v1.status_code == 400
    assert dense_v1.json()["error"]["code"] == "representation_not_served"
    assert info.json()["model_type"] == {"embedding": {"pooling": "splade"}}


async def test_tei_and_cohere_rerank_match_cross_encoder(
    redis_server: ServerProcess, tmp_path: Path, zoo: Path
) -> None:
    from sentence_transformers import CrossEncoder

    model_dir = cross_encoder_dir(zoo)
    texts = documents()
    async with fleet(redis_server, tmp_path, model_dir) as http:
        tei, cohere, jina, sparse = await asyncio.gather(
            http.post("/rerank", json={"query": QUERY, "texts": texts, "return_text": True}),
            http.post(
                "/v1/rerank",
                json={"model": model_dir.name, "query": QUERY, "documents": texts, "top_n": 3},
            ),
            http.post(  # Jina's client sends documents as objects and asks for them back
                "/v1/rerank",
                json={
                    "model": model_dir.name,
                    "query": QUERY,
                    "documents": [{"text": t} for t in texts],
                    "return_documents": True,
                },
            ),
            http.post("/embed_sparse", json={"inputs": "hi"}),
        )
        bad_model = await http.post(
            "/v1/rerank", json={"model": "nope", "query": QUERY, "documents": texts}
        )
        info = await http.get("/info")
        raw = await http.post("/rerank", json={"query": QUERY, "texts": texts, "raw_scores": True})
        raw_predict = await http.post(
            "/predict", json={"inputs": [[QUERY, t] for t in texts], "raw_scores": True}
        )
    cross_encoder = CrossEncoder(str(model_dir), device="cpu")
    scores = cross_encoder.predict([(QUERY, t) for t in texts])
    order = list(np.argsort(-scores, kind="stable"))
    assert tei.status_code == 200, tei.text
    assert [r["index"] for r in tei.json()] == order
    np.testing.assert_allclose([r["score"] for r in tei.json()], scores[order], atol=1e-4)
    assert [r["text"] for r in tei.json()] == [texts[i] for i in order]
    assert cohere.status_code == 200, cohere.text
    assert [r["index"] for r in cohere.json()["results"]] == order[:3]
    np.testing.assert_allclose(
        [r["relevance_score"] for r in cohere.json()["results"]], scores[order[:3]], atol=1e-4
    )
    assert cohere.json()["model"] == model_dir.name and cohere.json()["usage"]["total_tokens"] > 0
    assert [r["document"]["text"] for r in jina.json()["results"]] == [texts[i] for i in order]
    assert sparse.status_code == 424 and "not a SPLADE" in sparse.json()["error"]
    assert bad_model.status_code == 404
    # TEI's raw_scores: the logits before the model's sigmoid, CrossEncoder's with no activation
    logits = cross_encoder.predict([(QUERY, t) for t in texts], activation_fn=torch.nn.Identity())
    assert raw.status_code == 200, raw.text
    assert [r["index"] for r in raw.json()] == order  # the sigmoid keeps the order
    np.testing.assert_allclose([r["score"] for r in raw.json()], logits[order], atol=1e-4)
    assert np.abs(logits - scores).max() > 0.1  # not the scores again
    assert raw_predict.status_code == 200, raw_predict.text
    np.testing.assert_allclose(
        [labels[0]["score"] for labels in raw_predict.json()], logits, atol=1e-4
    )
    # TEI's ModelType for a cross-encoder of one label: a reranker, with its labels
    assert info.json()["model_type"] == {
        "reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
    }


async def test_tei_embed_all_gives_bge_m3_colbert_vectors(
    redis_server: ServerProcess, tmp_path: Path, zoo: Path
) -> None:
    """TEI's /embed_all on a BGE-M3-shaped model: one matrix of per-token (ColBERT) vectors
    per input, FlagEmbedding's (cosine >= 0.999 per token); /embed_sparse serves its sparse
    head; /embed_all on a cross-encoder (no embedding model) is TEI's 424."""
    from tests.integration.workers.test_multi_representations import FlagReference
    from tests.model_zoo import bge_m3_dir

    model_dir = bge_m3_dir(zoo)
    inputs = ["hi", *documents()[:3]]
    async with fleet(redis_server, tmp_path, model_dir) as http:
        answer = await http.post("/embed_all", json={"inputs": inputs})
        sparse = await http.post("/embed_sparse", json={"inputs": inputs[1]})
        info = await http.get("/info")
    # TEI loads BGE-M3 as an embedding model pooled as its card says (CLS), not a SPLADE one
    assert info.json()["model_type"] == {"embedding": {"pooling": "cls"}}, info.text
    assert answer.status_code == 200, answer.text
    assert sparse.status_code == 200, sparse.text
    encoder_max = Encoder(str(model_dir), device="cpu").max_length
    _, lexical, colbert = FlagReference(model_dir, encoder_max).encode(inputs)
    for row, matrix in enumerate(answer.json()):
        ours = np.array(matrix, dtype=np.float32)
        assert ours.shape == colbert[row].shape
        cosines = np.sum(ours * colbert[row], axis=1) / np.linalg.norm(ours, axis=1)
        assert cosines.min() >= 0.999
    assert [w["index"] for w in sparse.json()[0]] == sorted(lexical[1])
    async with fleet(redis_server, tmp_path, cross_encoder_dir(zoo)) as http:
        refused = await http.post("/embed_all", json={"inputs": "hi"})
    assert refused.status_code == 424 and "not an embedding model" in refused.text


async def test_tei_embed_all_gives_a_dense_models_token_states(
    redis_server: ServerProcess, tmp_path: Path
) -> None:
    """TEI's /embed_all on the dense MiniLM: per input, the last hidden state of every token,
    [CLS] and [SEP] included, before pooling: sentence-transformers'
    ``encode(..., output_value="token_embeddings")`` in float32 (was TEI's 424). More inputs
    than the query stream's (16) ride it all the same. The vector cache keeps the two answers
    apart both ways: /embed's pooled vector of a text does not answer its /embed_all, nor the
    token states its /embed."""
    from sentence_transformers import SentenceTransformer

    model_dir = resolve_model_path("all-MiniLM-L6-v2")
    inputs = [QUERY, *documents(), "a b", *corpus_lines()[100:110]]
    assert len(inputs) > Settings().gateway_lane_max_inputs
    async with fleet(redis_server, tmp_path, model_dir) as http:
        pooled_first = await http.post("/embed", json={"inputs": QUERY})
        answer = await http.post("/embed_all", json={"inputs": inputs})
        one = await http.post("/embed_all", json={"inputs": "a b"})
        pooled_after = await http.post("/embed", json={"inputs": "a b"})
    assert answer.status_code == 200, answer.text
    model = SentenceTransformer(str(model_dir), device="cpu")
    theirs = [states.numpy() for states in model.encode(inputs, output_value="token_embeddings")]
    for ours_rows, their_rows in zip(answer.json(), theirs, strict=True):
        ours = np.array(ours_rows, dtype=np.float32)
        assert ours.shape == their_rows.shape and ours.shape[1] == 384
        cosines = np.sum(ours * their_rows, axis=1) / (
            np.linalg.norm(ours, axis=1) * np.linalg.norm(their_rows, axis=1)
        )
        assert cosines.min() >= 0.9999
        np.testing.assert_allclose(ours, their_rows, atol=1e-4, rtol=1e-4)
    # "a b": [CLS] a b [SEP], a list of one matrix for one input, as TEI answers it
    assert one.status_code == 200, one.text
    assert np.array(one.json()).shape == (1, 4, 384)
    # the pooled answers stay pooled (one unit vector each), before and after
    for pooled, text in ((pooled_first, QUERY), (pooled_after, "a b")):
        assert pooled.status_code == 200, pooled.text
        np.testing.assert_allclose(pooled.json()[0], model.encode([text])[0], atol=2e-3)


async def test_tei_predict_matches_cross_encoder(
    redis_server: ServerProcess, tmp_path: Path, zoo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TEI's /predict on a cross-encoder: one pair, a batch of pairs (each its own query), every
    label's score highest first; a single text (``text``, ``[text]``, ``[[text], ...]`` in a
    batch, and huggingface_hub's ``text_classification``) classified alone, one sequence, as
    AutoModelForSequenceClassification scores it (TEI's sequence classification)."""
    from huggingface_hub import InferenceClient, constants
    from sentence_transformers import CrossEncoder

    # the suite runs with HF_HUB_OFFLINE=1; the client only talks to the local gateway here
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    pairs = [(QUERY, d) for d in documents()[:3]] + [(documents()[3], documents()[4])]
    alone = ["just a text", " ".join(documents())]  # the second over the model's maximum
    model_dir = cross_encoder_dir(zoo, num_labels=2)
    async with fleet(redis_server, tmp_path, model_dir) as http:
        batch = await http.post("/predict", json={"inputs": [list(p) for p in pairs]})
        one = await http.post("/predict", json={"inputs": list(pairs[0])})
        single = await http.post("/predict", json={"inputs": alone[0]})
        listed = await http.post("/predict", json={"inputs": [alone[1]]})
        mixed = await http.post(
            "/predict", json={"inputs": [[alone[0]], list(pairs[0]), [alone[1]]]}
        )
        three = await http.post("/predict", json={"inputs": ["a", "b", "c"]})
        info = await http.get("/info")
        # InferenceClient(base_url) posts {"inputs": text} to the base URL: the model's route
        hub = InferenceClient(base_url=str(http.base_url).rstrip("/"))
        classified = await asyncio.to_thread(hub.text_classification, alone[1])
        raw = await http.post(
            "/predict", json={"inputs": [list(p) for p in pairs], "raw_scores": True}
        )
    assert batch.status_code == 200 and one.status_code == 200, batch.text + one.text
    theirs = CrossEncoder(str(model_dir), device="cpu").predict(pairs)
    # two labels: CrossEncoder's activation is the identity, so raw_scores are the same scores
    assert raw.status_code == 200, raw.text
    np.testing.assert_allclose(
        [
            [item["score"] for item in sorted(labels, key=lambda i: i["label"])]
            for labels in raw.json()
        ],
        theirs,
        atol=1e-4,
    )
    for row, labels in enumerate(batch.json()):
        scores = {int(item["label"].removeprefix("LABEL_")): item["score"] for item in labels}
        np.testing.assert_allclose([scores[0], scores[1]], theirs[row], atol=1e-4)
        assert labels[0]["score"] >= labels[1]["score"]
    assert [item["label"] for item in one.json()] == [item["label"] for item in batch.json()[0]]
    np.testing.assert_allclose(
        [item["score"] for item in one.json()],
        [item["score"] for item in batch.json()[0]],
        atol=1e-5,
    )
    # a text alone: the tokenizer called on it alone, cut to the maximum (classified_alone)
    expected = classified_alone(model_dir, alone)
    for response in (single, listed, mixed):
        assert response.status_code == 200, response.text

    def by_label(labels: list[dict]) -> list[float]:  # type: ignore[type-arg]
        assert [item["score"] for item in labels] == sorted(
            (item["score"] for item in labels), reverse=True
        )
        scores = {int(item["label"].removeprefix("LABEL_")): item["score"] for item in labels}
        return [scores[label] for label in sorted(scores)]

    np.testing.assert_allclose(by_label(single.json()), expected[0], atol=1e-4)
    np.testing.assert_allclose(by_label(listed.json()), expected[1], atol=1e-4)
    got = [by_label(labels) for labels in mixed.json()]
    np.testing.assert_allclose(got, [expected[0], theirs[0], expected[1]], atol=1e-4)
    # TEI answers one input with a flat list, of which huggingface_hub 2.x hands back the first
    # element (its parser expects the Inference API's nested list): the top label, as with TEI
    top = int(np.argmax(expected[1]))
    assert classified["label"] == f"LABEL_{top}"
    np.testing.assert_allclose(classified["score"], expected[1][top], atol=1e-4)
    # TEI's ModelType for a cross-encoder of several labels: a classifier
    assert info.json()["model_type"] == {
        "classifier": {
            "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
            "label2id": {"LABEL_0": 0, "LABEL_1": 1},
        }
    }
    # TEI's sequences are [text] or [text, text]: three texts are neither
    assert three.status_code == 422 and "[text, text]" in three.text
