"""Infinity's image route: POST /embeddings_image (and /v1/embeddings_image, for a client whose
base URL ends in /v1, as Infinity's ``--url-prefix /v1`` serves it).

Infinity's body (infinity_emb's ``ImageEmbeddingInput``): ``input``, one image or a list of
them, ``model``, ``encoding_format`` (``float`` or ``base64``) and ``user``; its answer and its
errors are OpenAI's. Each input is an image as a base64 data URI (gateway/images.py); where
Infinity also fetches an http(s) URL, this gateway refuses it (400 ``url_not_accepted``): it
sends nothing anywhere. The same checks, lanes and answers as /v1/embeddings
(openai_api.dense_embeddings), with images alone."""

from __future__ import annotations

import asyncio
from typing import Literal

from pydantic import BaseModel

from embedfleet.gateway.errors import ErrorDialect, dialect_router
from embedfleet.gateway.images import require_image_uris
from embedfleet.gateway.openai_api import EmbeddingRequest, dense_embeddings, embeddings_response
from embedfleet.gateway.state import GatewayDep

router = dialect_router(ErrorDialect.openai)


class ImageEmbeddingRequest(BaseModel):
    input: str | list[str]
    # Infinity's is optional too (its default names no model): left out, the one model served
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None


@router.post("/embeddings_image")
@router.post("/v1/embeddings_image")
async def embeddings_image(body: ImageEmbeddingRequest, gateway: GatewayDep) -> dict[str, object]:
    # the form first, by the prefixes alone (before the model's card is read): images only
    require_image_uris(body.input)
    request = EmbeddingRequest(input=body.input, model=body.model, user=body.user)
    answer = await dense_embeddings(request, gateway, "float32")
    return await asyncio.to_thread(
        embeddings_response, answer.model, answer.vectors, body.encoding_format, answer.tokens
    )
