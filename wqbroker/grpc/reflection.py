"""Server reflection: how grpcurl and other generic tools find the API's services and messages,
to call any method by name (the health check included).

Both versions of the service are served: ``grpc.reflection.v1.ServerReflection``, which current
tools ask first, and ``grpc.reflection.v1alpha.ServerReflection``, which older ones ask.
grpcio-reflection implements only v1alpha (grpc/grpc#38576); the two versions have the same
messages under another package name (the same bytes on the wire), so v1 is served by the same
servicer, and its description (``grpc/reflection/v1/reflection.proto``, made from v1alpha's with
the package renamed) is added to the descriptor pool, so that reflection describes it too.

Reflection is open without a token (``wqbroker.auth``'s ``NO_TOKEN``): it tells only what the
public ``.proto`` does, and a tool needs it to reach the health check, which is open too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA: Final = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1: Final = "grpc.reflection.v1.ServerReflection"
V1_FILE: Final = "grpc/reflection/v1/reflection.proto"
_METHOD: Final = "ServerReflectionInfo"


def _v1_file() -> descriptor_pb2.FileDescriptorProto:
    """v1's description: v1alpha's, in package ``grpc.reflection.v1`` (with upstream's options)."""
    file = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(file)
    old, new = f".{file.package}.", ".grpc.reflection.v1."
    file.name = V1_FILE
    file.package = "grpc.reflection.v1"
    file.options.java_package = "io.grpc.reflection.v1"
    file.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    file.options.ClearField("deprecated")
    for message in file.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # (a message's; a scalar field has none)
                field.type_name = field.type_name.replace(old, new, 1)
    for service in file.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new, 1)
            method.output_type = method.output_type.replace(old, new, 1)
    return file


def _described_v1() -> FileDescriptor:
    """v1's description in the default pool (added unless it is there: a grpcio-reflection of
    the future, say)."""
    pool = descriptor_pool.Default()
    try:
        found: FileDescriptor = pool.FindServiceByName(V1).file
    except KeyError:
        pool.AddSerializedFile(_v1_file().SerializeToString())
        found = pool.FindFileByName(V1_FILE)
    return found


V1_DESCRIPTOR: Final = _described_v1()  # (as a generated module's DESCRIPTOR)


def enable(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """Serve both versions of reflection on ``server``, listing ``service_names`` and the two
    reflection services."""
    aio: Any = reflection.aio  # type: ignore[attr-defined]  # (public: the stubs miss it)
    servicer = aio.ReflectionServicer([*service_names, V1, V1ALPHA])
    for name in (V1, V1ALPHA):
        handler = grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
        handlers = {_METHOD: handler}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
        server.add_registered_method_handlers(name, handlers)  # type: ignore[attr-defined]
