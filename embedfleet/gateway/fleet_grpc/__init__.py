"""The fleet's own gRPC API (``embedfleet.v1``): its proto (``fleet.proto``, written from
docs/PROTOCOL.md's chunk options and result), the module of its messages generated from it
(``fleet_pb2.py``, by tei_grpc/generate.py), and its servicer (``server.py``), which the
gateway serves beside TEI's tei.v1 on EMBEDFLEET_GATEWAY_GRPC_PORT (gateway/grpc_server.py)."""
