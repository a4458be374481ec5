"""OpenAI's routes: POST /v1/embeddings and GET /v1/models."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field, StrictInt

from embedfleet.gateway.errors import APIError, ErrorDialect, dialect_router
from embedfleet.gateway.images import require_image_uris, text_positions, texts_of
from embedfleet.gateway.inputs import (
    EmbeddingInput,
    check_dimensions,
    encode_vector,
    not_served,
    openai_truncate,
    prepare_inputs,
    request_tokens,
    unit_vectors,
)
from embedfleet.gateway.state import Gateway, GatewayDep, wire_options
from embedfleet.shared.keys import Keys
from embedfleet.shared.protocol import STORAGE_DTYPES, OutputDtype

# the precisions the gateway makes of the unit vectors it answers in float32 (the others are the
# workers')
FLOAT_DTYPES = ("float32", "float16")

router = dialect_router(ErrorDialect.openai)


class EmbeddingRequest(BaseModel):
    input: EmbeddingInput
    # OpenAI requires it; TEI's users leave it out (TEI ignores it): then the one model served
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    # strict: a JSON number, not a string that looks like one (OpenAI and TEI refuse "64")
    dimensions: StrictInt | None = Field(default=None)
    user: str | None = None
    # Not OpenAI's: an input over the model's maximum is a 400 there (and here), unless the
    # client asks for it to be cut to fit (TEI's name for it); None: the server's default,
    # EMBEDFLEET_GATEWAY_OPENAI_TRUNCATE (off)
    truncate: bool | None = None
    # Not OpenAI's either: an input over the model's maximum embedded whole, in token windows
    # sharing this many tokens, pooled back into one vector (the chunk option, issue 42)
    window_overlap: StrictInt | None = Field(default=None, ge=0)
    # Not OpenAI's: Infinity's (``extra_body={"modality": "image"}``): "image", every input an
    # image data URI (gateway/images.py); left out or "text", a data:image/ string is an image
    # and any other string a text
    modality: Literal["text", "image"] | None = None


@dataclass(frozen=True)
class DenseEmbeddings:
    """A request's vectors as /v1/embeddings computes them, and what its answer says of them."""

    vectors: np.ndarray  # (inputs, stored_length(dtype, dim)), STORAGE_DTYPES[dtype]
    dtype: OutputDtype
    dim: int  # the values each vector holds (before bit packing)
    model: str  # the served name of the model that embedded them
    tokens: int  # the inputs' tokens (``usage``)


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, gateway: GatewayDep) -> dict[str, object]:
    if body.modality == "image":  # Infinity's images alone: URLs refused, nothing fetched
        require_image_uris(body.input)
    async with gateway.request_bound():
        answer = await _dense_embeddings(body, gateway, "float32")
        return await asyncio.to_thread(
            embeddings_response, answer.model, answer.vectors, body.encoding_format, answer.tokens
        )


async def dense_embeddings(
    body: EmbeddingRequest, gateway: Gateway, dtype: OutputDtype
) -> DenseEmbeddings:
    """/v1/embeddings' vectors of ``body`` (its checks, limits and lanes) in ``dtype``, for the
    doors that answer them in bytes (the fleet's gRPC API, gateway/fleet_grpc/) or in another
    dialect (Infinity's /embeddings_image, gateway/infinity_api.py)."""
    async with gateway.request_bound():
        return await _dense_embeddings(body, gateway, dtype)


async def _dense_embeddings(
    body: EmbeddingRequest, gateway: Gateway, dtype: OutputDtype
) -> DenseEmbeddings:
    """The vectors of ``body``'s inputs, texts and images (gateway/images.py)."""
    # 404 model_not_found for an unknown one; left out, the one model served (400 if several)
    gateway = await gateway.for_request(body.model)
    card = await gateway.model_card()  # None before any worker started: the worker checks
    if card is not None and not_served(card, "dense"):
        raise APIError(
            400,
            f"the model {card.name!r} gives no dense embeddings (it serves "
            f"{', '.join(card.representations)}): use /v1/rerank, or TEI's /embed_sparse",
            param="model",
            code="representation_not_served",
        )
    check_dimensions(body.dimensions, card)
    truncate = openai_truncate(body.truncate, gateway.settings)
    # checked, decoded (images), tokenized and counted off the event loop: it grows with the
    # request
    inputs = await asyncio.to_thread(
        prepare_inputs,
        body.input,
        gateway.openai_ids,
        gateway.settings,
        None if card is None else card.modalities,
        truncate=truncate,
    )
    texts = texts_of(inputs)  # what is tokenized and counted: an image counts no tokens
    # with window_overlap an input over the model's maximum is neither refused nor cut
    whole = body.window_overlap is not None
    count = functools.partial(
        request_tokens,
        texts,
        gateway.tokenizer,
        settings=gateway.settings,
        whole=whole,
        refuse_long=not (truncate or whole),
        positions=text_positions(inputs),
    )
    tokens = None if card is None else await asyncio.to_thread(count, card)
    options = wire_options(None, body.dimensions, window_overlap=body.window_overlap)
    floats = dtype in FLOAT_DTYPES
    if not floats:
        # codes and bits are the worker's, from its float32 vector with the model's calibration
        # (as a chunk's dtype): what the fp16 wire would give could land in another bucket
        options = dataclasses.replace(options, dtype=dtype)
    vectors = await gateway.embedder.embed(inputs, options)
    card = await gateway.require_card()  # a worker answered: it has published its card
    if tokens is None:
        # what could not be checked before is now (the vectors are thrown away for a request
        # it refuses)
        tokens = await asyncio.to_thread(count, card)
    if floats:
        units = await asyncio.to_thread(unit_vectors, vectors, card.normalize)
        vectors = units if dtype == "float32" else units.astype(STORAGE_DTYPES[dtype])
    dim = body.dimensions or card.dim  # 0 is FULL_DIMENSIONS: the whole vector
    return DenseEmbeddings(vectors, dtype, dim, gateway.served_name, tokens)


def embeddings_response(
    model: str, vectors, encoding_format: str, tokens: int
) -> dict[str, object]:
    return {
        "object": "list",
        "data": [
            {
                "object": "embedding",
                "index": index,
                "embedding": encode_vector(row, encoding_format),
            }
            for index, row in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


@router.get("/v1/models")
async def list_models(gateway: GatewayDep) -> dict[str, object]:
    """Every model served: the gateway's own, then each one registered in the namespace's
    registry of models (``{ns}:models``), with its card's dimension and maximum length."""
    await gateway.model_card()  # its name is the card's, once published
    models = await gateway.models()
    data = [await model_entry(gateway)]
    for lane in models[1:]:
        data.append(await model_entry(gateway, lane.name, lane.keys))
    return {"object": "list", "data": data}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, gateway: GatewayDep) -> dict[str, object]:
    own = gateway.settings.keys
    keys = await gateway.route(model_id)  # 404 model_not_found for an unknown one
    if keys == own:
        return await model_entry(gateway)
    return await model_entry(gateway, model_id.removeprefix("sentence-transformers/"), keys)


async def model_entry(
    gateway: Gateway, name: str | None = None, keys: Keys | None = None
) -> dict[str, object]:
    """A served model: the gateway's own, or the registered model ``name`` of ``keys``'s lane.
    Before any worker published the model card, from the settings alone: the served name,
    without ``dimensions`` and ``max_input_tokens`` (nothing here knows them before a worker
    loaded the model), so a scaled-to-zero fleet still lists its model."""
    card = await (gateway.model_card() if keys is None else gateway.card_of(keys))
    entry: dict[str, object] = {
        "id": gateway.served_name if name is None else name,
        "object": "model",
        "created": gateway.started_at,
        "owned_by": "embedfleet",
    }
    if card is not None:
        entry.update(dimensions=card.dim, max_input_tokens=card.max_length)
    return entry
