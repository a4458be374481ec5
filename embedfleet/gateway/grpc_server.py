"""The gateway's one gRPC server, beside HTTP in the same process when
EMBEDFLEET_GATEWAY_GRPC_PORT is set: TEI's ``tei.v1`` (tei_grpc/) and the fleet's own
``embedfleet.v1`` (fleet_grpc/) on the same port."""

from __future__ import annotations

import grpc

from embedfleet.gateway.fleet_grpc.server import add_fleet_services
from embedfleet.gateway.state import Gateway
from embedfleet.gateway.tei_grpc.server import add_tei_services
from embedfleet.shared.logging import get_logger

log = get_logger("embedfleet.gateway.grpc")

# How long a stopping gateway lets calls in flight finish
SHUTDOWN_GRACE_S = 5.0


async def start_grpc_server(gateway: Gateway) -> grpc.aio.Server | None:
    """tei.v1's and embedfleet.v1's services on
    EMBEDFLEET_GATEWAY_HOST:EMBEDFLEET_GATEWAY_GRPC_PORT, started on the running loop (the HTTP
    server's); None where no port is set. A message is read up to
    EMBEDFLEET_GATEWAY_MAX_BODY_BYTES, the HTTP body's limit (RESOURCE_EXHAUSTED beyond it).
    gRPC binds with SO_REUSEPORT, so `embedfleet serve --workers N` shares the port."""
    settings = gateway.settings
    if settings.gateway_grpc_port is None:
        return None
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", settings.gateway_max_body_bytes)]
    )
    add_tei_services(gateway, server)
    add_fleet_services(gateway, server)
    address = f"{settings.gateway_host}:{settings.gateway_grpc_port}"
    try:
        server.add_insecure_port(address)
    except RuntimeError as error:
        raise RuntimeError(
            f"the gateway's gRPC API cannot listen on {address} ({error}): free the port or set "
            "EMBEDFLEET_GATEWAY_GRPC_PORT to another (unset: no gRPC)"
        ) from None
    await server.start()
    log.info("gRPC (tei.v1, embedfleet.v1) started", address=address)
    return server


async def stop_grpc_server(server: grpc.aio.Server | None) -> None:
    if server is not None:
        await server.stop(SHUTDOWN_GRACE_S)
