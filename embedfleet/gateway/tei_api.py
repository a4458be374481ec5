"""TEI's routes with TEI's names and defaults: POST /embed (and /), GET /info, GET /health."""

from __future__ import annotations

from typing import Literal

import numpy as np
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from embedfleet import __name__ as package_name
from embedfleet.gateway.errors import APIError
from embedfleet.gateway.inputs import as_texts, check_dimensions, check_limits, shape_vectors
from embedfleet.gateway.state import GatewayDep, wire_options

router = APIRouter()


class EmbedRequest(BaseModel):
    inputs: str | list[str]
    truncate: bool | None = False
    truncation_direction: Literal["Right", "Left", "right", "left"] = "Right"
    normalize: bool | None = True
    prompt_name: str | None = None
    dimensions: int | None = None


@router.post("/embed")
@router.post("/")
async def embed(body: EmbedRequest, gateway: GatewayDep) -> list[list[float]]:
    check_dimensions(body.dimensions, gateway.model.dim)
    normalize = True if body.normalize is None else body.normalize
    if gateway.model.normalize and not normalize:
        raise APIError(
            422,
            "normalize=false is not available: this model's pipeline ends in a Normalize "
            "module and the workers return its normalised output",
            param="normalize",
        )
    prompt = gateway.prompt_text(body.prompt_name)
    texts = as_texts(body.inputs, gateway.tokenizer, "inputs")
    check_limits(texts, gateway.settings, "inputs")
    # the worker tokenizes prompt and text together, as sentence-transformers does
    lengths = gateway.tokenizer.lengths([prompt + text for text in texts])
    longest = max(lengths)
    if longest > gateway.model.max_length:
        if not body.truncate:
            raise APIError(
                413,
                f"Input validation error: `inputs` must have less than "
                f"{gateway.model.max_length} tokens. Given: {longest}. Send truncate=true "
                "to cut them to fit.",
                param="inputs",
            )
        if body.truncation_direction.lower() == "left":
            raise APIError(
                422,
                "truncation_direction=Left is not available: the workers keep the start",
                param="truncation_direction",
            )
    # the prompt travels as an option: models that pool without it (include_prompt=false) need
    # to know where it ends
    options = wire_options(gateway, prompt, body.dimensions)
    vectors = await gateway.embedder.embed(texts, options)
    if normalize and not gateway.model.normalize:
        vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    vectors = shape_vectors(vectors, body.dimensions, normalize)
    return vectors.tolist()


@router.get("/info")
async def info(gateway: GatewayDep) -> dict[str, object]:
    settings = gateway.settings
    return {
        "model_id": gateway.served_name,
        "model_sha": None,
        "model_dtype": "float16",  # on the wire, results are fp16
        "model_type": {"embedding": {"pooling": "model"}},
        "max_concurrent_requests": settings.gateway_lane_high_water,
        "max_input_length": gateway.model.max_length,
        "max_batch_tokens": settings.token_budget,
        "max_batch_requests": settings.max_batch,
        "max_client_batch_size": settings.gateway_max_inputs,
        "auto_truncate": False,
        "tokenization_workers": 1,
        "version": _version(),
        "sha": None,
        "docker_label": None,
        "prompts": gateway.model.prompts or None,
    }


@router.get("/health")
async def health(gateway: GatewayDep) -> JSONResponse:
    """200 while a worker is alive, 503 without one (TEI's meaning: the model can answer)."""
    await gateway.fleet.require_worker()
    return JSONResponse({})


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package_name)
    except PackageNotFoundError:
        return "0+source"
