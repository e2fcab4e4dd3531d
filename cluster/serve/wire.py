"""Registers the Generation service on Serve's gRPC proxy with a request decoder that
never throws.

The proxy parses each request with the generated deserializer before any of our code
runs. Bytes that do not parse (invalid UTF-8 in a string field, a corrupt wire format)
would make grpc answer UNKNOWN "Unexpected DecodeError ..."; here they become an
`Undecodable` that the Router answers with INVALID_ARGUMENT, after checking the API key.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from cluster.proto import generation_pb2_grpc


@dataclass
class Undecodable:
    """Stands in for a request whose bytes did not parse (pickled to the Router)."""
    error: str


def _lenient(decode):
    def parse(raw: bytes):
        try:
            return decode(raw)
        except DecodeError as e:
            return Undecodable(str(e))
    return parse


class _LenientServer:
    """Receives the generated registration and hands it on with lenient deserializers.
    The generic handler is built from the registered-method table (grpcio >= 1.63 code
    passes both), so no private attribute of grpc is touched."""

    def __init__(self, server):
        self.server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # rebuilt in add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        wrapped = {name: h._replace(request_deserializer=_lenient(h.request_deserializer))
                   for name, h in handlers.items()}
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, wrapped),))
        self.server.add_registered_method_handlers(service, wrapped)


def add_GenerationServicer_to_server(servicer, server) -> None:  # noqa: N802 - grpc's naming
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, _LenientServer(server))
