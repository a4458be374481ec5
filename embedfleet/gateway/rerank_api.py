"""Sparse embeddings and reranking over the fleet, in TEI's shapes (Cohere's and Jina's
rerank, POST /v1/rerank, is gateway/cohere_api.py's, in OpenAI's error dialect).

- TEI ``POST /embed_sparse``: ``{inputs, truncate?, truncation_direction?, prompt_name?}`` ->
  ``[[{"index", "value"}, ...], ...]`` per input (a SPLADE model's non-zero weights).
- TEI ``POST /rerank``: ``{query, texts, raw_scores?, return_text?, truncate?}`` ->
  ``[{"index", "score", "text"?}, ...]``, highest score first.
- TEI ``POST /embed_all``: ``{inputs, truncate?, truncation_direction?, prompt_name?}`` ->
  ``[[[float, ...], ...], ...]``, a matrix of per-token vectors per input. A dense model answers
  its token states, as TEI does: the last hidden state of every token, special tokens included,
  before pooling, in float32 (sentence-transformers' ``output_value="token_embeddings"``; a
  chunk's ``token_states``, computed by the workers' eager forward pass). A multi-vector model
  (BGE-M3) answers its ColBERT vectors instead (every token after CLS, projected and normalised:
  what late interaction compares); a sparse model or a cross-encoder is refused (424).
- TEI ``POST /predict``: ``{inputs: text | [text] | [text, text] | [[text] | [text, text],
  ...], raw_scores?, truncate?}`` -> ``[{"score", "label"}, ...]`` per input (a list of those
  for a batch), every label of the classifier, highest first; labels are ``LABEL_<i>``. A pair
  is scored as ``CrossEncoder.predict`` scores it; a text alone is one sequence through the
  model (TEI's sequence classification: the tokenizer called on the text alone).

The scores are ``CrossEncoder.predict``'s (the model's declared activation: a sigmoid for a
one-label reranker, what TEI returns without ``raw_scores``); ``raw_scores: true`` answers the
logits before it, as TEI does (``CrossEncoder.predict(..., activation_fn=Identity())``). A
(query, document) pair longer than the model's maximum is cut ``longest_first`` by the worker,
as ``CrossEncoder.predict`` cuts it, whatever ``truncate`` says. A served model that lacks the
representation is refused in the route's dialect (TEI: 424 ``Backend``, as TEI answers a rerank
on an embedding model; OpenAI's: 400).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel

from embedfleet.gateway.errors import APIError, ErrorDialect, dialect_router
from embedfleet.gateway.inputs import (
    EmbeddingInput,
    TruncationDirection,
    check_limits,
    fit_to_model,
    not_served,
    prepare_tei,
    prompt_of,
)
from embedfleet.gateway.metrics import Method
from embedfleet.gateway.state import Gateway, GatewayDep
from embedfleet.gateway.tei_metrics import tei_request, tei_shape
from embedfleet.shared.modelcard import ModelCard

DIALECT = ErrorDialect.tei
router = dialect_router(DIALECT)


class EmbedSparseRequest(BaseModel):
    inputs: EmbeddingInput
    truncate: bool | None = None
    truncation_direction: TruncationDirection = "Right"
    prompt_name: str | None = None
    model: str | None = None  # not TEI's: another model of the namespace


class RerankRequest(BaseModel):
    query: str
    texts: list[str]
    truncate: bool | None = None
    truncation_direction: TruncationDirection = "Right"
    raw_scores: bool = False
    return_text: bool = False
    model: str | None = None  # not TEI's: another model of the namespace


class PredictRequest(BaseModel):
    inputs: str | list[str] | list[list[str]]
    truncate: bool | None = None
    truncation_direction: TruncationDirection = "Right"
    raw_scores: bool = False
    model: str | None = None  # not TEI's: another model of the namespace


def require_representation(card: ModelCard, wanted: str, dialect: ErrorDialect) -> None:
    """Refuse a request for what the served model does not give (the verifier's rule), in
    the dialect's status and words."""
    if not not_served(card, wanted):
        return
    what = {
        "sparse": "a SPLADE (SparseEncoder) model",
        "rerank": "a cross-encoder reranker",
        "multivector": "a multi-vector (ColBERT, BGE-M3) model",
        "dense": "an embedding model",
    }
    tei = dialect is ErrorDialect.tei
    raise APIError(
        424 if tei else 400,
        f"the model {card.name!r} is not {what.get(wanted, wanted)}: it serves "
        f"{', '.join(card.representations)}",
        code="representation_not_served",
        param=None if tei else "model",
    )


async def _tei_texts(
    body: EmbedSparseRequest, gateway: Gateway, representation: str
) -> tuple[Gateway, list[str]]:
    """The gateway of the model a TEI body names (``model``, else the default one), refused
    unless it serves ``representation``, and the inputs as the model will see them: the prompt
    text in front, truncated or refused as TEI's ``truncate`` says."""
    gateway = await gateway.for_model(body.model)
    card = await gateway.require_card()
    require_representation(card, representation, DIALECT)
    # checked and tokenized off the event loop: it grows with the request
    texts, truncate = await asyncio.to_thread(prepare_tei, body, gateway)
    prompt = prompt_of(card, body.prompt_name, param=None)
    texts = await asyncio.to_thread(
        fit_to_model,
        texts,
        gateway.tokenizer,
        prompt,
        card.max_length,
        truncate=truncate,
        direction=body.truncation_direction,
    )
    return gateway, texts


@router.post("/embed_sparse")
async def embed_sparse(body: EmbedSparseRequest, gateway: GatewayDep) -> list[list[dict[str, Any]]]:
    shape = tei_shape(body.inputs)
    async with tei_request(gateway, "embed", *shape), gateway.request_bound():
        gateway, texts = await _tei_texts(body, gateway, "sparse")
        # the prompt text is already in front (fit_to_model): none is added again
        vectors = await gateway.embedder.embed_sparse(texts)
    return [
        [
            {"index": int(index), "value": float(value)}
            for index, value in zip(vector.indices, vector.values, strict=True)
        ]
        for vector in vectors
    ]


@router.post("/embed_all")
async def embed_all(body: EmbedSparseRequest, gateway: GatewayDep) -> list[list[list[float]]]:
    """Per-token vectors of each input: a dense model's token states (TEI's), a multi-vector
    model's ColBERT vectors."""
    shape = tei_shape(body.inputs)
    async with tei_request(gateway, "embed", *shape), gateway.request_bound():
        card = await (await gateway.for_model(body.model)).require_card()
        colbert = card.serves("multivector")
        gateway, texts = await _tei_texts(body, gateway, "multivector" if colbert else "dense")
        if colbert:
            results = await gateway.embedder.embed_representations(texts, ("multivector",))
        else:
            results = await gateway.embedder.embed_representations(
                texts, ("dense",), token_states=True
            )
    matrices = []
    for result in results:
        if result.multivector is None:
            raise APIError(424, "the workers answered without per-token vectors", code="backend")
        matrices.append(result.multivector.floats().tolist())
    return matrices


PredictSequence = tuple[str, str | None]  # (text, text), or (text, None): the text alone


def _sequence(item: Sequence[str], where: str) -> PredictSequence:
    """One of TEI's sequences: ``[text]`` alone or ``[text, text]`` a pair."""
    if len(item) == 1:
        return (item[0], None)
    if len(item) == 2:
        return (item[0], item[1])
    raise APIError(
        422,
        f"{where} is a text [text] or a pair [text, text], not {len(item)} texts",
        code="validation",
    )


def _predict_sequences(
    inputs: str | list[str] | list[list[str]],
) -> tuple[list[PredictSequence], bool]:
    """TEI's ``inputs`` (router/src/http/types.rs, ``PredictInput``) as sequences, and whether
    it was one (not a batch): ``text`` and ``[text]`` one text, ``[text, text]`` one pair,
    ``[[text], [text, text], ...]`` a batch of both."""
    if isinstance(inputs, str):
        return [(inputs, None)], True
    if inputs and all(isinstance(item, str) for item in inputs):
        return [_sequence([str(item) for item in inputs], "`inputs`")], True
    sequences = [_sequence(item, f"`inputs[{index}]`") for index, item in enumerate(inputs)]
    if not sequences:
        raise APIError(400, "`inputs` cannot be empty", code="empty_input")
    return sequences, False


@router.post("/predict")
async def predict(body: PredictRequest, gateway: GatewayDep) -> list[Any]:
    single = isinstance(body.inputs, str) or all(isinstance(item, str) for item in body.inputs)
    shape: tuple[Method, int] = ("single", 1) if single else ("batch", len(body.inputs))
    async with tei_request(gateway, "predict", *shape), gateway.request_bound():
        sequences, one = _predict_sequences(body.inputs)
        gateway = await gateway.for_model(body.model)
        card = await gateway.require_card()
        require_representation(card, "rerank", DIALECT)
        texts = [text for sequence in sequences for text in sequence if text is not None]
        await asyncio.to_thread(check_limits, texts, gateway.settings, "inputs")
        # a text alone is one sequence through the model, as TEI and the text-classification
        # pipeline classify it (workers/model/rerank.py), not the pair (text, "")
        scores = await gateway.embedder.score_pairs(sequences, raw_scores=body.raw_scores)
    answers = [
        [
            {"score": float(row[label]), "label": f"LABEL_{label}"}
            for label in np.argsort(-row, kind="stable").tolist()
        ]
        for row in scores
    ]
    return answers[0] if one else answers


async def rerank_scores(
    gateway: Gateway,
    query: str,
    documents: list[str],
    *,
    param: str,
    dialect: ErrorDialect,
    raw_scores: bool = False,
) -> np.ndarray:
    """The model's score of each document for ``query``, refused in ``dialect`` where the model
    is no reranker; ``param``: the request's name for the documents; ``raw_scores``: the
    logits, before the model's activation (TEI's)."""
    card = await gateway.require_card()
    require_representation(card, "rerank", dialect)
    if not documents:
        raise APIError(400, f"`{param}` cannot be empty", param=param, code="empty_input")
    if not query.strip():
        raise APIError(400, "`query` cannot be empty", param="query", code="empty_input")
    await asyncio.to_thread(check_limits, [query, *documents], gateway.settings, param)
    return await gateway.embedder.rerank(query, documents, raw_scores=raw_scores)


def ranked(scores: np.ndarray) -> list[int]:
    """Document positions, highest score first (ties: the earlier document first)."""
    return [int(i) for i in np.argsort(-scores, kind="stable")]


@router.post("/rerank")
async def rerank(body: RerankRequest, gateway: GatewayDep) -> list[dict[str, Any]]:
    async with tei_request(gateway, "predict", "batch", len(body.texts)), gateway.request_bound():
        gateway = await gateway.for_model(body.model)
        scores = await rerank_scores(
            gateway,
            body.query,
            body.texts,
            param="texts",
            dialect=DIALECT,
            raw_scores=body.raw_scores,
        )
    ranks = []
    for index in ranked(scores):
        rank: dict[str, Any] = {"index": index, "score": float(scores[index])}
        if body.return_text:
            rank["text"] = body.texts[index]
        ranks.append(rank)
    return ranks
