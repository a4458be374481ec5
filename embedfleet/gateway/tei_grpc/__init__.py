"""TEI's gRPC API (``tei.v1``) over the fleet: TEI's published proto, vendored verbatim in
``third_party/`` (``tei.proto``, with NOTICE: where it came from, TEI's version, its licence),
the module of its messages generated from it (``tei_pb2.py``, by ``generate.py``), and the
server the gateway runs beside HTTP when EMBEDFLEET_GATEWAY_GRPC_PORT is set (``server.py``)."""
