"""The fleet's gRPC API (embedfleet.v1), pure logic: its proto says what shared/protocol.py
says, so the two cannot drift apart: the Dtype enum is the protocol's output dtypes, each
EmbedRequest field is a field of /v1/embeddings' body or a chunk option, and the committed
modules are protoc's (tei_grpc/test_server.py checks both protos). The calls themselves:
tests/end_to_end/test_gateway_fleet_grpc.py."""

from __future__ import annotations

import pytest

pytest.importorskip("grpc")  # the gateway's extra

from embedfleet.gateway.fleet_grpc import fleet_pb2 as pb
from embedfleet.gateway.fleet_grpc.server import DTYPES, ENUMS
from embedfleet.gateway.openai_api import EmbeddingRequest
from embedfleet.shared.protocol import OPTION_NAMES, OUTPUT_DTYPES

# the chunk options a /v1/embeddings request does not set (its prompt is none, its vectors the
# model's whole pipeline): the proto leaves them out until the route takes them
NOT_ON_THE_ROUTE = {"prompt_name", "prompt", "normalize"}


def test_the_dtype_enum_is_the_protocols_output_dtypes() -> None:
    named = {value.name for value in pb.Dtype.DESCRIPTOR.values} - {"DTYPE_UNSPECIFIED"}
    assert named == {f"DTYPE_{dtype.upper()}" for dtype in OUTPUT_DTYPES}
    assert set(ENUMS) == set(OUTPUT_DTYPES)
    assert DTYPES[pb.DTYPE_UNSPECIFIED] == "float32"  # /v1/embeddings' answer


def test_each_embed_field_is_the_routes_or_a_chunk_option() -> None:
    fields = {field.name for field in pb.EmbedRequest.DESCRIPTOR.fields}
    route = set(EmbeddingRequest.model_fields) | {"inputs"}  # the route's ``input``
    options = set(OPTION_NAMES)
    assert fields <= route | options, fields - route - options
    # every chunk option the route sets is one here
    assert (options & set(EmbeddingRequest.model_fields)) | {"dtype"} <= fields
    assert options - fields == NOT_ON_THE_ROUTE
