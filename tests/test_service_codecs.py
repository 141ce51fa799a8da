"""Encoded blocks through the service: verified on write, decoded for readers that do not accept the codec."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvstore.checksum import crc32c
from kvstore.codecs import codec_id, encode
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

KEY = bytes(range(16))


@pytest.fixture
def stub(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield pb_grpc.KVStoreStub(channel)
    channel.close()


def kv_like(n: int) -> bytes:
    rng = np.random.default_rng(3)
    return (rng.standard_normal(n // 2).astype(np.float32) * 0.1).astype(np.float16).tobytes()


@pytest.mark.parametrize("codec", ["zstd", "byteplane"])
def test_encoded_put_then_plain_get(stub, codec):
    raw = kv_like(200_000)
    enc = encode(codec, raw, "float16")
    hdr = pb.BlockHeader(
        hash=KEY,
        codec=codec_id(codec),
        raw_length=len(raw),
        stored_length=len(enc),
        crc32c=crc32c(raw),
        dtype="float16",
    )
    reply = stub.Put(iter([pb.PutRequest(namespace="ns", header=hdr, data=enc)]), timeout=10)
    assert reply.results[0].status == pb.PUT_STORED
    plain = list(stub.Get(pb.GetRequest(namespace="ns", hashes=[KEY]), timeout=10))
    assert plain[0].header.codec == pb.CODEC_NONE and b"".join(m.data for m in plain) == raw
    coded = list(stub.Get(pb.GetRequest(namespace="ns", hashes=[KEY], accepted_codecs=[codec_id(codec)]), timeout=10))
    assert coded[0].header.codec == codec_id(codec) and b"".join(m.data for m in coded) == enc


def test_encoded_put_with_wrong_crc_is_refused(stub, server):
    raw = kv_like(50_000)
    enc = encode("zstd", raw, "float16")
    hdr = pb.BlockHeader(
        hash=KEY,
        codec=pb.CODEC_ZSTD,
        raw_length=len(raw),
        stored_length=len(enc),
        crc32c=crc32c(raw) ^ 7,
        dtype="float16",
    )
    (result,) = stub.Put(iter([pb.PutRequest(namespace="ns", header=hdr, data=enc)]), timeout=10).results
    assert result.status == pb.PUT_REJECTED and result.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "CRC32C mismatch" in result.reason
    assert server.store.stats()["blocks"] == 0


def test_garbage_claiming_a_codec_is_refused(stub, server):
    hdr = pb.BlockHeader(hash=KEY, codec=pb.CODEC_ZSTD, raw_length=1000, stored_length=100, crc32c=1, dtype="float16")
    (result,) = stub.Put(iter([pb.PutRequest(namespace="ns", header=hdr, data=b"\x01" * 100)]), timeout=10).results
    assert result.status == pb.PUT_REJECTED and result.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "does not decode" in result.reason
