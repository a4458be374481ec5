"""The model's default route: SageMaker's POST /invocations and TEI's POST /, one door onto
the route that answers the served model's kind of request, as TEI's router chooses it by the
model's type (an embedding model: /embed; a SPLADE model: /embed_sparse; a cross-encoder:
/predict, or /rerank for a ``{query, texts}`` body, the one payload TEI's Vertex route tells
apart by its shape). A sentence-similarity body (``{"inputs": {"source_sentence", ...}}``) goes
to /similarity: ``huggingface_hub.InferenceClient(base_url).sentence_similarity`` posts it to
the base URL itself. GET /ping (SageMaker's health check) is TEI's /health (tei_api).

The body is validated as the chosen route's, and answered by that route's handler, so its
limits, defaults and errors are that route's, in TEI's dialect."""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from fastapi import Body
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from embedfleet.gateway import rerank_api, similarity_api, tei_api
from embedfleet.gateway.errors import ErrorDialect, dialect_router
from embedfleet.gateway.state import Gateway, GatewayDep

router = dialect_router(ErrorDialect.tei)
M = TypeVar("M", bound=BaseModel)


def parsed(model: type[M], payload: object) -> M:
    """``payload`` as the chosen route's body; its problems as FastAPI's own validation error,
    so they answer as that route's would."""
    try:
        return model.model_validate(payload)
    except ValidationError as error:
        raise RequestValidationError(error.errors(include_url=False)) from None


def is_rerank(payload: object) -> bool:
    return isinstance(payload, dict) and "query" in payload and "texts" in payload


async def answer(payload: object, gateway: Gateway) -> Any:
    """The answer of the route the served model gives ``payload`` (see the module's docstring)."""
    if similarity_api.is_similarity(payload):
        return await similarity_api.similarity(
            parsed(similarity_api.SimilarityRequest, payload), gateway
        )
    if is_rerank(payload):
        return await rerank_api.rerank(parsed(rerank_api.RerankRequest, payload), gateway)
    model = payload.get("model") if isinstance(payload, dict) else None
    # None before any worker published: an embedding model is assumed (what the fleet serves
    # unless told otherwise), and /embed lets the worker refuse what it cannot honour
    card = await (await gateway.for_model(model if isinstance(model, str) else None)).model_card()
    if card is not None and card.serves("rerank"):
        return await rerank_api.predict(parsed(rerank_api.PredictRequest, payload), gateway)
    if card is not None and card.serves("sparse") and not card.serves("dense"):
        sparse = parsed(rerank_api.EmbedSparseRequest, payload)
        return await rerank_api.embed_sparse(sparse, gateway)
    return await tei_api.embed(parsed(tei_api.EmbedRequest, payload), gateway)


@router.post("/invocations")
@router.post("/")
async def invocations(gateway: GatewayDep, payload: Annotated[Any, Body()]) -> Any:
    """SageMaker's inference route (and TEI's POST /): the served model's default route."""
    return await answer(payload, gateway)
