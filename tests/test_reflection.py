"""Server reflection answers under grpc.reflection.v1 (what grpcurl and Postman ask first) and v1alpha alike."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2 as rpb  # v1 has the same messages and field numbers

EXPECTED = {
    "kvstore.v1.KVStore",
    "kvstore.v1.KVStoreLanes",
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
}


def ask(target: str, package: str, *requests: rpb.ServerReflectionRequest) -> list[rpb.ServerReflectionResponse]:
    with grpc.insecure_channel(target) as channel:
        call = channel.stream_stream(
            f"/{package}.ServerReflection/ServerReflectionInfo",
            request_serializer=rpb.ServerReflectionRequest.SerializeToString,
            response_deserializer=rpb.ServerReflectionResponse.FromString,
        )
        return list(call(iter(requests), timeout=10))


@pytest.mark.parametrize("package", ["grpc.reflection.v1", "grpc.reflection.v1alpha"])
def test_reflection_lists_the_services(server, package):
    (reply,) = ask(f"127.0.0.1:{server.port}", package, rpb.ServerReflectionRequest(list_services=""))
    assert {s.name for s in reply.list_services_response.service} == EXPECTED


@pytest.mark.parametrize(
    ("symbol", "file"),
    [
        ("kvstore.v1.KVStore", "kvstore/v1/kvstore.proto"),
        ("kvstore.v1.PutRequest", "kvstore/v1/kvstore.proto"),
        ("grpc.reflection.v1.ServerReflection", "grpc/reflection/v1/reflection.proto"),
    ],
)
def test_v1_describes_symbols(server, symbol, file):
    (reply,) = ask(
        f"127.0.0.1:{server.port}", "grpc.reflection.v1", rpb.ServerReflectionRequest(file_containing_symbol=symbol)
    )
    assert reply.WhichOneof("message_response") == "file_descriptor_response", reply
    names = [
        descriptor_pb2.FileDescriptorProto.FromString(b).name
        for b in reply.file_descriptor_response.file_descriptor_proto
    ]
    assert file in names


def test_v1_reflection_service_reads_as_v1(server):
    """The v1 file names its own package and message types, not v1alpha's."""
    (reply,) = ask(
        f"127.0.0.1:{server.port}",
        "grpc.reflection.v1",
        rpb.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection"),
    )
    (raw,) = reply.file_descriptor_response.file_descriptor_proto
    proto = descriptor_pb2.FileDescriptorProto.FromString(raw)
    assert proto.package == "grpc.reflection.v1"
    method = proto.service[0].method[0]
    assert (method.input_type, method.output_type) == (
        ".grpc.reflection.v1.ServerReflectionRequest",
        ".grpc.reflection.v1.ServerReflectionResponse",
    )
    assert "v1alpha" not in raw.decode("latin-1")
