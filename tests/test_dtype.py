"""BlockHeader.dtype on Put: the names the clients send are stored and echoed; empty or unknown is refused with
INVALID_ARGUMENT naming the allowed ones, on the gRPC Put and on a lane; kvstore.proto lists the same names."""

from __future__ import annotations

import re

import grpc
import numpy as np
import pytest
import torch

from kvstore.checksum import crc32c
from kvstore.client import Client, KVStoreError
from kvstore.server.validate import WIRE_DTYPES
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.conftest import ROOT
from tests.test_lanes_support import RawLanes, header

KEY = bytes(range(16))


def put_raw(server, dtype: str) -> pb.PutResponse:
    data = b"\x01" * 64
    hdr = pb.BlockHeader(hash=KEY, raw_length=64, stored_length=64, crc32c=crc32c(data), dtype=dtype)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        return pb_grpc.KVStoreStub(channel).Put(iter([pb.PutRequest(namespace="ns", header=hdr, data=data)]))


@pytest.mark.parametrize("dtype", ["", "float64", "bf16", "UINT8"])
def test_empty_or_unknown_dtype_is_refused(server, dtype):
    with pytest.raises(grpc.RpcError) as err:
        put_raw(server, dtype)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("dtype is empty" if not dtype else f"dtype {dtype!r} is unknown") in err.value.details()
    assert all(name in err.value.details() for name in WIRE_DTYPES)
    assert server.store.stats()["blocks"] == 0


@pytest.mark.parametrize("dtype", WIRE_DTYPES)
def test_every_allowed_dtype_is_stored_and_echoed(server, dtype):
    assert put_raw(server, dtype).results[0].status == pb.PUT_STORED
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        got = list(pb_grpc.KVStoreStub(channel).Get(pb.GetRequest(namespace="ns", hashes=[KEY]), timeout=10))
    assert got[0].header.dtype == dtype


def test_an_empty_dtype_is_refused_on_a_lane(server):
    raw = RawLanes(server)
    with pytest.raises(KVStoreError) as err:
        raw.tcp().put("ns", [header(KEY, b"abc", dtype="")], [memoryview(b"abc")])
    raw.close()
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "dtype is empty" in err.value.message


PAYLOADS = {
    "torch bfloat16": lambda: torch.ones(64, dtype=torch.bfloat16),
    "torch float16": lambda: torch.ones(64, dtype=torch.float16),
    "torch float32": lambda: torch.ones(64, dtype=torch.float32),
    "torch float8_e4m3fn": lambda: torch.ones(64).to(torch.float8_e4m3fn),
    "torch int8": lambda: torch.ones(64, dtype=torch.int8),
    "torch uint8": lambda: torch.ones(64, dtype=torch.uint8),
    "numpy float16": lambda: np.ones(64, dtype=np.float16),
    "numpy int8": lambda: np.ones(64, dtype=np.int8),
    "bytes": lambda: b"\x02" * 64,
    "bytearray": lambda: bytearray(64),
}


@pytest.mark.parametrize("lane", ["grpc", "tcp", "shm"])
def test_what_the_client_sends_is_accepted(server, lane):
    keys = [bytes([i]) * 16 for i in range(len(PAYLOADS))]
    with Client(f"127.0.0.1:{server.port}", lane=lane, timeout=10) as kv:
        results = kv.put("ns", keys, [make() for make in PAYLOADS.values()])
        assert [r.status for r in results] == ["stored"] * len(PAYLOADS), [r.reason for r in results]


def test_the_proto_lists_the_allowed_dtypes():
    proto = (ROOT / "proto/kvstore/v1/kvstore.proto").read_text()
    comment = proto[: proto.index("string dtype = 7;")].rsplit("bytes parent = 2;", 1)[1]
    listed = re.findall(r'"([a-z0-9_]+)"', comment.split("Empty or")[0])
    assert tuple(sorted(set(listed))) == WIRE_DTYPES
