"""Limits through a real server: byte quotas per tenant (and for shared namespaces), concurrent streams
per tenant, the server-side RPC deadline. Over a limit: RESOURCE_EXHAUSTED (or DEADLINE_EXCEEDED) with a
message, and other tenants carry on unaffected."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import yaml

from kvstore.checksum import crc32c
from kvstore.client import Client
from kvstore.hashing import block_hashes
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

TOKEN_A = "limits-token-of-tenant-a-000"
TOKEN_B = "limits-token-of-tenant-b-000"
TOKEN_OPS = "limits-token-of-operators-00"
KIB64 = 64 << 10


def tenants_file(tmp_path, **a_extra) -> str:
    doc = {
        "shared_namespaces": ["public"],
        "shared_quota": "256KiB",
        "tenants": [
            {"name": "a", "token": TOKEN_A, "namespaces": ["ns-a"], **a_extra},
            {"name": "b", "token": TOKEN_B, "namespaces": ["ns-b"]},
            {"name": "ops", "token": TOKEN_OPS, "namespaces": [], "admin": True},
        ],
    }
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def blocks(ns: str, n: int, start: int = 0) -> list[bytes]:
    return block_hashes(list(range(16 * start, 16 * (start + n))), 16, ns, "m")[-n:] if n else []


@pytest.fixture(params=["grpc", "auto"])
def lane(request) -> str:
    """Quotas hold on the gRPC stream and on the data lanes a client negotiates (shm here)."""
    return request.param


def meta(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


# -- byte quotas ----------------------------------------------------------------------------------
def test_quota_rejects_over_the_limit_and_spares_others(make_server, tmp_path, lane):
    server = make_server(tenants=tenants_file(tmp_path, quota="1MiB"))
    target = f"127.0.0.1:{server.port}"
    with Client(target, token=TOKEN_A, lane=lane) as a, Client(target, token=TOKEN_B, lane=lane) as b:
        keys = blocks("ns-a", 17)
        assert all(r.status == "stored" for r in a.put("ns-a", keys[:16], [b"a" * KIB64] * 16, chained=False))
        over = a.put("ns-a", keys[16:], [b"a" * KIB64], chained=False)[0]
        assert over.status == "rejected" and over.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "quota of tenant 'a' is full" in over.reason and "1048576" in over.reason
        assert a.put("ns-a", keys[:1], [b"a" * KIB64])[0].status == "already_present"  # not a quota matter
        assert all(
            r.status == "stored" for r in b.put("ns-b", blocks("ns-b", 32), [b"b" * KIB64] * 32, chained=False)
        )  # b has no quota: unaffected
        stats = a.stats("ns-a")["counters"]
        assert stats["quota_used_bytes"] == 1 << 20 and stats["quota_bytes"] == 1 << 20
        assert a.delete("ns-a", keys[:4]) == 4
        time.sleep(0.15)  # past the rescan interval: deleted bytes leave the count
        assert all(r.status == "stored" for r in a.put("ns-a", keys[16:], [b"a" * KIB64], chained=False))
    assert server.metrics.counters()["quota_rejected"] >= 1


def test_evicted_blocks_leave_the_quota(make_server, tmp_path, lane):
    server = make_server(dram=8 << 20, tenants=tenants_file(tmp_path, quota="4MiB"))
    target = f"127.0.0.1:{server.port}"
    with Client(target, token=TOKEN_A, lane=lane) as a, Client(target, token=TOKEN_B, lane=lane) as b:
        mine = blocks("ns-a", 65)
        assert all(r.ok for r in a.put("ns-a", mine[:64], [b"a" * KIB64] * 64, chained=False))
        assert not a.put("ns-a", mine[64:], [b"a" * KIB64], chained=False)[0].ok
        for i in range(0, 128, 32):  # b fills DRAM: a's older blocks are evicted
            b.put("ns-b", blocks("ns-b", 32, i), [b"b" * KIB64] * 32, chained=False)
        assert a.lookup("ns-a", mine[:1]) == 0
        time.sleep(0.15)
        assert a.put("ns-a", mine[64:], [b"a" * KIB64], chained=False)[0].status == "stored"


def test_shared_namespaces_have_their_own_quota(make_server, tmp_path, lane):
    server = make_server(tenants=tenants_file(tmp_path, quota="4MiB"))
    target = f"127.0.0.1:{server.port}"
    with Client(target, token=TOKEN_A, lane=lane) as a, Client(target, token=TOKEN_B, lane=lane) as b:
        assert all(r.ok for r in a.put("public", blocks("public", 4), [b"p" * KIB64] * 4, chained=False))
        late = b.put("public", blocks("public", 1, 9), [b"q" * KIB64], chained=False)[0]
        assert late.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "shared namespaces" in late.reason
        assert a.put("ns-a", blocks("ns-a", 1), [b"a" * KIB64])[0].ok  # a's own quota is separate


# -- concurrent streams -------------------------------------------------------------------------------
def stalled_put(stub, token: str, ns: str, release: threading.Event, key: bytes):
    """A Put stream that sends half a block, then waits for `release` before sending the rest."""
    data = b"s" * 4096
    header = pb.BlockHeader(hash=key, raw_length=len(data), stored_length=len(data), crc32c=crc32c(data), dtype="uint8")

    def messages():
        yield pb.PutRequest(namespace=ns, header=header, data=data[:2048])
        release.wait(30)
        yield pb.PutRequest(data=data[2048:])

    return stub.Put.future(messages(), timeout=30, metadata=meta(token))


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_streams_per_tenant(make_server, tmp_path):
    server = make_server(tenants=tenants_file(tmp_path, max_streams=2))
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.KVStoreStub(channel)
    release = threading.Event()
    held = [stalled_put(stub, TOKEN_A, "ns-a", release, bytes([i]) * 16) for i in range(2)]
    wait_for(lambda: server.gate.slots.open("a") == 2)
    with pytest.raises(grpc.RpcError) as err:
        stub.Get(
            pb.GetRequest(namespace="ns-a", hashes=[b"\x00" * 16], allow_missing=True),
            timeout=5,
            metadata=meta(TOKEN_A),
        ).next()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "2 open streams" in err.value.details()
    other = stalled_put(stub, TOKEN_B, "ns-b", release, b"\xbb" * 16)  # b is not held back by a's streams
    wait_for(lambda: server.gate.slots.open("b") == 1)
    assert (
        stub.Lookup(
            pb.LookupRequest(namespace="ns-a", hashes=[b"\x00" * 16]), timeout=5, metadata=meta(TOKEN_A)
        ).prefix_length
        == 0
    )  # unary calls are not streams
    release.set()
    for call in (*held, other):
        assert call.result().results[0].status == pb.PUT_STORED
    wait_for(lambda: server.gate.slots.open("a") == 0 and server.gate.slots.open("b") == 0)
    channel.close()


# -- server-side deadline --------------------------------------------------------------------------------
def test_stalled_put_is_cut_off_and_its_slot_freed(make_server, tmp_path):
    server = make_server(tenants=tenants_file(tmp_path), max_rpc_seconds=1.0)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.KVStoreStub(channel)
    release = threading.Event()
    started = time.monotonic()
    call = stalled_put(stub, TOKEN_A, "ns-a", release, b"\x01" * 16)
    with pytest.raises(grpc.RpcError) as err:
        call.result()
    release.set()
    elapsed = time.monotonic() - started
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "--max-rpc-seconds" in err.value.details()
    assert 0.9 < elapsed < 10.0  # cut by the watchdog (the call's own timeout is 30 s), late only on a loaded host
    wait_for(lambda: server.gate.slots.open("a") == 0 and server.store.top.used_bytes == 0)
    assert server.store.stats()["blocks"] == 0
    assert server.metrics.counters()["rpc_deadline_expired"] == 1
    channel.close()


def test_client_that_stops_reading_a_get_is_cut_off(make_server):
    server = make_server(max_rpc_seconds=1.0)
    # More than HTTP/2 flow control lets the server queue ahead (its window grows to several MiB):
    # with 16 MiB the whole reply sometimes left before the deadline and the stream ended cleanly.
    keys = [bytes([i]) * 16 for i in range(64)]
    target = f"127.0.0.1:{server.port}"
    with Client(target) as kv:
        kv.put("ns", keys, [bytes([i]) * (1 << 20) for i in range(64)])
        channel = grpc.insecure_channel(target)
        stream = pb_grpc.KVStoreStub(channel).Get(pb.GetRequest(namespace="ns", hashes=keys), timeout=30)
        next(stream)  # then read nothing for longer than the server allows
        time.sleep(1.5)
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        channel.close()
        assert kv.delete("ns", keys) == 64
    wait_for(lambda: server.store.top.used_bytes == 0)  # leases were released: deleted blocks are freed
