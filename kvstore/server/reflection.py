"""gRPC server reflection under both names clients ask for: ``grpc.reflection.v1`` and ``grpc.reflection.v1alpha``.

Verbs:

- ``enable(server, service_names)``: registers reflection on ``server`` under both package names and lists
  ``service_names`` plus both reflection services. Current grpcurl and Postman ask ``v1`` first, older tools
  ``v1alpha``; each gets the same answers.

grpcio-reflection ships only the ``v1alpha`` servicer. The two protocols are the same messages with the same
field numbers under another package name, so the ``v1`` service is the ``v1alpha`` servicer behind a handler with
the ``v1`` method path, and a ``v1`` descriptor (the ``v1alpha`` file renamed) is added to the descriptor pool so
that reflection can describe the ``v1`` service itself.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as alpha_pb2

V1_PACKAGE = "grpc.reflection.v1"
V1_FILE = "grpc/reflection/v1/reflection.proto"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME


def enable(server: grpc.Server, service_names: Iterable[str]) -> None:
    """Serve reflection v1 and v1alpha on ``server``, listing ``service_names`` and the reflection services."""
    _add_v1_descriptor(descriptor_pool.Default())
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    servicer = reflection.ReflectionServicer(names)
    for package in (V1_PACKAGE, alpha_pb2.DESCRIPTOR.package):
        method = grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=alpha_pb2.ServerReflectionRequest.FromString,
            response_serializer=alpha_pb2.ServerReflectionResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(f"{package}.ServerReflection", {"ServerReflectionInfo": method}),)
        )


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """The v1 reflection file, built from the v1alpha one with its package renamed (once per pool)."""
    try:
        pool.FindFileByName(V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    old = f".{proto.package}."
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    proto.options.Clear()  # the v1alpha file's language options (package names of generated code) do not apply
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # assigning "" would mark a scalar field as typed
                field.type_name = field.type_name.replace(old, f".{V1_PACKAGE}.")
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, f".{V1_PACKAGE}.")
            method.output_type = method.output_type.replace(old, f".{V1_PACKAGE}.")
    pool.Add(proto)
