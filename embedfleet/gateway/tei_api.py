"""TEI's routes with TEI's names, defaults and answers (text-embeddings-inference's router):
POST /embed (and POST /), GET /info, GET /health (and GET /, GET /ping), POST /tokenize and
POST /decode."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel

from embedfleet import __name__ as package_name
from embedfleet.gateway.errors import APIError
from embedfleet.gateway.inputs import (
    EmbeddingInput,
    TruncationDirection,
    as_texts,
    check_dimensions,
    check_limits,
    fit_to_model,
    shape_vectors,
)
from embedfleet.gateway.state import Gateway, GatewayDep, wire_options
from embedfleet.shared.modeldir import ModelFiles

router = APIRouter()


def served_model(gateway: Gateway) -> ModelFiles:
    """The model facts these routes answer with (dimension, normalisation, maximum length,
    prompts): one access, so the source can change in one place."""
    return gateway.model


class EmbedRequest(BaseModel):
    inputs: EmbeddingInput
    truncate: bool | None = None  # None: TEI's auto_truncate, off
    truncation_direction: TruncationDirection = "Right"
    normalize: bool | None = True
    prompt_name: str | None = None
    dimensions: int | None = None


class TokenizeRequest(BaseModel):
    inputs: str | list[str]
    add_special_tokens: bool = True
    prompt_name: str | None = None


class DecodeRequest(BaseModel):
    ids: list[int] | list[list[int]]
    skip_special_tokens: bool = True


@router.post("/embed")
@router.post("/")
async def embed(body: EmbedRequest, gateway: GatewayDep) -> list[list[float]]:
    model = served_model(gateway)
    check_dimensions(body.dimensions, model.dim)
    normalize = True if body.normalize is None else body.normalize
    if model.normalize and not normalize:
        raise APIError(
            422,
            "normalize=false is not available for this model: its pipeline ends in a Normalize "
            "module and the workers return its normalised output. Leave normalize at true.",
            param="normalize",
            code="normalize_not_available",
        )
    prompt = gateway.prompt_text(body.prompt_name)
    texts = as_texts(
        body.inputs,
        gateway.tokenizer,
        "inputs",
        accept_token_ids=gateway.settings.gateway_accept_token_ids,
    )
    check_limits(texts, gateway.settings, "inputs")
    texts = fit_to_model(
        texts,
        gateway.tokenizer,
        prompt,
        truncate=bool(body.truncate),
        direction=body.truncation_direction,
    )
    # the prompt travels as an option: models that pool without it (include_prompt=false) need
    # to know where it ends
    options = wire_options(gateway, prompt, body.dimensions)
    vectors = await gateway.embedder.embed(texts, options)
    if normalize and not model.normalize:
        vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    vectors = shape_vectors(vectors, body.dimensions, normalize)
    return vectors.tolist()


@router.get("/info")
async def info(gateway: GatewayDep) -> dict[str, object]:
    """TEI's Info. The batching figures are the workers' (EMBEDFLEET_TOKEN_BUDGET and
    EMBEDFLEET_MAX_BATCH, auto resolved for EMBEDFLEET_DEVICE, CPU's under auto)."""
    settings = gateway.settings
    model = served_model(gateway)
    batching = settings.batching("cuda" if settings.device == "cuda" else "cpu")
    return {
        "model_id": model.name,
        "model_sha": None,
        "model_dtype": "float16",  # on the wire, results are fp16
        "served_model_name": gateway.served_name,
        "model_type": {"embedding": {"pooling": "model"}},
        "max_concurrent_requests": settings.gateway_lane_high_water,
        "max_input_length": model.max_length,
        "max_batch_tokens": batching.token_budget,
        "max_batch_requests": batching.max_batch,
        "max_client_batch_size": settings.gateway_max_inputs,
        "auto_truncate": False,
        "tokenization_workers": 1,
        "version": _version(),
        "sha": None,
        "docker_label": None,
        "prompts": model.prompts or None,
    }


@router.get("/health")
@router.get("/ping")
@router.get("/")
async def health(gateway: GatewayDep) -> Response:
    """200 (empty) while a worker is alive, 503 without one (TEI's meaning: the model can
    answer). GET / and /ping are TEI's aliases for load balancers and SageMaker."""
    await gateway.fleet.require_worker()
    return Response(status_code=200)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, gateway: GatewayDep) -> list[list[dict[str, Any]]]:
    """The model's tokens of each input (with the prompt in front, as it is embedded): id, text,
    special, and start/stop as byte offsets into the input (TEI's SimpleToken)."""
    inputs = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    if not inputs:
        raise APIError(400, "`inputs` cannot be empty", param="inputs", code="empty_input")
    check_limits(inputs, gateway.settings, "inputs")
    prompt = gateway.prompt_text(body.prompt_name) if body.prompt_name else ""
    texts = [prompt + text for text in inputs]
    encodings = gateway.tokenizer.tokenizer.encode_batch(
        texts, add_special_tokens=body.add_special_tokens
    )
    return [simple_tokens(text, encoding) for text, encoding in zip(texts, encodings, strict=True)]


@router.post("/decode")
async def decode(body: DecodeRequest, gateway: GatewayDep) -> list[str]:
    # [] is one empty sequence, as TEI reads it (its untagged enum tries a single one first)
    single = not body.ids or isinstance(body.ids[0], int)
    ids: Sequence[list[int]] = [body.ids] if single else body.ids  # type: ignore[list-item]
    limit = gateway.settings.gateway_max_inputs
    if len(ids) > limit:
        raise APIError(
            413,
            f"batch size {len(ids)} > maximum allowed batch size {limit} "
            "(EMBEDFLEET_GATEWAY_MAX_INPUTS); split the request",
            param="ids",
            code="too_many_inputs",
        )
    vocab = gateway.tokenizer.vocab_size
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
    return gateway.tokenizer.tokenizer.decode_batch(
        list(ids), skip_special_tokens=body.skip_special_tokens
    )


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
