"""OpenAI's routes: POST /v1/embeddings and GET /v1/models."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field

from embedfleet.gateway.inputs import (
    EmbeddingInput,
    check_dimensions,
    encode_vector,
    prepare,
    shape_vectors,
)
from embedfleet.gateway.state import Gateway, GatewayDep, wire_options

router = APIRouter()


class EmbeddingRequest(BaseModel):
    input: EmbeddingInput
    model: str
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None)
    user: str | None = None


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, gateway: GatewayDep) -> dict[str, object]:
    gateway.check_model(body.model)
    check_dimensions(body.dimensions, gateway.model.dim)
    prepared = prepare(body.input, gateway.tokenizer, gateway.settings)
    options = wire_options(gateway, "", body.dimensions)
    vectors = await gateway.embedder.embed(prepared.texts, options)
    vectors = shape_vectors(vectors, body.dimensions, gateway.model.normalize)
    return embeddings_response(gateway.served_name, vectors, body.encoding_format, prepared.tokens)


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
    return {"object": "list", "data": [model_card(gateway)]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, gateway: GatewayDep) -> dict[str, object]:
    gateway.check_model(model_id)
    return model_card(gateway)


def model_card(gateway: Gateway) -> dict[str, object]:
    return {
        "id": gateway.served_name,
        "object": "model",
        "created": gateway.started_at,
        "owned_by": "embedfleet",
        "dimensions": gateway.model.dim,
        "max_input_tokens": gateway.model.max_length,
    }
