"""embedfleet/gateway/grpc_services.py: a service registered and called from its descriptor
alone, over a real gRPC server on a loopback port (the fleet's proto; a toy servicer)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from embedfleet.gateway.fleet_grpc import fleet_pb2 as pb
from embedfleet.gateway.grpc_services import _kind, add_service, build_messages, stub
from embedfleet.gateway.tei_grpc import tei_pb2

FLEET = pb.DESCRIPTOR.services_by_name["Fleet"]


class Echo:
    """Fleet's three methods: each input's length as a vector's one byte, the input's count as
    the dimension, so an answer shows which request it came from."""

    async def Info(self, request: pb.InfoRequest, context: object) -> pb.InfoResponse:
        return pb.InfoResponse(model=request.model or "echo")

    async def Embed(self, request: pb.EmbedRequest, context: object) -> pb.EmbedResponse:
        vectors = [pb.Vector(data=bytes([len(text)])) for text in request.inputs]
        return pb.EmbedResponse(vectors=vectors, dim=len(request.inputs))

    async def EmbedStream(
        self, requests: AsyncIterator[pb.EmbedRequest], context: object
    ) -> AsyncIterator[pb.EmbedResponse]:
        async for request in requests:
            yield await self.Embed(request, context)


def test_each_methods_kind_is_read_off_its_streaming_flags() -> None:
    kinds = {
        method.full_name: _kind(method)
        for service in (*tei_pb2.DESCRIPTOR.services_by_name.values(), FLEET)
        for method in service.methods
    }
    assert kinds["embedfleet.v1.Fleet.Embed"] == "unary_unary"
    assert kinds["embedfleet.v1.Fleet.EmbedStream"] == "stream_stream"
    assert kinds["tei.v1.Rerank.RerankStream"] == "stream_unary"
    assert kinds["tei.v1.Info.Info"] == "unary_unary"
    assert set(kinds.values()) == {"unary_unary", "stream_stream", "stream_unary"}


async def test_a_registered_service_answers_its_stub_in_each_kind() -> None:
    server = grpc.aio.server()
    add_service(server, FLEET, Echo())
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            fleet = stub(channel, FLEET)
            info = await fleet.Info(pb.InfoRequest(model="m"))
            embedded = await fleet.Embed(pb.EmbedRequest(inputs=["ab", "abc"]))
            requests = [pb.EmbedRequest(inputs=["a"]), pb.EmbedRequest(inputs=["abcd", "ab"])]
            streamed = [answer async for answer in fleet.EmbedStream(iter(requests))]
    finally:
        await server.stop(None)
    assert info.model == "m"
    assert [v.data for v in embedded.vectors] == [b"\x02", b"\x03"] and embedded.dim == 2
    assert [[v.data for v in answer.vectors] for answer in streamed] == [
        [b"\x01"],
        [b"\x04", b"\x02"],
    ]


async def test_a_servicer_without_one_of_the_methods_is_refused_at_registration() -> None:
    class NoStream:  # Echo's unary methods, not its stream
        Info, Embed = Echo.Info, Echo.Embed

    with pytest.raises(AttributeError, match="EmbedStream"):
        add_service(grpc.aio.server(), FLEET, NoStream())


def test_a_protos_descriptor_builds_the_module_protocs_output_would() -> None:
    from google.protobuf import descriptor_pb2

    proto = descriptor_pb2.FileDescriptorProto(name="test/built.proto", package="built.v1")
    proto.syntax = "proto3"
    enum = proto.enum_type.add(name="Kind")
    for number, name in enumerate(["KIND_UNSPECIFIED", "KIND_DENSE"]):
        enum.value.add(name=name, number=number)
    message = proto.message_type.add(name="Item")
    message.field.add(name="text", number=1, type=9, label=1)  # string
    message.field.add(name="kind", number=2, type=14, label=1, type_name=".built.v1.Kind")
    module: dict[str, Any] = {"__name__": "built_pb2"}
    file = build_messages(module, proto.SerializeToString())
    assert file.name == "test/built.proto" and file.package == "built.v1"
    # a message class, an enum wrapper and its values as constants, as protoc's module has them
    item = module["Item"](text="a", kind=module["KIND_DENSE"])
    assert module["Item"].FromString(item.SerializeToString()) == item
    assert module["Kind"].Name(item.kind) == "KIND_DENSE" and module["KIND_UNSPECIFIED"] == 0
    assert type(item).__module__ == "built_pb2"
    # the real modules are made so: their services' descriptors are the ones the stubs read
    assert tei_pb2.DESCRIPTOR.services_by_name["Embed"].file is tei_pb2.DESCRIPTOR
