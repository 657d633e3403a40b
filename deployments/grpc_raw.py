"""What Serve's gRPC proxy registers for the public API (``SERVICER_FUNCTIONS``).

Like the generated ``add_SpecServeServicer_to_server``, but requests pass through the proxy
as raw bytes (no request deserializer): the Router deployment parses them itself, so bytes
that are no ``GenerateRequest`` get INVALID_ARGUMENT through the one status mapping, not a
proxy-side UNKNOWN. Imported by the proxy process: light imports only (grpc and the stubs).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2

from specserve.proto_gen.specserve.v1 import specserve_pb2 as pb

SERVICE = "specserve.v1.SpecServe"
HEALTH = "grpc.health.v1.Health"


def _register(server, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    add_registered = getattr(server, "add_registered_method_handlers", None)
    if add_registered is not None:
        add_registered(service, handlers)


def add_SpecServeServicer_to_server(servicer, server) -> None:
    _register(server, SERVICE, {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=None,
            response_serializer=pb.GenerateChunk.SerializeToString),
        "GenerateUnary": grpc.unary_unary_rpc_method_handler(
            servicer.GenerateUnary, request_deserializer=None,
            response_serializer=pb.GenerateResponse.SerializeToString),
    })


def add_HealthServicer_to_server(servicer, server) -> None:
    """grpc.health.v1 ``Check`` (raw bytes, answered by the Router deployment)."""
    _register(server, HEALTH, {
        "Check": grpc.unary_unary_rpc_method_handler(
            servicer.Check, request_deserializer=None,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
    })
