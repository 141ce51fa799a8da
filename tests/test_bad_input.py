"""Every malformed request gets a clear gRPC status, never a hang, a crash or a stored block."""

from __future__ import annotations

import grpc
import pytest

from kvstore.checksum import crc32c
from kvstore.client import Client, KVStoreError
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

KEY = bytes(range(16))


@pytest.fixture
def stub(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield pb_grpc.KVStoreStub(channel)
    channel.close()


def header(data: bytes, **kw) -> pb.BlockHeader:
    fields = dict(hash=KEY, raw_length=len(data), stored_length=len(data), crc32c=crc32c(data), dtype="uint8")
    fields.update(kw)
    return pb.BlockHeader(**fields)


def put(stub, messages) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        stub.Put(iter(messages), timeout=10)
    return err.value


def assert_nothing_stored(server):
    assert server.store.stats()["blocks"] == 0
    assert server.store.top.used_bytes == 0


def test_namespace_too_long(stub, server):
    err = put(stub, [pb.PutRequest(namespace="n" * 300, header=header(b"x"), data=b"x")])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "namespace" in err.details()
    assert_nothing_stored(server)


def test_namespace_malformed(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.Lookup(pb.LookupRequest(namespace="a\0b", hashes=[KEY]), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "NUL" in err.value.details()


@pytest.mark.parametrize("rpc", ["Lookup", "Get", "Delete"])
def test_hash_of_wrong_length(stub, rpc):
    request = {"Lookup": pb.LookupRequest, "Get": pb.GetRequest, "Delete": pb.DeleteRequest}[rpc]
    with pytest.raises(grpc.RpcError) as err:
        reply = getattr(stub, rpc)(request(namespace="ns", hashes=[KEY, b"short"]), timeout=5)
        list(reply) if rpc == "Get" else None
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "hash 1 is 5 bytes" in err.value.details()


def test_put_hash_of_wrong_length(stub, server):
    err = put(stub, [pb.PutRequest(namespace="ns", header=header(b"x", hash=b"abc"), data=b"x")])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "hash is 3 bytes" in err.details()
    assert_nothing_stored(server)


def test_more_data_than_header_says(stub, server):
    data = b"y" * 100
    err = put(stub, [pb.PutRequest(namespace="ns", header=header(data[:50]), data=data)])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "stored_length=50" in err.details()
    assert_nothing_stored(server)


def test_next_header_before_block_complete(stub, server):
    data = b"z" * 100
    err = put(
        stub,
        [
            pb.PutRequest(namespace="ns", header=header(data), data=data[:40]),
            pb.PutRequest(header=header(data, hash=bytes(16)), data=data),
        ],
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "after 40 of 100 bytes" in err.details()
    assert_nothing_stored(server)


def test_data_before_header(stub, server):
    err = put(stub, [pb.PutRequest(namespace="ns", data=b"abc")])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "before any block header" in err.details()


def test_checksum_mismatch(stub, server):
    """A wrong CRC rejects that block alone (tests/test_put_contract.py has the stream around it)."""
    data = b"q" * 5000
    reply = stub.Put(iter([pb.PutRequest(namespace="ns", header=header(data, crc32c=crc32c(data) ^ 1), data=data)]))
    (result,) = reply.results
    assert result.status == pb.PUT_REJECTED and result.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "CRC32C mismatch" in result.reason
    assert_nothing_stored(server)


def test_block_over_size_limit(make_server):
    server = make_server(max_block=1 << 20)
    with Client(f"127.0.0.1:{server.port}") as kv:
        with pytest.raises(KVStoreError) as err:
            kv.put("ns", [KEY], [b"a" * ((1 << 20) + 1)])
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "block size limit" in err.value.message
    assert_nothing_stored(server)


def test_stream_ends_mid_block(stub, server):
    data = b"m" * 3000
    err = put(stub, [pb.PutRequest(namespace="ns", header=header(data), data=data[:1000])])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "ended in the middle of block 0" in err.details()
    assert_nothing_stored(server)


def test_earlier_complete_blocks_survive_a_bad_stream(stub, server):
    good = b"g" * 100
    put(
        stub,
        [
            pb.PutRequest(namespace="ns", header=header(good), data=good),
            pb.PutRequest(header=header(good, hash=bytes(16)), data=good[:10]),
        ],
    )
    assert server.store.lookup("ns", [KEY]) == (1, [2])


def test_codec_none_with_unequal_lengths(stub, server):
    err = put(stub, [pb.PutRequest(namespace="ns", header=header(b"abc", raw_length=10), data=b"abc")])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "stored_length == raw_length" in err.details()


@pytest.mark.parametrize("codec", [pb.CODEC_BYTEPLANE, pb.CODEC_FP8, pb.CODEC_FP8_ZSTD])
def test_a_float_codec_on_bytes_is_refused(make_server, codec):
    # found by the fuzzer: byteplane on a uint8 block reached the decoder and came back UNKNOWN
    server = make_server(lossy_namespaces="*")
    data = b"\x02" * 2558
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        err = put(
            pb_grpc.KVStoreStub(channel), [pb.PutRequest(namespace="ns", header=header(data, codec=codec), data=data)]
        )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "codes float KV" in err.details()
    assert_nothing_stored(server)


def test_empty_block(stub):
    err = put(stub, [pb.PutRequest(namespace="ns", header=header(b""))])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty block" in err.details()


def test_get_missing_hash(client):
    with pytest.raises(KVStoreError) as err:
        client.get("ns", [KEY])
    assert err.value.code == grpc.StatusCode.NOT_FOUND and KEY.hex() in err.value.message


def test_too_many_hashes(make_server):
    server = make_server(max_hashes=10)
    with Client(f"127.0.0.1:{server.port}") as kv, pytest.raises(KVStoreError) as err:
        kv.lookup("ns", [KEY] * 11)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "limit is 10" in err.value.message


def test_put_larger_than_capacity_is_rejected(make_server):
    server = make_server(dram=8 << 20, max_block=16 << 20)
    with Client(f"127.0.0.1:{server.port}") as kv:
        results = kv.put("ns", [KEY], [b"b" * (12 << 20)])
    assert results[0].status == "rejected" and results[0].code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "exceeds the largest slot" in results[0].reason
    assert_nothing_stored(server)


def test_put_rejected_when_everything_is_leased(make_server):
    """Readers hold every block (leases, as an in-flight Get takes them): nothing can be evicted, so a Put is refused."""
    server = make_server(dram=8 << 20)
    keys = [bytes([i]) * 16 for i in range(8)]
    with Client(f"127.0.0.1:{server.port}", lane="grpc") as kv:
        assert all(r.ok for r in kv.put("ns", keys, [b"r" * (1 << 20)] * 8))
        leases = server.store.acquire("ns", keys)
        results = kv.put("ns", [b"\xff" * 16], [b"n" * (1 << 20)])
        assert results[0].status == "rejected" and results[0].code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "leased" in results[0].reason
        server.store.release(leases)
        assert kv.put("ns", [b"\xff" * 16], [b"n" * (1 << 20)])[0].status == "stored"
