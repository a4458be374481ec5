"""Vertex AI's prediction route as TEI serves it: POST /vertex, ``{"instances": [...]}`` ->
``{"predictions": [...]}``, each instance a body of the model's default route and each
prediction that route's answer (invocations_api.answer: /embed, /embed_sparse, /predict,
/rerank or /similarity, by the instance's shape and the served model)."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel

from embedfleet.gateway.errors import APIError, ErrorDialect, dialect_router
from embedfleet.gateway.invocations_api import answer
from embedfleet.gateway.state import GatewayDep

router = dialect_router(ErrorDialect.tei)


class VertexRequest(BaseModel):
    instances: list[Any]


@router.post("/vertex")
async def vertex(body: VertexRequest, gateway: GatewayDep) -> dict[str, list[Any]]:
    limit = gateway.settings.gateway_max_inputs
    if len(body.instances) > limit:
        raise APIError(
            413,
            f"{len(body.instances)} instances > maximum allowed batch size {limit} "
            "(EMBEDFLEET_GATEWAY_MAX_INPUTS); split the request",
            param="instances",
            code="too_many_inputs",
        )
    # concurrently, as TEI joins them: each instance is its own request on the fleet
    predictions = await asyncio.gather(*(answer(item, gateway) for item in body.instances))
    return {"predictions": list(predictions)}
