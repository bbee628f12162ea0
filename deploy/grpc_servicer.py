"""The servicer function named in Serve's gRPCOptions: the generated one, made lenient.

Serve's gRPC proxy parses requests with the generated deserializers, before any of our code
runs; a string field with invalid UTF-8 makes protobuf's parse fail and the client would
get a bare INTERNAL. This wrapper registers the same handlers, but a request that does not
parse becomes an empty message whose `model` carries a marker, which the ingress answers
with INVALID_ARGUMENT and a clear message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf.message import DecodeError

from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc

INVALID_UTF8_MARKER = "\x00kvserve:unparsable-request"
_SERVICE = pb.DESCRIPTOR.services_by_name["KVServe"]


def _lenient(method: str, deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    cls = getattr(pb, _SERVICE.methods_by_name[method].input_type.name)

    def parse(data: bytes) -> Any:
        try:
            return (deserialize or cls.FromString)(data)
        except DecodeError:
            msg = cls()
            if "model" in cls.DESCRIPTOR.fields_by_name:
                msg.model = INVALID_UTF8_MARKER
                return msg
            raise

    return parse


def _wrap(handlers: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, h in handlers.items():
        method = key.rsplit("/", 1)[-1]
        if method in _SERVICE.methods_by_name:
            h = h._replace(request_deserializer=_lenient(method, h.request_deserializer))
        out[key] = h
    return out


class _LenientServer:
    def __init__(self, server: Any) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, generic_handlers: Any) -> None:
        for g in generic_handlers:
            if hasattr(g, "_method_handlers"):
                g._method_handlers = _wrap(g._method_handlers)
        self._server.add_generic_rpc_handlers(generic_handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        add = getattr(self._server, "add_registered_method_handlers", None)
        if add is not None:
            add(service, _wrap(handlers))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


def add_KVServeServicer_to_server(servicer: Any, server: Any) -> None:  # noqa: N802 (gRPC naming)
    kvserve_pb2_grpc.add_KVServeServicer_to_server(servicer, _LenientServer(server))
