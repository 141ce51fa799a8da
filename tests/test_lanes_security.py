"""Ownership on the lanes: forged descriptors, wrong tokens, region files, tenants."""

from __future__ import annotations

import os
import stat

import grpc
import pytest
import yaml

from kvstore.client import Client, KVStoreError
from kvstore.lanes.base import LaneBroken
from kvstore.lanes.shm_region import PREFIX
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import lanes_pb2 as lpb
from tests.test_lanes_support import RawLanes, header, keys


@pytest.fixture
def lane_server(make_server):
    return make_server(dram=64 << 20, shm_lane_bytes=8 << 20, lane_lease=10.0)


@pytest.fixture
def raw(lane_server):
    r = RawLanes(lane_server)
    yield r
    r.close()


def granted(raw: RawLanes, n: int = 2, size: int = 10000):
    shm = raw.shm()
    stream = shm.open_put()
    ks = keys(n)
    data = [bytes([i + 1]) * size for i in range(n)]
    grant = stream.reserve("ns", [header(k, d) for k, d in zip(ks, data)])
    crcs = [shm.write(slot, memoryview(d)) for slot, d in zip(grant.slots, data)]
    good = [
        lpb.BlockDescriptor(index=i, hash=ks[i], offset=s.offset, length=s.length, crc32c=crcs[i])
        for i, s in enumerate(grant.slots)
    ]
    return shm, stream, grant, good


def commit_error(stream, grant, descriptors) -> KVStoreError:
    stream.send_commit(grant.grant_id, descriptors)
    with pytest.raises(KVStoreError) as err:
        stream.committed()
    stream.close()
    return err.value


FORGERIES = {
    "offset outside the grant": lambda d: setattr(d, "offset", d.offset + 4096),
    "offset past the region": lambda d: setattr(d, "offset", 1 << 40),
    "length beyond the slot": lambda d: setattr(d, "length", d.length + 1),
    "another hash": lambda d: setattr(d, "hash", b"\xee" * 16),
    "index not granted": lambda d: setattr(d, "index", 7),
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_forged_descriptor_is_permission_denied_and_stores_nothing(raw, lane_server, forgery):
    _, stream, grant, good = granted(raw)
    FORGERIES[forgery](good[1])
    err = commit_error(stream, grant, good)
    assert err.code == grpc.StatusCode.PERMISSION_DENIED and "does not match a slot granted" in err.message
    assert lane_server.store.stats()["blocks"] == 0  # the whole commit was refused, block 0 included
    assert lane_server.store.top.used_bytes == 0  # and the stream's grant was taken back when it ended


def test_double_commit_is_permission_denied(raw, lane_server):
    _, stream, grant, good = granted(raw)
    stream.send_commit(grant.grant_id, good[:1])
    assert stream.committed()[0].status == pb.PUT_STORED
    err = commit_error(stream, grant, good[:1])
    assert err.code == grpc.StatusCode.PERMISSION_DENIED
    assert lane_server.store.stats()["blocks"] == 1


def test_commit_to_a_grant_of_another_stream(raw, lane_server):
    shm, stream, grant, good = granted(raw)
    other = shm.open_put()
    other.send_commit(grant.grant_id + 1000, good)
    with pytest.raises(LaneBroken, match="FAILED_PRECONDITION"):
        other.committed()
    other.close()
    stream.send_commit(grant.grant_id, good)
    assert [r.status for r in stream.committed()] == [pb.PUT_STORED] * 2
    stream.close()


def test_wrong_token_is_permission_denied(raw, lane_server):
    shm = raw.shm()
    shm.ref.token = b"\0" * 32
    with pytest.raises(KVStoreError) as err:
        shm.open_put().reserve("ns", [header(keys(1)[0], b"x")])
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(KVStoreError) as err:
        shm.get("ns", keys(1), None, True, True)
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as rpc_err:
        raw.stub.CloseLane(lpb.CloseLaneRequest(lane=shm.ref), timeout=5)
    assert rpc_err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    opened = raw.open(lpb.LANE_TCP)
    forged = lpb.OpenLaneResponse(lane_id=opened.lane_id, token=b"\1" * 32, tcp_port=opened.tcp_port)
    with pytest.raises(KVStoreError) as err:
        raw.tcp(forged)
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
    # a tcp lane's id and token do not open the shm verbs
    tcp_ref = lpb.LaneRef(lane_id=opened.lane_id, token=opened.token)
    shm.ref.CopyFrom(tcp_ref)
    with pytest.raises(KVStoreError) as err:
        shm.open_put().reserve("ns", [header(keys(1)[0], b"x")])
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert lane_server.store.stats()["blocks"] == 0


def test_unknown_lane_is_failed_precondition(raw):
    shm = raw.shm()
    shm.ref.lane_id = "no-such-lane"
    with pytest.raises(LaneBroken, match="FAILED_PRECONDITION"):
        shm.open_put().reserve("ns", [header(keys(1)[0], b"x")])


def test_region_file_is_private_and_unlinked_once_mapped(raw, lane_server):
    opened = raw.open(lpb.LANE_SHM)
    name = os.path.basename(opened.shm_path)
    pid, _, secret = name[len(PREFIX) :].partition("-")
    assert name.startswith(PREFIX) and pid == str(os.getpid()) and len(secret) == 32
    st = os.stat(opened.shm_path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid() and st.st_size == opened.shm_bytes
    from kvstore.lanes.client.shm import ShmClientLane

    lane = ShmClientLane(raw.stub, opened, (), 10.0)
    lane.get("ns", keys(1), None, True, True)  # the first request: the server unlinks the name
    assert not os.path.exists(opened.shm_path)
    lane.close()


def test_unattached_region_is_unlinked_after_the_lease(make_server):
    import time

    raw = RawLanes(make_server(shm_lane_bytes=8 << 20, lane_lease=0.5))
    opened = raw.open(lpb.LANE_SHM)
    assert os.path.exists(opened.shm_path)
    deadline = time.monotonic() + 5
    while os.path.exists(opened.shm_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(opened.shm_path)
    raw.close()


def test_closed_server_leaves_no_region_files(make_server):
    server = make_server(shm_lane_bytes=8 << 20)
    raw = RawLanes(server)
    paths = [raw.open(lpb.LANE_SHM).shm_path for _ in range(3)]
    server.stop(0)
    raw.close()
    assert not any(os.path.exists(p) for p in paths)


TOKEN_A = "token-of-tenant-a-0123456789"
TOKEN_B = "token-of-tenant-b-9876543210"


@pytest.mark.parametrize("lane", ["shm", "tcp", "cuda_ipc"])
def test_a_tenants_lane_reaches_only_its_namespaces(make_server, tmp_path, lane):
    path = tmp_path / "tenants.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "tenants": [
                    {"name": "a", "token": TOKEN_A, "namespaces": ["ns-a"]},
                    {"name": "b", "token": TOKEN_B, "namespaces": ["ns-b"]},
                ]
            }
        )
    )
    server = make_server(tenants=str(path), shm_lane_bytes=8 << 20)
    target = f"127.0.0.1:{server.port}"
    with Client(target, token=TOKEN_B, lane=lane) as b:
        assert b.put("ns-b", keys(1), [b"secret"])[0].status == "stored"
    with Client(target, token=TOKEN_A, lane=lane, retries=0) as a:
        assert a.put("ns-a", keys(1), [b"mine"])[0].status == "stored"
        assert a.lane_kind == lane
        for call in (
            lambda: a.get("ns-b", keys(1)),
            lambda: a.put("ns-b", keys(2), [b"x", b"y"]),
            lambda: a.get("ns-b", keys(1, seed=9), allow_missing=True),
        ):
            with pytest.raises(KVStoreError) as err:
                call()
            assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
            assert "may not use namespace 'ns-b'" in err.value.message
    with Client(target, token=None, lane=lane, retries=0) as anonymous, pytest.raises(KVStoreError) as err:
        anonymous.put("ns-a", keys(1), [b"x"])
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert server.store.stats()["blocks"] == 2


def test_region_files_of_killed_servers_are_swept(make_server, short_dir):
    import subprocess

    from kvstore import shmfile

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = short_dir / f"{PREFIX}{dead.pid}-{'ab' * 16}"
    stale.write_bytes(b"x")
    live = short_dir / shmfile.name_of(PREFIX)  # this process's: its pid and its mark
    live.write_bytes(b"x")
    unrelated = short_dir / "other-file"
    unrelated.write_bytes(b"x")
    make_server(shm_dir=str(short_dir), shm_lane_bytes=8 << 20)
    assert not stale.exists() and live.exists() and unrelated.exists()
