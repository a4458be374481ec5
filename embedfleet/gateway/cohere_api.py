"""Cohere's and Jina's rerank, ``POST /v1/rerank``: ``{model, query, documents, top_n?,
return_documents?}`` -> ``{"id", "model", "results": [{"index", "relevance_score",
"document"?: {"text"}}], "usage": {"total_tokens"}}``, highest score first. Its errors are in
OpenAI's envelope (the dialect of the clients that send it); the scores are the TEI route's
(gateway/rerank_api.py)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from pydantic import BaseModel

from embedfleet.gateway.errors import APIError, ErrorDialect, dialect_router
from embedfleet.gateway.rerank_api import ranked, rerank_scores
from embedfleet.gateway.state import GatewayDep

DIALECT = ErrorDialect.openai
router = dialect_router(DIALECT)


class Document(BaseModel):
    text: str


class CohereRerankRequest(BaseModel):
    model: str
    query: str
    documents: list[str | Document]
    top_n: int | None = None
    return_documents: bool = False
    max_chunks_per_doc: int | None = None  # Cohere v1's; documents are scored whole here


@router.post("/v1/rerank")
async def rerank_v1(body: CohereRerankRequest, gateway: GatewayDep) -> dict[str, Any]:
    """Cohere's and Jina's rerank: documents as strings or ``{"text"}`` objects."""
    documents = [d if isinstance(d, str) else d.text for d in body.documents]
    if body.top_n is not None and body.top_n < 1:
        raise APIError(400, "`top_n` must be at least 1", param="top_n", code="invalid_value")
    async with gateway.request_bound():
        gateway = await gateway.for_model(body.model)
        scores = await rerank_scores(
            gateway, body.query, documents, param="documents", dialect=DIALECT
        )
    order = ranked(scores)[: body.top_n or len(documents)]
    results = []
    for index in order:
        result: dict[str, Any] = {"index": index, "relevance_score": float(scores[index])}
        if body.return_documents:
            result["document"] = {"text": documents[index]}
        results.append(result)
    limit = (await gateway.require_card()).max_length
    tokens = await asyncio.to_thread(gateway.tokenizer.usage, [body.query, *documents], limit)
    return {
        "id": uuid.uuid4().hex,
        "model": gateway.served_name,
        "results": results,
        "usage": {"total_tokens": tokens},
        "meta": {"billed_units": {"search_units": 1}},
    }
