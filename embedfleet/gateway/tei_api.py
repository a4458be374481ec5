"""TEI's routes with TEI's names and defaults: POST /embed (and /), GET /info, GET /health."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from embedfleet import __name__ as package_name
from embedfleet.gateway.errors import APIError
from embedfleet.gateway.inputs import as_texts, check_dimensions, check_limits, unit_vectors
from embedfleet.gateway.state import Gateway, GatewayDep, wire_options
from embedfleet.shared.modelcard import ModelCard

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
    """TEI's embed. ``prompt_name`` absent means no prompt, as in TEI (sentence-transformers'
    ``default_prompt_name`` is what its ``encode`` applies, not what TEI's request means)."""
    card = await gateway.model_card()  # None before any worker started: checked afterwards
    check_dimensions(body.dimensions, card.dim if card is not None else None)
    normalize = True if body.normalize is None else body.normalize
    texts = as_texts(body.inputs, gateway.tokenizer, "inputs")
    check_limits(texts, gateway.settings, "inputs")
    if card is not None:
        _check_against_card(card, body, texts, gateway, normalize)
    # the prompt travels by name: the worker owns the model's prompts and knows where one ends
    # (models that pool without it, include_prompt=false)
    vectors = await gateway.embedder.embed(texts, wire_options(body.prompt_name, body.dimensions))
    if card is None:
        # a worker answered, so its card is published: what could not be checked before is now
        # (the vectors are thrown away for a request it refuses)
        card = await gateway.require_card()
        _check_against_card(card, body, texts, gateway, normalize)
    return unit_vectors(vectors, normalize).tolist()


def _check_against_card(
    card: ModelCard, body: EmbedRequest, texts: list[str], gateway: Gateway, normalize: bool
) -> None:
    """What TEI refuses that only the model card can tell: a prompt name the model lacks,
    ``normalize=false`` for a normalising model, a text over the maximum without ``truncate``."""
    check_dimensions(body.dimensions, card.dim)
    if card.normalize and not normalize:
        raise APIError(
            422,
            "normalize=false is not available: this model's pipeline ends in a Normalize "
            "module and the workers return its normalised output",
            param="normalize",
        )
    prompt = ""
    if body.prompt_name is not None:
        try:
            prompt = card.prompt_text(body.prompt_name)
        except ValueError as error:
            raise APIError(422, str(error), param="prompt_name", code="invalid_prompt") from None
    # the worker tokenizes prompt and text together, as sentence-transformers does
    lengths = gateway.tokenizer.lengths([prompt + text for text in texts], card.max_length)
    longest = max(lengths)
    if longest > card.max_length:
        if not body.truncate:
            raise APIError(
                413,
                f"Input validation error: `inputs` must have less than "
                f"{card.max_length} tokens. Given: {longest}. Send truncate=true "
                "to cut them to fit.",
                param="inputs",
            )
        if body.truncation_direction.lower() == "left":
            raise APIError(
                422,
                "truncation_direction=Left is not available: the workers keep the start",
                param="truncation_direction",
            )


@router.get("/info")
async def info(gateway: GatewayDep) -> dict[str, object]:
    """TEI's model description, from the workers' model card; 503 with Retry-After before any
    worker published one (limits a client sizes its batches by must not be made up)."""
    settings = gateway.settings
    card = await gateway.require_card()
    return {
        "model_id": gateway.served_name,
        "model_sha": None,
        "model_dtype": "float16",  # on the wire, results are fp16
        "model_type": {"embedding": {"pooling": "+".join(card.pooling)}},
        "max_concurrent_requests": settings.gateway_lane_high_water,
        "max_input_length": card.max_length,
        "max_batch_tokens": settings.token_budget,
        "max_batch_requests": settings.max_batch,
        "max_client_batch_size": settings.gateway_max_inputs,
        "auto_truncate": False,
        "tokenization_workers": 1,
        "version": _version(),
        "sha": None,
        "docker_label": None,
        "prompts": card.prompts or None,
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
