"""A gRPC service's server side and client stub, read off its descriptor in a ``*_pb2`` module
(``tei_pb2``, ``fleet_pb2``) instead of protoc's generated ``*_pb2_grpc`` module.

What protoc's grpc plugin writes for each service is the same few lines again a method: the
method's path, its kind (unary or streamed each way) and its messages' (de)serializers. All of
that is in the service's descriptor, so one function registers any service and one builds any
client stub; the servicer is a plain object with a coroutine per method name.

    from embedfleet.gateway.grpc_services import stub
    from embedfleet.gateway.tei_grpc import tei_pb2

    embed = stub(channel, tei_pb2.DESCRIPTOR.services_by_name["Embed"])
    embed.Embed(tei_pb2.EmbedRequest(inputs="a text"))

Nor are the ``*_pb2`` modules protoc's Python output: each holds its proto's compiled descriptor
(protoc's, by tei_grpc/generate.py) and hands it to ``build_messages``, which makes the module's
message classes and enums at import as protoc's module would, once for every proto.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import FileDescriptor, MethodDescriptor, ServiceDescriptor
from google.protobuf.internal import builder
from google.protobuf.message_factory import GetMessageClass


def build_messages(module: dict[str, Any], serialized: bytes) -> FileDescriptor:
    """A ``*_pb2`` module's contents, as protoc's Python output makes them at import: the proto
    of ``serialized`` (a FileDescriptorProto) added to protobuf's default pool, and a class a
    message, an enum wrapper an enum and a constant an enum value set in ``module`` (the
    module's ``globals()``). Returns the file's descriptor, the module's ``DESCRIPTOR``."""
    file = descriptor_pool.Default().AddSerializedFile(serialized)
    # protoc's generated modules call these two (protobuf's builder for its gencode)
    builder.BuildMessageAndEnumDescriptors(file, module)
    builder.BuildTopDescriptorsAndMessages(file, module["__name__"], module)
    return file


def _kind(method: MethodDescriptor) -> str:
    """The method's cardinality as grpc names its handlers and channel calls (``unary_stream``:
    one request, a stream of answers)."""
    requests = "stream" if method.client_streaming else "unary"
    answers = "stream" if method.server_streaming else "unary"
    return f"{requests}_{answers}"


def _path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def add_service(server: grpc.aio.Server, service: ServiceDescriptor, servicer: object) -> None:
    """Every method of ``service`` on ``server``, answered by the servicer's attribute of the
    method's name. Raises AttributeError naming the first method the servicer lacks (protoc's
    base class would answer it UNIMPLEMENTED at call time; a served method is never missing)."""
    handlers = {}
    for method in service.methods:
        make_handler = getattr(grpc, f"{_kind(method)}_rpc_method_handler")
        handlers[method.name] = make_handler(
            getattr(servicer, method.name),
            request_deserializer=GetMessageClass(method.input_type).FromString,
            response_serializer=GetMessageClass(method.output_type).SerializeToString,
        )
    # as protoc's add_*Servicer_to_server registers them: by name, and the registered-method
    # table grpc looks calls up in first
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)


def stub(channel: grpc.Channel | grpc.aio.Channel, service: ServiceDescriptor) -> Any:
    """A client of ``service`` on ``channel``: an attribute a method, called as protoc's
    ``*Stub``'s are (``stub.Embed(request, metadata=...)``; a streamed method takes an iterator
    of requests). Any, as the generated stubs are: the methods are known only at run time."""
    calls = {
        method.name: getattr(channel, _kind(method))(
            _path(method),
            request_serializer=GetMessageClass(method.input_type).SerializeToString,
            response_deserializer=GetMessageClass(method.output_type).FromString,
            _registered_method=True,
        )
        for method in service.methods
    }
    return SimpleNamespace(**calls)
