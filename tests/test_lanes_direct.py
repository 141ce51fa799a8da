"""Direct puts on the shm lane: the store reads blocks out of the client's memory (process_vm_readv).

The pid comes from the kernel (SO_PEERCRED) and is checked by reading a nonce
in the client's memory; a client can only make the store read its own memory.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import time

import grpc
import numpy as np
import pytest

from kvstore.client import Client
from kvstore.lanes import cma, direct
from kvstore.lanes.base import LaneBroken
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import lanes_pb2 as lpb
from tests.conftest import ROOT
from tests.test_lanes_support import RawLanes, header, keys


@pytest.fixture
def make_server(make_server):
    """These tests are of the store writing Gets into the client's memory: its DRAM arena private (``--share-dram
    false``; a test may pass its own)."""
    return functools.partial(make_server, share_dram=False)


pytestmark = pytest.mark.skipif(not cma.available(), reason="process_vm_readv is Linux-only")


def test_put_reads_the_clients_memory_once(make_server):
    server = make_server()
    pool = np.frombuffer(os.urandom(8 << 20), dtype=np.uint8).copy()  # blocks as slices of one KV pool
    blocks = [memoryview(pool[i << 20 : (i + 1) << 20]) for i in range(8)]
    with Client(f"127.0.0.1:{server.port}", lane="shm") as kv:
        assert all(r.status == "stored" for r in kv.put("ns", keys(8), blocks))
        assert [bytes(b) for b in kv.get("ns", keys(8))] == [bytes(b) for b in blocks]
    counters = server.metrics.counters()
    assert counters["lane_shm_direct_put_bytes"] == 8 << 20


CHILD = textwrap.dedent("""
    import os, sys
    from kvstore.client import Client
    with Client(sys.argv[1], lane="shm") as kv:
        blocks = [bytes([i]) * (3 << 19) + os.urandom(1000) for i in range(6)]
        keys = [bytes([7, i]) * 8 for i in range(6)]
        assert all(r.status == "stored" for r in kv.put("ns", keys, blocks))
        sys.stdout.buffer.write(b"".join(blocks))
""")


def test_put_from_another_process(make_server):
    """The real case: the store reads a client process's memory, which names it with PR_SET_PTRACER."""
    server = make_server()
    out = subprocess.run(
        [sys.executable, "-c", CHILD, f"127.0.0.1:{server.port}"], cwd=ROOT, capture_output=True, timeout=60
    )
    assert out.returncode == 0, out.stderr.decode()
    size = (3 << 19) + 1000
    blocks = [out.stdout[i * size : (i + 1) * size] for i in range(6)]
    with Client(f"127.0.0.1:{server.port}", lane="grpc") as kv:
        assert [bytes(b) for b in kv.get("ns", [bytes([7, i]) * 8 for i in range(6)])] == blocks
    assert server.metrics.counters()["lane_shm_direct_put_bytes"] == 6 * size


def test_an_address_outside_the_clients_memory_fails_that_commit(make_server):
    server = make_server()
    raw = RawLanes(server)
    shm = raw.shm()
    assert shm.direct
    data = os.urandom(1 << 20)
    stream = shm.open_put()
    grant = stream.reserve("ns", [header(k, data) for k in keys(2)])
    good = lpb.BlockDescriptor(
        index=0, hash=keys(2)[0], offset=grant.slots[0].offset, length=len(data), address=cma.address_of(data)[0]
    )
    bad = lpb.BlockDescriptor(
        index=1, hash=keys(2)[1], offset=grant.slots[1].offset, length=len(data), address=8
    )  # page zero: never mapped
    stream.send_commit(grant.grant_id, [good, bad], crc_from_server=True)
    with pytest.raises(Exception) as err:
        stream.committed()
    assert getattr(err.value, "code", None) == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert "direct put" in str(err.value)
    stream.close()
    assert server.store.lookup("ns", keys(2)[1:])[0] == 0  # the unreadable block is not there
    server.store.check_invariants()
    with Client(f"127.0.0.1:{server.port}", lane="shm") as kv:  # the node is fine afterwards
        assert kv.put("ns", keys(2)[1:], [data])[0].status == "stored"
    raw.close()


def test_a_lane_without_the_handshake_cannot_name_client_memory(make_server, monkeypatch):
    monkeypatch.setattr(direct, "handshake", lambda *a: ("skipped by the test", None))
    monkeypatch.setattr("kvstore.lanes.client.shm.handshake", lambda *a: ("skipped by the test", None))
    server = make_server()
    raw = RawLanes(server)
    shm = raw.shm()
    assert not shm.direct
    data = os.urandom(4096)
    stream = shm.open_put()
    grant = stream.reserve("ns", [header(keys(1)[0], data)])
    stream.send_commit(
        grant.grant_id,
        [
            lpb.BlockDescriptor(
                index=0,
                hash=keys(1)[0],
                offset=grant.slots[0].offset,
                length=len(data),
                address=cma.address_of(data)[0],
            )
        ],
        crc_from_server=True,
    )
    with pytest.raises((LaneBroken, Exception)) as err:
        stream.committed()
    assert getattr(err.value, "code", None) == grpc.StatusCode.PERMISSION_DENIED or "PERMISSION_DENIED" in str(
        err.value
    )
    stream.close()
    assert server.store.stats()["blocks"] == 0
    with Client(f"127.0.0.1:{server.port}", lane="shm") as kv:  # region copies still work on such a lane
        assert kv.put("ns", keys(1), [data])[0].status == "stored"
        assert bytes(kv.get("ns", keys(1))[0]) == data
    raw.close()


def test_handshake_refuses_a_wrong_token_and_a_nonce_not_in_the_caller(make_server):
    server = make_server()
    opened = RawLanes(server).open(lpb.LANE_SHM)
    assert opened.direct_socket and oct(os.stat(opened.direct_socket).st_mode & 0o777) == "0o600"
    why, refused = direct.handshake(opened.direct_socket, opened.lane_id, b"x" * len(opened.token))
    assert "wrong token" in (why or "") and refused is None
    # a hello naming memory that does not hold the nonce (as if it claimed another process's memory)
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(opened.direct_socket)
        lane = opened.lane_id.encode()
        elsewhere = bytearray(16)
        sock.sendall(
            direct.HELLO.pack(len(lane), len(opened.token), cma.address_of(elsewhere)[0], b"n" * 16)
            + lane
            + opened.token
        )
        reply = sock.recv(4096)
    assert reply[:1] == direct.REFUSED and b"nonce" in reply
    (lane_obj,) = server.lanes.registry._lanes.values()
    assert lane_obj.direct is None
    why, channel = direct.handshake(opened.direct_socket, opened.lane_id, opened.token)
    assert why is None and channel is not None
    assert lane_obj.direct is not None and lane_obj.direct.pid == os.getpid()
    channel.close()


def test_direct_puts_can_be_turned_off(make_server):
    server = make_server(shm_direct=False)
    opened = RawLanes(server).open(lpb.LANE_SHM)
    assert opened.direct_socket == ""
    with Client(f"127.0.0.1:{server.port}", lane="shm") as kv:
        assert kv.put("ns", keys(2), [b"a" * 5000, b"b" * 7000])[0].status == "stored"
        assert bytes(kv.get("ns", keys(2))[1]) == b"b" * 7000
    assert server.metrics.counters().get("lane_shm_direct_put_bytes", 0) == 0


def test_a_direct_reserve_reads_at_once_and_checks_its_addresses(make_server):
    server = make_server()
    raw = RawLanes(server)
    shm = raw.shm()
    data = [os.urandom(300_000) for _ in range(2)]
    ks = keys(2, seed=5)
    stream = shm.open_put()
    with pytest.raises(Exception) as err:  # one address for two blocks
        stream.reserve("ns", [header(k, d) for k, d in zip(ks, data)], addresses=[cma.address_of(data[0])[0]])
        stream.committed()
    assert "addresses" in str(err.value)
    stream.close()
    stream = shm.open_put()
    grant = stream.reserve("ns", [header(k, d) for k, d in zip(ks, data)], addresses=[cma.address_of(data[0])[0], 8])
    assert len(grant.slots) == 2
    with pytest.raises(Exception) as err:
        stream.committed()
    assert getattr(err.value, "code", None) == grpc.StatusCode.INVALID_ARGUMENT and "direct put" in str(err.value)
    stream.close()
    assert server.store.stats()["blocks"] == 0  # the whole commit failed: nothing half-stored
    stream = shm.open_put()
    stream.reserve("ns", [header(k, d) for k, d in zip(ks, data)], addresses=[cma.address_of(d)[0] for d in data])
    assert [r.status for r in stream.committed()] == [pb.PUT_STORED, pb.PUT_STORED]
    stream.close()
    with Client(f"127.0.0.1:{server.port}", lane="grpc") as kv:
        assert [bytes(b) for b in kv.get("ns", ks)] == data
    server.store.check_invariants()
    raw.close()


GET_CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    from kvstore.client import Client
    with Client(sys.argv[1], lane="shm") as kv:
        keys = [bytes([7, i]) * 8 for i in range(6)]
        pool = np.zeros((6, (3 << 19) + 1000), dtype=np.uint8)  # a KV pool: the blocks land in its rows
        kv.get("ns", keys, out=list(pool))
        sys.stdout.buffer.write(pool.tobytes())
""")


def test_get_into_another_processes_buffers(make_server):
    server = make_server()
    size = (3 << 19) + 1000
    blocks = [os.urandom(size) for _ in range(6)]
    with Client(f"127.0.0.1:{server.port}", lane="grpc") as kv:
        kv.put("ns", [bytes([7, i]) * 8 for i in range(6)], blocks)
    out = subprocess.run(
        [sys.executable, "-c", GET_CHILD, f"127.0.0.1:{server.port}"], cwd=ROOT, capture_output=True, timeout=60
    )
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout == b"".join(blocks)
    assert server.metrics.counters()["lane_shm_direct_get_bytes"] == 6 * size


def test_direct_get_checks_destinations(make_server):
    server = make_server()
    data = os.urandom(100_000)
    with Client(f"127.0.0.1:{server.port}", lane="shm") as kv:
        kv.put("ns", keys(1), [data])
        small = bytearray(1000)
        with pytest.raises(Exception) as err:
            kv.get("ns", keys(1), out=[small])
        assert getattr(err.value, "code", None) == grpc.StatusCode.INVALID_ARGUMENT
        assert small == bytearray(1000)  # nothing written past or into a buffer that is too small
        dest = bytearray(100_000)
        assert kv.get("ns", keys(1), out=[dest])[0] is dest and dest == data
    raw = RawLanes(server)
    shm = raw.shm()
    request = lpb.LaneGetRequest(
        lane=shm.ref, request=pb.GetRequest(namespace="ns", hashes=keys(1)), out_addresses=[8], out_lengths=[100_000]
    )  # page zero
    with pytest.raises(grpc.RpcError) as rpc_err:
        list(raw.stub.LaneGet(request, timeout=10))
    assert rpc_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "direct get" in rpc_err.value.details()
    raw.close()


def test_a_get_without_the_handshake_cannot_name_client_memory(make_server, monkeypatch):
    monkeypatch.setattr("kvstore.lanes.client.shm.handshake", lambda *a: ("skipped by the test", None))
    server = make_server()
    raw = RawLanes(server)
    shm = raw.shm()
    dest = bytearray(4096)
    request = lpb.LaneGetRequest(
        lane=shm.ref,
        request=pb.GetRequest(namespace="ns", hashes=keys(1)),
        out_addresses=[cma.address_of(dest)[0]],
        out_lengths=[4096],
    )
    with pytest.raises(grpc.RpcError) as err:
        list(raw.stub.LaneGet(request, timeout=10))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    raw.close()


KILLED_CHILD = textwrap.dedent("""
    import os, signal, sys
    from kvstore.client import Client
    from kvstore.checksum import crc32c
    from kvstore.lanes.cma import address_of
    from kvstore.v1 import kvstore_pb2 as pb
    from kvstore.v1 import lanes_pb2 as lpb

    with Client(sys.argv[1], lane="shm") as kv:
        blocks = [bytes([i + 1]) * (2 << 20) for i in range(16)]
        headers = [pb.BlockHeader(hash=bytes([8, i]) * 8, raw_length=len(b), stored_length=len(b),
                                  crc32c=crc32c(b), dtype="uint8") for i, b in enumerate(blocks)]
        def die_mid_put(lane):
            assert lane.direct
            stream = lane.open_put()
            stream._send(lpb.LanePutRequest(reserve=lpb.LaneReserve(
                namespace="ns", headers=headers, addresses=[address_of(b)[0] for b in blocks])))
            if sys.argv[2] == "after-grant":
                stream._next("grant")  # the store reads our memory right after sending the grant
            os.kill(os.getpid(), signal.SIGKILL)
        kv._lanes.run(die_mid_put)
""")


@pytest.mark.parametrize("when", ["before-reserve", "after-grant"])
def test_client_killed_during_a_direct_put_leaves_only_whole_blocks(make_server, when):
    server = make_server(dram=256 << 20, lane_lease=1.0)
    child = subprocess.run(
        [sys.executable, "-c", KILLED_CHILD, f"127.0.0.1:{server.port}", when],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    assert child.returncode == -9, child.stderr.decode()
    hashes = [bytes([8, i]) * 8 for i in range(16)]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the reserve is taken back or committed whole
        stored = server.store.stats()["blocks"]
        if server.store.top.used_bytes == stored * (2 << 20):
            break
        time.sleep(0.05)
    assert server.store.top.used_bytes == stored * (2 << 20)  # no slot left reserved
    server.store.check_invariants()
    with Client(f"127.0.0.1:{server.port}", lane="grpc") as kv:
        got = kv.get("ns", hashes, allow_missing=True)
    for i, block in enumerate(got):  # whatever was stored is the child's bytes, never a torn block
        assert block is None or bytes(block) == bytes([i + 1]) * (2 << 20)


def test_sweep_removes_what_killed_servers_left(tmp_path):
    from kvstore import shmfile
    from kvstore.lanes.shm_region import sweep

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = [tmp_path / f"kvstore-lane-{dead.pid}-abc", tmp_path / f"kvstore-direct-{dead.pid}-def.sock"]
    mine = [
        tmp_path / shmfile.name_of(shmfile.LANE_PREFIX),
        tmp_path / shmfile.name_of(shmfile.DIRECT_PREFIX, ".sock"),
        tmp_path / "unrelated",
    ]
    for p in left + mine:
        p.write_bytes(b"")
    assert sweep(str(tmp_path)) == 2
    assert not any(p.exists() for p in left) and all(p.exists() for p in mine)


def test_lost_permission_moves_the_client_to_region_copies(make_server, monkeypatch):
    import errno

    server = make_server()
    data = [os.urandom(1 << 20) for _ in range(3)]
    with Client(f"127.0.0.1:{server.port}", lane="shm") as kv:
        assert kv.put("ns", keys(1), data[:1])[0].status == "stored"  # a direct lane is open now
        direct_bytes = server.metrics.counters()["lane_shm_direct_put_bytes"]

        def refused(*args):
            raise cma.DirectReadError(errno.EPERM, "Operation not permitted (as if the client named another store)")

        monkeypatch.setattr(cma, "read_into", refused)  # the lane's reads and any new handshake's nonce read
        monkeypatch.setattr(cma, "read_many", refused)  # a commit's batch of one-buffer blocks
        assert [r.status for r in kv.put("ns", keys(3)[1:], data[1:])] == ["stored", "stored"]
        assert [bytes(b) for b in kv.get("ns", keys(3))] == data
    assert server.metrics.counters()["lane_shm_direct_put_bytes"] == direct_bytes  # the rest went by region


def test_one_client_is_direct_with_two_store_processes():
    """Where Yama is not loaded nothing limits how many stores may read a client; a second local store used to be
    refused (its lane copied through the region: bench.nvme_get's NVMe store, opened second, measured that path)."""
    from kvstore.server.process import store_process

    yama = os.path.exists("/proc/sys/kernel/yama/ptrace_scope")
    blocks = [np.full(1 << 20, i, dtype=np.uint8) for i in range(4)]
    private = ("--dram", "64MiB", "--share-dram", "false")  # the store writes the Gets into the client's memory
    with store_process(*private) as (first, _), store_process(*private) as (second, _):
        direct_bytes = []
        for target in (first, second):
            with Client(target, lane="shm") as kv:
                assert all(r.ok for r in kv.put("ns", keys(4), blocks))
                out = [np.zeros(1 << 20, dtype=np.uint8) for _ in range(4)]
                kv.get("ns", keys(4), out=out)
                assert all(np.array_equal(a, b) for a, b in zip(out, blocks))
                direct_bytes.append(kv.stats()["counters"]["lane_shm_direct_get_bytes"])
    assert direct_bytes[0] == 4 << 20
    assert direct_bytes[1] == (0 if yama else 4 << 20)
