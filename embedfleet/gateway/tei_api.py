"""TEI's routes with TEI's names, defaults and answers (text-embeddings-inference's router):
POST /embed (and POST /), GET /info, GET /health (and GET /, GET /ping), POST /tokenize and
POST /decode."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, Field, StrictInt

from embedfleet import __name__ as package_name
from embedfleet.gateway.errors import APIError, ErrorDialect, dialect_router
from embedfleet.gateway.images import Input, text_positions, texts_of, with_texts
from embedfleet.gateway.inputs import (
    EmbeddingInput,
    TruncationDirection,
    check_dimensions,
    check_limits,
    fit_to_model,
    not_served,
    prepare_inputs,
    prompt_of,
    tei_truncate,
    unit_vectors,
)
from embedfleet.gateway.state import Gateway, GatewayDep, wire_options
from embedfleet.gateway.tei_metrics import tei_request, tei_shape
from embedfleet.producer.tokens import ModelTokenizer
from embedfleet.shared.modelcard import ModelCard

if TYPE_CHECKING:
    from typing_extensions import TypeIs

router = dialect_router(ErrorDialect.tei)

TOKENIZE_SLICE = 64  # /tokenize's inputs tokenized and written per step of its answer


class EmbedRequest(BaseModel):
    inputs: EmbeddingInput
    truncate: bool | None = None  # None: TEI's auto_truncate, EMBEDFLEET_GATEWAY_AUTO_TRUNCATE
    truncation_direction: TruncationDirection = "Right"
    normalize: bool | None = True
    prompt_name: str | None = None
    # strict: a JSON number, not a string that looks like one (TEI's serde refuses "64")
    dimensions: StrictInt | None = None
    # not TEI's (one model per server): the model to use where the namespace serves several;
    # None is the gateway's own
    model: str | None = None
    # not TEI's: an input over the model's maximum embedded whole (not cut, not refused), in
    # token windows sharing this many tokens, pooled back into one vector (issue 42)
    window_overlap: StrictInt | None = Field(default=None, ge=0)


class TokenizeRequest(BaseModel):
    inputs: str | list[str]
    add_special_tokens: bool = True
    prompt_name: str | None = None
    model: str | None = None


class DecodeRequest(BaseModel):
    ids: list[int] | list[list[int]]
    skip_special_tokens: bool = True
    model: str | None = None


@router.post("/embed")
@router.post("/")
async def embed(body: EmbedRequest, gateway: GatewayDep) -> list[list[float]]:
    """TEI's embed. ``prompt_name`` absent means no prompt, as in TEI (sentence-transformers'
    ``default_prompt_name`` is what its ``encode`` applies, not what TEI's request means)."""
    async with tei_request(gateway, "embed", *tei_shape(body.inputs)), gateway.request_bound():
        return await _embed(body, gateway)


async def _embed(body: EmbedRequest, gateway: Gateway) -> list[list[float]]:
    gateway = await gateway.for_model(body.model)
    card = await gateway.model_card()  # None before any worker started: checked afterwards
    check_dimensions(body.dimensions, card)
    normalize = True if body.normalize is None else body.normalize
    # checked, decoded (images) and tokenized off the event loop: it grows with the request
    inputs = await asyncio.to_thread(_fitted_inputs, body, gateway, card)
    # the prompt travels by name: the worker owns the model's prompts and knows where one ends
    # (models that pool without it, include_prompt=false)
    # normalize=false asks the workers for the vector before the model's Normalize (TEI's
    # answer); true normalises here what a model without one gives
    options = wire_options(
        body.prompt_name,
        body.dimensions,
        before_normalize=not normalize,
        window_overlap=body.window_overlap,
    )
    vectors = await gateway.embedder.embed(inputs, options)
    if card is None:
        # a worker answered, so its card is published: what could not be checked before is now
        # (the vectors are thrown away for a request it refuses)
        card = await gateway.require_card()
        _check_against_card(card, body)
    return await asyncio.to_thread(lambda: unit_vectors(vectors, normalize).tolist())


def _fitted_inputs(body: EmbedRequest, gateway: Gateway, card: ModelCard | None) -> list[Input]:
    """/embed's inputs: texts and images (gateway/images.py), token ids read as the model's own
    (TEI's reading, ``prepare_tei``); then what only the card can tell (``_check_against_card``);
    then the texts fitted to the model (``fit_to_model``, after the prompt), unless
    ``window_overlap`` asks the worker to embed a long one whole."""
    truncate = tei_truncate(body.truncate, gateway.settings)
    inputs = prepare_inputs(
        body.inputs,
        gateway.tokenizer,
        gateway.settings,
        None if card is None else card.modalities,
        "inputs",
        truncate=truncate,
        direction=body.truncation_direction,
    )
    prompt = "" if card is None else _check_against_card(card, body)
    texts = texts_of(inputs)
    if body.window_overlap is not None or not texts:
        return inputs
    fitted = fit_to_model(
        texts,
        gateway.tokenizer,
        prompt,
        card.max_length if card is not None else None,
        truncate=truncate,
        direction=body.truncation_direction,
        positions=text_positions(inputs),
    )
    return with_texts(inputs, fitted)


def _check_against_card(card: ModelCard, body: EmbedRequest) -> str:
    """What TEI refuses that only the model card can tell (``dimensions`` over the model's, a
    prompt name the model lacks); the prompt's text."""
    if not_served(card, "dense"):
        raise APIError(
            424,
            f"the model {card.name!r} gives no dense embeddings (it serves "
            f"{', '.join(card.representations)}): use /embed_sparse or /rerank",
            code="representation_not_served",
        )
    check_dimensions(body.dimensions, card)
    return prompt_of(card, body.prompt_name)


@router.get("/info")
async def info(gateway: GatewayDep, model: str | None = None) -> dict[str, object]:
    """TEI's Info, from the workers' model card; 503 with Retry-After before any worker
    published one (limits a client sizes its batches by must not be made up). The batching
    figures are the workers' (EMBEDFLEET_TOKEN_BUDGET and EMBEDFLEET_MAX_BATCH, auto resolved
    for EMBEDFLEET_DEVICE, CPU's under auto). ``?model=``: another model of the namespace."""
    gateway = await gateway.for_model(model)
    settings = gateway.settings
    card = await gateway.require_card()
    batching = settings.batching("cuda" if settings.device == "cuda" else "cpu")
    return {
        "model_id": card.name,
        "model_sha": None,
        # the precision the workers compute in (their card's), as TEI's is its model's
        "model_dtype": card.dtype or None,
        "served_model_name": gateway.served_name,
        "model_type": model_type(card),
        "max_concurrent_requests": settings.gateway_lane_high_water,
        "max_input_length": card.max_length,
        "max_batch_tokens": batching.token_budget,
        "max_batch_requests": batching.max_batch,
        "max_client_batch_size": settings.gateway_max_inputs,
        "auto_truncate": settings.gateway_auto_truncate,
        "tokenization_workers": 1,
        "version": _version(),
        "sha": None,
        "docker_label": None,
        "prompts": card.named_prompts,
    }


# sentence-transformers' pooling modes under TEI's names (backends/core's ``Pool``), where
# they differ
TEI_POOLING_NAMES = {"lasttoken": "last_token"}


def model_type(card: ModelCard) -> dict[str, object]:
    """TEI's ``ModelType`` (router/src/lib.rs) for the served model: ``reranker`` for a
    cross-encoder of one label, ``classifier`` for one of several (TEI tells the two by
    ``id2label``'s length), each with ``id2label`` and ``label2id``; else ``embedding`` with its
    pooling, ``splade`` for a model that gives sparse weights alone (a BGE-M3-shaped model's
    dense vector is its embedding: TEI loads it as one, pooled as its card says).

    The labels are ``LABEL_<i>``, the names /predict answers with (the card carries the number
    of labels, ``dim``, not the config's names)."""
    if card.serves("rerank"):
        labels = [f"LABEL_{index}" for index in range(card.dim)]
        classifier = {
            "id2label": {str(index): label for index, label in enumerate(labels)},
            "label2id": {label: index for index, label in enumerate(labels)},
        }
        return {"reranker" if card.dim == 1 else "classifier": classifier}
    if card.serves("dense"):
        pooling = "+".join(TEI_POOLING_NAMES.get(mode, mode) for mode in card.pooling)
    else:
        pooling = "splade"
    return {"embedding": {"pooling": pooling}}


@router.get("/health")
@router.get("/ping")
@router.get("/")
async def health(gateway: GatewayDep, model: str | None = None) -> Response:
    """200 (empty) while a worker is alive, 503 without one (TEI's meaning: the model can
    answer). GET / and /ping are TEI's aliases for load balancers and SageMaker. ``?model=``:
    a worker of that model of the namespace."""
    gateway = await gateway.for_model(model)
    await gateway.fleet.require_worker()
    return Response(status_code=200)


@router.post("/tokenize", response_model=list[list[dict[str, Any]]])
async def tokenize(body: TokenizeRequest, gateway: GatewayDep) -> StreamingResponse:
    """The model's tokens of each input (with the prompt in front, as it is embedded): id, text,
    special, and start/stop as byte offsets into the input (TEI's SimpleToken).

    Tokenized and written off the event loop, a slice of inputs at a time (``token_lists``): a
    body at the caps is millions of tokens, seconds of work and hundreds of MB of JSON, which
    on the loop would hold /healthz (the liveness probe) and every other request for as long."""
    gateway = await gateway.for_model(body.model)
    inputs = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    if not inputs:
        raise APIError(400, "`inputs` cannot be empty", param="inputs", code="empty_input")
    await asyncio.to_thread(check_limits, inputs, gateway.settings, "inputs")
    prompt = ""
    if body.prompt_name:
        card = await gateway.require_card()  # the prompts are the workers' to publish
        prompt = prompt_of(card, body.prompt_name)
    texts = [prompt + text for text in inputs]
    # a sync iterator: Starlette runs each step of it on a worker thread
    return StreamingResponse(
        token_lists(gateway.tokenizer.tokenizer, texts, body.add_special_tokens),
        media_type="application/json",
    )


def token_lists(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> Iterator[bytes]:
    """/tokenize's answer as JSON, TOKENIZE_SLICE inputs per step, so that what is held at once
    is one slice's tokens, not the whole answer's."""
    yield b"["
    for start in range(0, len(texts), TOKENIZE_SLICE):
        part = texts[start : start + TOKENIZE_SLICE]
        encodings = tokenizer.encode_batch(part, add_special_tokens=add_special_tokens)
        rows = [
            json.dumps(simple_tokens(text, encoding), ensure_ascii=False, separators=(",", ":"))
            for text, encoding in zip(part, encodings, strict=True)
        ]
        yield (("," if start else "") + ",".join(rows)).encode()
    yield b"]"


def _one_sequence(ids: list[int] | list[list[int]]) -> TypeIs[list[int]]:
    """Whether /decode was given one sequence of ids rather than a batch of them."""
    # [] is one empty sequence, as TEI reads it (its untagged enum tries a single one first)
    return not ids or isinstance(ids[0], int)


@router.post("/decode")
async def decode(body: DecodeRequest, gateway: GatewayDep) -> list[str]:
    gateway = await gateway.for_model(body.model)
    ids: Sequence[list[int]] = [body.ids] if _one_sequence(body.ids) else body.ids
    limit = gateway.settings.gateway_max_inputs
    if len(ids) > limit:
        raise APIError(
            413,
            f"batch size {len(ids)} > maximum allowed batch size {limit} "
            "(EMBEDFLEET_GATEWAY_MAX_INPUTS); split the request",
            param="ids",
            code="too_many_inputs",
        )
    # checked and decoded off the event loop: it grows with the request (docs/GATEWAY.md)
    return await asyncio.to_thread(_decoded, gateway.tokenizer, ids, body.skip_special_tokens)


def _decoded(
    tokenizer: ModelTokenizer, ids: Sequence[list[int]], skip_special_tokens: bool
) -> list[str]:
    """/decode's answer: each sequence's text; 422 for an id outside the vocabulary."""
    vocab = tokenizer.vocab_size
    for index, row in enumerate(ids):
        bad = [v for v in row if not 0 <= v < vocab]
        if bad:
            raise APIError(
                422,
                f"`ids[{index}]` has ids outside the model's vocabulary (0..{vocab - 1}): "
                f"{bad[:5]}",
                param="ids",
                code="invalid_input",
            )
    return tokenizer.tokenizer.decode_batch(list(ids), skip_special_tokens=skip_special_tokens)


def simple_tokens(text: str, encoding: Any) -> list[dict[str, Any]]:
    """TEI's tokens: a special token has its own text and no offsets; any other has the text it
    covers and its byte offsets (TEI's tokenizer counts bytes; Python's counts characters)."""
    byte_at = [0]
    for char in text:
        byte_at.append(byte_at[-1] + len(char.encode("utf-8")))
    tokens = []
    for token_id, (start, stop), special, piece in zip(
        encoding.ids,
        encoding.offsets,
        encoding.special_tokens_mask,
        encoding.tokens,
        strict=True,
    ):
        if special:
            tokens.append(
                {"id": token_id, "text": piece, "special": True, "start": None, "stop": None}
            )
        else:
            tokens.append(
                {
                    "id": token_id,
                    "text": text[start:stop],
                    "special": False,
                    "start": byte_at[start],
                    "stop": byte_at[stop],
                }
            )
    return tokens


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package_name)
    except PackageNotFoundError:
        return "0+source"
