"""The fleet's gRPC API (``embedfleet.v1``, fleet.proto): /v1/embeddings' vectors as bytes of
the dtype asked for, over HTTP/2, instead of JSON lists of floats.

Each call is a door onto the HTTP route that answers the same question, as tei.v1's are
(tei_grpc/server.py, whose frame it shares: the API key, refusals with TEI's codes, streams
answered in order): ``Embed`` and ``EmbedStream`` are ``openai_api.dense_embeddings`` (the
function POST /v1/embeddings answers with: its checks, limits and lanes), ``Info`` is the model
card the workers publish.
"""

from __future__ import annotations

from typing import Any, cast

import grpc

from embedfleet.gateway import openai_api
from embedfleet.gateway.errors import APIError
from embedfleet.gateway.fleet_grpc import fleet_pb2 as pb
from embedfleet.gateway.grpc_services import add_service
from embedfleet.gateway.state import Gateway
from embedfleet.gateway.tei_grpc.server import (
    GatewayServicer,
    each_call,
    one_call,
    optional_field,
)
from embedfleet.gateway.timing_headers import RequestClock
from embedfleet.shared.protocol import OUTPUT_DTYPES, OutputDtype


def _enum_name(dtype: str) -> str:
    return f"DTYPE_{dtype.upper()}"


# the proto's Dtype of each of the protocol's output dtypes (shared/protocol.py owns the list;
# tests/unit/gateway/fleet_grpc/test_server.py checks the enum holds each, and only those)
ENUMS: dict[str, pb.Dtype] = {
    dtype: cast("pb.Dtype", pb.Dtype.Value(_enum_name(dtype))) for dtype in OUTPUT_DTYPES
}
DTYPES: dict[int, OutputDtype] = {
    number: cast("OutputDtype", dtype) for dtype, number in ENUMS.items()
}
DTYPES[pb.DTYPE_UNSPECIFIED] = "float32"  # /v1/embeddings' answer


class FleetService(GatewayServicer):
    """embedfleet.v1's Fleet service on one gateway."""

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> Any:
        async def answer(clock: RequestClock) -> pb.InfoResponse:
            # the model as /v1/embeddings' ``model`` names it (404 model_not_found otherwise)
            gateway = await self.gateway.for_request(optional_field(request, "model"))
            card = await gateway.require_card()  # 503 before any worker published it
            return pb.InfoResponse(
                model=gateway.served_name,
                dim=card.dim,
                max_tokens=card.max_length,
                normalize=card.normalize,
                compute_dtype=card.dtype,
                representations=card.representations,
                prompt_names=sorted(card.prompts),
                revision=card.revision,
            )

        return await self._unary(context, answer)

    async def _embed(self, request: pb.EmbedRequest, clock: RequestClock) -> pb.EmbedResponse:
        # the route's body: its model checks each field as over HTTP (a ValidationError is
        # INVALID_ARGUMENT with the route's words)
        body = openai_api.EmbeddingRequest(
            input=list(request.inputs),
            model=optional_field(request, "model"),
            dimensions=optional_field(request, "dimensions"),
            truncate=optional_field(request, "truncate"),
            window_overlap=optional_field(request, "window_overlap"),
        )
        dtype = DTYPES.get(request.dtype)
        if dtype is None:  # a value of a newer proto's enum
            raise APIError(
                400,
                f"dtype {request.dtype} is not one of this gateway's: {', '.join(pb.Dtype.keys())}",
                param="dtype",
                code="invalid_dtype",
            )
        answer = await openai_api.dense_embeddings(body, self.gateway, dtype)
        # each row's bytes as the protocol's result ``vec`` holds them (little-endian)
        return pb.EmbedResponse(
            vectors=[pb.Vector(data=row.tobytes()) for row in answer.vectors],
            dtype=ENUMS[answer.dtype],
            dim=answer.dim,
            model=answer.model,
            prompt_tokens=answer.tokens,
        )

    Embed = one_call(_embed)
    EmbedStream = each_call(_embed)


def add_fleet_services(gateway: Gateway, server: grpc.aio.Server) -> None:
    """embedfleet.v1's services, answered for ``gateway``, on ``server``."""
    add_service(server, pb.DESCRIPTOR.services_by_name["Fleet"], FleetService(gateway))
