"""TEI's gRPC API (``tei.v1``) over the fleet: TEI's published proto (``tei.proto``, vendored
verbatim, see NOTICE), its generated modules, and the server the gateway runs beside HTTP when
EMBEDFLEET_GATEWAY_GRPC_PORT is set (``server.py``)."""
