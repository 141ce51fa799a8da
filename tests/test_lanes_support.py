"""Helpers for the lane tests (no tests here): raw lanes opened over gRPC, without the Client's pool."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from kvstore.checksum import crc32c
from kvstore.lanes.base import host_id
from kvstore.lanes.client.shm import ShmClientLane
from kvstore.lanes.client.tcp import TcpClientLane
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import lanes_pb2 as lpb
from kvstore.v1 import lanes_pb2_grpc as lpb_grpc


class RawLanes:
    """A gRPC channel to a test server and the KVStoreLanes stub on it."""

    def __init__(self, server, token: str | None = None):
        self.server = server
        self.channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        self.stub = lpb_grpc.KVStoreLanesStub(self.channel)
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()

    def open(self, kind: int) -> lpb.OpenLaneResponse:
        reply = self.stub.OpenLane(
            lpb.OpenLaneRequest(kinds=[kind], host_id=host_id()), timeout=10, metadata=self.metadata
        )
        assert reply.kind == kind, reply.reason
        return reply

    def shm(self) -> ShmClientLane:
        return ShmClientLane(self.stub, self.open(lpb.LANE_SHM), self.metadata, 10.0)

    def cuda_ipc(self) -> ShmClientLane:
        from kvstore.lanes.client.cuda import CudaIpcClientLane

        return CudaIpcClientLane(self.stub, self.open(lpb.LANE_CUDA_IPC), self.metadata, 10.0)

    def region_lane(self, kind: str) -> ShmClientLane:
        """The shm or cuda_ipc lane (they speak the same LanePut/LaneGet messages)."""
        return self.cuda_ipc() if kind == "cuda_ipc" else self.shm()

    def tcp(self, opened: lpb.OpenLaneResponse | None = None) -> TcpClientLane:
        opened = opened or self.open(lpb.LANE_TCP)
        return TcpClientLane("127.0.0.1", opened.tcp_port, opened, 10.0)

    def close(self) -> None:
        self.channel.close()


def header(key: bytes, data: bytes, **kw) -> pb.BlockHeader:
    fields = dict(hash=key, raw_length=len(data), stored_length=len(data), crc32c=crc32c(data), dtype="uint8")
    fields.update(kw)
    return pb.BlockHeader(**fields)


def keys(n: int, seed: int = 0) -> list[bytes]:
    return [bytes([seed, i]) * 8 for i in range(n)]


def drain(it: Iterator) -> list:
    return list(it)
