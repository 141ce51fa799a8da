"""The shm lane's channel: Gets and puts as frames on the direct handshake's socket instead of gRPC calls."""

from __future__ import annotations

import os
import socket
import threading
import time

import grpc
import pytest

from kvstore.lanes import cma, direct
from kvstore.lanes.base import LaneBroken
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import lanes_pb2 as lpb
from tests.test_lanes_support import RawLanes, header, keys

pytestmark = pytest.mark.skipif(not cma.available(), reason="the channel comes with the direct handshake (Linux)")


class NoStreams:
    """A stub that fails LanePut and LaneGet (so a call that reaches gRPC fails the test) and passes the rest."""

    def __init__(self, stub):
        self._stub = stub

    def __getattr__(self, name):
        if name in ("LanePut", "LaneGet"):
            raise AssertionError(f"{name} went over gRPC, not the lane's channel")
        return getattr(self._stub, name)


def serving(lane_id: str) -> bool:
    """Whether the store still runs the channel thread of this lane."""
    return any(t.name == f"kvstore-shm-channel-{lane_id}" for t in threading.enumerate())


def wait_for(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture
def raw(make_server):
    lanes = RawLanes(make_server())
    yield lanes
    lanes.close()


def test_puts_and_gets_take_the_channel(raw):
    shm = raw.shm()
    assert shm.direct and shm._channel is not None and shm._channel.open
    shm._stub = NoStreams(shm._stub)
    blocks = [os.urandom(n) for n in (4096, 65536, 3 << 20)]
    results = shm.put("ns", [header(k, b) for k, b in zip(keys(3), blocks)], [memoryview(b) for b in blocks])
    assert [r.status for r in results] == ["stored"] * 3
    assert [bytes(b) for b in shm.get("ns", keys(3), None, False, True)] == blocks  # through the region
    out = [bytearray(len(b)) for b in blocks]
    shm.get("ns", keys(3), out, False, True)  # written into our buffers by the store
    assert [bytes(b) for b in out] == blocks
    missing = shm.get("ns", [b"\x09" * 16], None, True, True)
    assert missing == [None]
    shm.close()


def test_a_get_error_leaves_the_channel_in_step(raw):
    shm = raw.shm()
    data = os.urandom(10_000)
    shm.put("ns", [header(keys(1)[0], data)], [memoryview(data)])
    with pytest.raises(Exception) as err:
        shm.get("ns", [b"short"], None, False, True)  # a malformed hash: the store refuses the Get
    assert getattr(err.value, "code", None) == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert shm._channel.open
    shm._stub = NoStreams(shm._stub)
    assert bytes(shm.get("ns", keys(1), None, False, True)[0]) == data  # the next Get is still on the channel
    shm.close()


def test_a_put_error_ends_the_channel_and_grpc_takes_over(raw):
    shm = raw.shm()
    data = os.urandom(1 << 20)
    stream = shm.open_put()
    grant = stream.reserve("ns", [header(keys(1)[0], data)])
    bad = lpb.BlockDescriptor(index=0, hash=keys(1)[0], offset=grant.slots[0].offset, length=len(data), address=8)
    stream.send_commit(grant.grant_id, [bad], crc_from_server=True)
    with pytest.raises(Exception) as err:
        stream.committed()
    assert getattr(err.value, "code", None) == grpc.StatusCode.INVALID_ARGUMENT, err.value
    stream.close()
    assert not shm._channel.open  # the client may have sent more than the store read: the channel is done
    assert wait_for(lambda: not serving(shm.ref.lane_id))
    assert shm.put("ns", [header(keys(1)[0], data)], [memoryview(data)])[0].status == "stored"  # over gRPC
    assert bytes(shm.get("ns", keys(1), None, False, True)[0]) == data
    raw.server.store.check_invariants()
    shm.close()


def test_a_closed_lane_closes_its_channel(raw):
    shm = raw.shm()
    assert wait_for(lambda: serving(shm.ref.lane_id))
    raw.stub.CloseLane(lpb.CloseLaneRequest(lane=shm.ref), timeout=5)
    assert wait_for(lambda: not serving(shm.ref.lane_id))
    with pytest.raises(LaneBroken):
        shm.get("ns", keys(1), None, True, True)


def test_a_get_abandoned_midway_closes_the_channel_and_frees_its_leases(raw):
    shm = raw.shm()
    blocks = [os.urandom(1 << 20) for _ in range(8)]  # several replies: the first goes out after 2 MiB
    shm.put("ns", [header(k, b) for k, b in zip(keys(8), blocks)], [memoryview(b) for b in blocks])
    request = lpb.LaneGetRequest(lane=shm.ref, request=pb.GetRequest(namespace="ns", hashes=keys(8)))
    replies = shm._replies(request)
    first = next(replies)
    assert not first.last
    replies.close()  # the caller stops reading: the rest of the stream would be out of step
    assert not shm._channel.open
    assert wait_for(lambda: not serving(shm.ref.lane_id))
    assert [bytes(b) for b in shm.get("ns", keys(8), None, False, True)] == blocks  # over gRPC now
    shm.close()
    raw.server.store.delete("ns", keys(8))  # a block still leased would not be freed
    assert wait_for(lambda: raw.server.store.top.used_bytes == 0)


def test_a_channel_refuses_requests_for_another_lane_and_garbage(raw):
    mine, other = raw.shm(), raw.shm()
    request = lpb.LaneGetRequest(lane=other.ref, request=pb.GetRequest(namespace="ns", hashes=keys(1)))
    with pytest.raises(Exception) as err:
        list(mine._channel.get(request)) if mine._channel.claim() else None
    assert getattr(err.value, "code", None) == grpc.StatusCode.PERMISSION_DENIED, err.value
    assert mine._channel.open  # an error reply keeps it in step
    # a raw connection that passes the handshake and then sends garbage is dropped; the node serves on
    opened = raw.open(lpb.LANE_SHM)
    why, sock = direct.handshake(opened.direct_socket, opened.lane_id, opened.token)
    assert why is None and sock is not None
    assert wait_for(lambda: serving(opened.lane_id))  # its thread starts just after the handshake reply
    sock.sendall(b"GARBAGE!" * 8)
    sock.settimeout(5)
    try:
        assert sock.recv(1) == b""  # the store hangs up
    except ConnectionResetError:
        pass  # or resets, with our garbage unread
    sock.close()
    assert wait_for(lambda: not serving(opened.lane_id))
    data = os.urandom(5000)
    assert mine.put("ns", [header(keys(1)[0], data)], [memoryview(data)])[0].status == "stored"
    assert bytes(mine.get("ns", keys(1), None, False, True)[0]) == data
    mine.close()
    other.close()


def test_without_direct_mode_there_is_no_channel(make_server):
    raw = RawLanes(make_server(shm_direct=False))
    shm = raw.shm()
    assert shm._channel is None and not shm.direct
    data = os.urandom(5000)
    assert shm.put("ns", [header(keys(1)[0], data)], [memoryview(data)])[0].status == "stored"
    assert bytes(shm.get("ns", keys(1), None, False, True)[0]) == data
    shm.close()
    raw.close()


def test_the_socket_is_the_handshakes(raw):
    # the channel is the very socket whose peer the store checked (SO_PEERCRED): same process, same connection
    shm = raw.shm()
    sock = shm._channel._sock
    assert isinstance(sock, socket.socket) and sock.family == socket.AF_UNIX
    assert cma.peer_pid(sock) == os.getpid()  # the store's process is this one (in-process test server)
    shm.close()
