"""The gateway's one gRPC server, beside HTTP in the same process when
EMBEDFLEET_GATEWAY_GRPC_PORT is set: TEI's ``tei.v1`` (tei_grpc/) and the fleet's own
``embedfleet.v1`` (fleet_grpc/) on the same port, with what TEI's gRPC server registers beside
them: ``grpc.health.v1.Health`` and server reflection. Every call, whichever service, is counted
in the gateway's request series here (``CallMetrics``), the one place both doors pass."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from embedfleet.gateway.fleet_grpc import fleet_pb2
from embedfleet.gateway.fleet_grpc.server import add_fleet_services
from embedfleet.gateway.metrics import GatewayMetrics
from embedfleet.gateway.readiness import readiness
from embedfleet.gateway.state import Gateway
from embedfleet.gateway.tei_api import model_type
from embedfleet.gateway.tei_grpc import tei_pb2
from embedfleet.gateway.tei_grpc.server import add_tei_services
from embedfleet.shared.logging import get_logger

log = get_logger("embedfleet.gateway.grpc")

# How long a stopping gateway lets calls in flight finish
SHUTDOWN_GRACE_S = 5.0
# How often a health Watch looks again (each look is /readyz's Redis round trip)
WATCH_INTERVAL_S = 2.0

# grpc.health.v1's ServingStatus values (protobuf's enum values are ints)
SERVING: int = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING: int = health_pb2.HealthCheckResponse.NOT_SERVING
TEI_SERVICES = {name: s.full_name for name, s in tei_pb2.DESCRIPTOR.services_by_name.items()}
FLEET_SERVICES = [s.full_name for s in fleet_pb2.DESCRIPTOR.services_by_name.values()]
# TEI's per-service health (router/src/grpc/server.rs): Info and Tokenize serve while the
# gateway does; Embed, Predict and Rerank while the model can answer, and only those the served
# model's type gives (an embedding model's Rerank is never SERVING)
MODEL_SERVICES = {
    "embedding": {TEI_SERVICES["Embed"]},
    "classifier": {TEI_SERVICES["Predict"]},
    "reranker": {TEI_SERVICES["Predict"], TEI_SERVICES["Rerank"]},
}
ALL_MODEL_SERVICES = set().union(*MODEL_SERVICES.values())


class GatewayHealth(health_pb2_grpc.HealthServicer):
    """``grpc.health.v1.Health`` for one gateway, asked of its state at each Check (no key, as
    TEI's; probes carry none). The server as a whole (service ``""``), tei.v1's Info and
    Tokenize and embedfleet.v1's Fleet: SERVING while the gateway is ready (/readyz's answer,
    gateway/readiness.py: its Redis answers); TEI's Embed, Predict and Rerank: SERVING while,
    besides, a worker is alive (TEI's /health) and the served model gives that service."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def status(self, service: str) -> int | None:
        """The service's status now; None for a service this server does not serve."""
        if service not in ("", *TEI_SERVICES.values(), *FLEET_SERVICES):
            return None
        try:
            await readiness(self.gateway)
            if service not in ALL_MODEL_SERVICES:
                return SERVING
            card = await self.gateway.model_card()
            if card is None or await self.gateway.fleet.live_workers() == 0:
                return NOT_SERVING
        except Exception as error:  # Redis unreachable or hung: not ready
            log.debug("gRPC health: not ready", error=repr(error))
            return NOT_SERVING
        (kind,) = model_type(card)
        return SERVING if service in MODEL_SERVICES[kind] else NOT_SERVING

    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        status = await self.status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """The status now, then each change, looked at every WATCH_INTERVAL_S; an unknown
        service is SERVICE_UNKNOWN (the protocol's answer: it may appear later)."""
        last = None
        while True:
            status = await self.status(request.service)
            if status is None:
                status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(WATCH_INTERVAL_S)


Behaviour = Callable[..., Any]


class CallMetrics(grpc.aio.ServerInterceptor):
    """Counts every call in the request series (``GatewayMetrics.grpc_call``): route the
    call's full method name, method ``gRPC``, status its HTTP equivalent."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:  # no such method: gRPC answers UNIMPLEMENTED
            return handler
        route = details.method
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behaviour = getattr(handler, kind)
            if behaviour is not None:
                return handler._replace(**{kind: self._counted(behaviour, route)})
        return handler

    def _counted(self, behaviour: Behaviour, route: str) -> Behaviour:
        metrics = self.metrics
        if inspect.isasyncgenfunction(behaviour):

            async def streamed(request: Any, context: grpc.aio.ServicerContext) -> Any:
                with metrics.grpc_call(route):
                    async for answer in behaviour(request, context):
                        yield answer

            return streamed

        async def answered(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with metrics.grpc_call(route):
                return await behaviour(request, context)

        return answered


async def start_grpc_server(gateway: Gateway) -> grpc.aio.Server | None:
    """tei.v1's and embedfleet.v1's services, health and reflection on
    EMBEDFLEET_GATEWAY_HOST:EMBEDFLEET_GATEWAY_GRPC_PORT, started on the running loop (the HTTP
    server's); None where no port is set. A message is read up to
    EMBEDFLEET_GATEWAY_MAX_BODY_BYTES, the HTTP body's limit (RESOURCE_EXHAUSTED beyond it).
    gRPC binds with SO_REUSEPORT, so `embedfleet serve --workers N` shares the port."""
    settings = gateway.settings
    if settings.gateway_grpc_port is None:
        return None
    server = grpc.aio.server(
        interceptors=[CallMetrics(gateway.metrics)],
        options=[("grpc.max_receive_message_length", settings.gateway_max_body_bytes)],
    )
    add_tei_services(gateway, server)
    add_fleet_services(gateway, server)
    health_pb2_grpc.add_HealthServicer_to_server(GatewayHealth(gateway), server)
    health = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    served = [*TEI_SERVICES.values(), *FLEET_SERVICES, health, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(served, server)
    address = f"{settings.gateway_host}:{settings.gateway_grpc_port}"
    try:
        server.add_insecure_port(address)
    except RuntimeError as error:
        raise RuntimeError(
            f"the gateway's gRPC API cannot listen on {address} ({error}): free the port or set "
            "EMBEDFLEET_GATEWAY_GRPC_PORT to another (unset: no gRPC)"
        ) from None
    await server.start()
    log.info("gRPC (tei.v1, embedfleet.v1, health, reflection) started", address=address)
    return server


async def stop_grpc_server(server: grpc.aio.Server | None) -> None:
    if server is not None:
        await server.stop(SHUTDOWN_GRACE_S)
