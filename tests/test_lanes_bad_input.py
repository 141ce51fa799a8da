"""Malformed requests on the shm, tcp and cuda_ipc lanes get the same status codes as on gRPC, and store nothing."""

from __future__ import annotations

import grpc
import pytest

from kvstore.client import Client, KVStoreError
from kvstore.lanes import framing
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import lanes_pb2 as lpb
from tests.test_lanes_support import RawLanes, header, keys

KEY = bytes(range(16))


@pytest.fixture(params=["shm", "tcp", "cuda_ipc"])
def lane(request) -> str:
    return request.param


@pytest.fixture
def lane_server(make_server):
    return make_server(dram=64 << 20, shm_lane_bytes=16 << 20, max_block=4 << 20)


@pytest.fixture
def kv(lane_server, lane):
    with Client(f"127.0.0.1:{lane_server.port}", lane=lane, timeout=10, retries=0) as c:
        yield c


def code_of(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(KVStoreError) as err:
        fn()
    return err.value.code, err.value.message


def assert_nothing_stored(server):
    assert server.store.stats()["blocks"] == 0
    assert server.store.top.used_bytes == 0


def test_namespace_too_long(kv, lane_server):
    code, msg = code_of(lambda: kv.put("n" * 300, [KEY], [b"x"]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "namespace" in msg
    code, msg = code_of(lambda: kv.get("a\0b", [KEY]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "NUL" in msg
    assert_nothing_stored(lane_server)


def test_hash_of_wrong_length(kv, lane_server):
    code, msg = code_of(lambda: kv.put("ns", [b"abc"], [b"x"]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "hash is 3 bytes" in msg
    code, msg = code_of(lambda: kv.get("ns", [KEY, b"short"]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "hash 1 is 5 bytes" in msg
    assert_nothing_stored(lane_server)


def test_empty_block_and_size_limit(kv, lane_server):
    code, msg = code_of(lambda: kv.put("ns", [KEY], [b""]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "empty block" in msg
    code, msg = code_of(lambda: kv.put("ns", [KEY, bytes(16)], [b"a", b"b" * ((4 << 20) + 1)]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "block 1" in msg and "block size limit" in msg
    assert_nothing_stored(lane_server)  # all headers are checked before any block is reserved


def test_too_many_hashes(make_server, lane):
    server = make_server(max_hashes=10)
    with Client(f"127.0.0.1:{server.port}", lane=lane, retries=0) as kv:
        code, msg = code_of(lambda: kv.get("ns", [KEY] * 11))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "limit is 10" in msg
        code, msg = code_of(lambda: kv.put("ns", keys(11), [b"x"] * 11))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "limit is 10" in msg


def test_codec_none_with_unequal_lengths(lane_server, lane):
    raw = RawLanes(lane_server)
    bad = header(KEY, b"abc", raw_length=10)
    with pytest.raises(KVStoreError) as err:
        if lane != "tcp":
            raw.region_lane(lane).open_put().reserve("ns", [bad])
        else:
            raw.tcp().put("ns", [bad], [memoryview(b"abc")])
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "stored_length == raw_length" in err.value.message
    raw.close()
    assert_nothing_stored(lane_server)


def test_checksum_mismatch_rejects_that_block_alone(lane_server, lane):
    if lane == "cuda_ipc":
        pytest.skip("cuda_ipc puts carry no client CRC: the server computes it where the block lands")
    raw = RawLanes(lane_server)
    data = b"q" * 5000
    good = b"g" * 100
    if lane == "shm":
        shm = raw.shm()
        stream = shm.open_put()
        grant = stream.reserve("ns", [header(bytes(16), good), header(KEY, data)])
        ok = [
            lpb.BlockDescriptor(
                index=0,
                hash=bytes(16),
                offset=grant.slots[0].offset,
                length=100,
                crc32c=shm.write(grant.slots[0], memoryview(good)),
            )
        ]
        stream.send_commit(grant.grant_id, ok)
        assert stream.committed()[0].status == pb.PUT_STORED
        crc = shm.write(grant.slots[1], memoryview(data))
        stream.send_commit(
            grant.grant_id,
            [lpb.BlockDescriptor(index=1, hash=KEY, offset=grant.slots[1].offset, length=5000, crc32c=crc ^ 1)],
        )
        (result,) = stream.committed()
        stream.close()
    else:
        tcp = raw.tcp()
        assert tcp.put("ns", [header(bytes(16), good)], [memoryview(good)])[0].status == "stored"
        meta = lpb.TcpPut(namespace="ns", headers=[header(KEY, data)])
        wrong = framing.CRC.pack(header(KEY, data).crc32c ^ 1)  # each block's CRC32C follows its bytes
        framing.send_frame(tcp.sock, framing.PUT, meta.SerializeToString(), [memoryview(data), memoryview(wrong)])
        (result,) = pb.PutResponse.FromString(tcp._expect(framing.PUT_REPLY).meta).results
    # the block is refused in its result, as on the gRPC Put, and the lane stays usable
    assert result.status == pb.PUT_REJECTED and result.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "CRC32C mismatch" in result.reason
    assert lane_server.store.lookup("ns", [bytes(16), KEY])[0] == 1  # the good block before it stays
    assert lane_server.store.stats()["blocks"] == 1
    raw.close()


def test_tcp_payload_shorter_than_headers(lane_server):
    raw = RawLanes(lane_server)
    tcp = raw.tcp()
    meta = lpb.TcpPut(namespace="ns", headers=[header(KEY, b"x" * 100)]).SerializeToString()
    framing.send_frame(tcp.sock, framing.PUT, meta, [memoryview(b"x" * 60)])
    with pytest.raises(KVStoreError) as err:
        tcp._expect(framing.PUT_REPLY)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "announce 104 payload bytes" in err.value.message
    assert [r.status for r in tcp.put("ns", [header(KEY, b"y" * 10)], [memoryview(b"y" * 10)])] == ["stored"]
    raw.close()


def test_put_larger_than_capacity_is_rejected(make_server, lane):
    server = make_server(dram=8 << 20, max_block=16 << 20, shm_lane_bytes=16 << 20)
    with Client(f"127.0.0.1:{server.port}", lane=lane) as kv:
        results = kv.put("ns", [KEY], [b"b" * (12 << 20)])
    assert results[0].status == "rejected" and results[0].code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "exceeds the largest slot" in results[0].reason
    assert_nothing_stored(server)


def test_put_rejected_when_everything_is_leased(make_server, lane):
    """Readers hold every block: a lane Put is refused, then accepted once the leases are released."""
    server = make_server(dram=8 << 20, shm_lane_bytes=8 << 20)
    ks = [bytes([i]) * 16 for i in range(8)]
    with Client(f"127.0.0.1:{server.port}", lane=lane) as kv:
        assert all(r.ok for r in kv.put("ns", ks, [b"r" * (1 << 20)] * 8))
        leases = server.store.acquire("ns", ks)  # as a reader in the middle of a transfer holds them
        results = kv.put("ns", [b"\xff" * 16], [b"n" * (1 << 20)])
        assert results[0].status == "rejected" and results[0].code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "leased" in results[0].reason
        server.store.release(leases)
        assert kv.put("ns", [b"\xff" * 16], [b"n" * (1 << 20)])[0].status == "stored"


def test_lane_get_releases_its_leases(make_server, lane):
    """After a lane Get the blocks are evictable again: a full store takes new blocks."""
    server = make_server(dram=8 << 20, shm_lane_bytes=8 << 20)
    with Client(f"127.0.0.1:{server.port}", lane=lane) as kv:
        first = [bytes([1, i]) * 8 for i in range(8)]
        assert all(r.ok for r in kv.put("ns", first, [b"a" * (1 << 20)] * 8))
        assert len(kv.get("ns", first)) == 8
        second = [bytes([2, i]) * 8 for i in range(8)]
        assert [r.status for r in kv.put("ns", second, [b"b" * (1 << 20)] * 8)] == ["stored"] * 8
    server.store.check_invariants()


def test_encoded_block_that_does_not_decode(lane_server, lane):
    raw = RawLanes(lane_server)
    data = b"\x01" * 4096
    bad = header(KEY, data, codec=pb.CODEC_BYTEPLANE, raw_length=8192)  # not byteplane output at all
    with pytest.raises(KVStoreError) as err:
        if lane != "tcp":
            shm = raw.region_lane(lane)
            stream = shm.open_put()
            grant = stream.reserve("ns", [bad])
            crc = shm.write(grant.slots[0], memoryview(data))
            stream.send_commit(
                grant.grant_id,
                [lpb.BlockDescriptor(index=0, hash=KEY, offset=grant.slots[0].offset, length=4096, crc32c=crc)],
            )
            stream.committed()
        else:
            raw.tcp().put("ns", [bad], [memoryview(data)])
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    raw.close()
    assert_nothing_stored(lane_server)
