"""A direct Get of raw DRAM hits on the shm lane answers in one message of columns (``WrittenBlocks``).

The columns replace a BlockDescriptor per block; these tests pin what they must keep of the general path:
the bytes land in the caller's buffers with each block's CRC32C checked against its own, a corrupt DRAM
block still fails the Get, a bad destination is refused before anything is written and leaves no lease,
and a request that does not ask for columns (an older client) still gets descriptors.
"""

from __future__ import annotations

import functools
import os
import time

import grpc
import numpy as np
import pytest

from kvstore.client import Client
from kvstore.errors import KVStoreError
from kvstore.lanes import cma
from kvstore.lanes.cma import address_of
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import lanes_pb2 as lpb
from tests.test_lanes_support import RawLanes, keys

pytestmark = pytest.mark.skipif(not cma.available(), reason="process_vm_writev is Linux-only")

SIZE = 65536


@pytest.fixture
def make_server(make_server):
    """These tests are of the store writing Gets into the client's memory: its DRAM arena private (``--share-dram
    false``; a test may pass its own)."""
    return functools.partial(make_server, share_dram=False)


def _no_leases(server, hashes: list[bytes]) -> bool:
    ids = server.store.table.find_many(server.store.table.namespace_id("ns"), hashes)
    return int(server.store.table.column("leases").take(ids[ids >= 0]).sum()) == 0


def _leases_end(server, hashes: list[bytes], timeout: float = 10.0) -> bool:
    """No leases on ``hashes`` within ``timeout``: a served Get's last leases end just after its reply is sent,
    so a client can hold the reply before they do."""
    deadline = time.monotonic() + timeout
    while not _no_leases(server, hashes):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _request(ref: lpb.LaneRef, hashes: list[bytes], outs: list[np.ndarray], columns: bool) -> lpb.LaneGetRequest:
    return lpb.LaneGetRequest(
        lane=ref,
        request=pb.GetRequest(namespace="ns", hashes=hashes),
        crc_at_copy=True,
        out_addresses=[address_of(o)[0] for o in outs],
        out_lengths=[o.nbytes for o in outs],
        written_columns=columns,
    )


def test_dram_hits_come_as_columns_and_an_older_request_gets_descriptors(make_server):
    server = make_server()
    blocks = [os.urandom(SIZE) for _ in range(4)]
    with Client(f"127.0.0.1:{server.port}", lane="grpc") as kv:
        kv.put("ns", keys(4), blocks)
    raw = RawLanes(server)
    shm = raw.shm()  # its direct handshake names this process's memory
    try:
        outs = [np.zeros(SIZE + 100, dtype=np.uint8) for _ in range(4)]
        (reply,) = list(raw.stub.LaneGet(_request(shm.ref, keys(4), outs, True), timeout=10))
        assert reply.HasField("written") and not reply.blocks and reply.last and reply.handled == 4
        assert list(reply.written.index) == [0, 1, 2, 3] and list(reply.written.length) == [SIZE] * 4
        assert list(reply.written.crc32c) == list(reply.written.stored_crc32c)
        assert [o[:SIZE].tobytes() for o in outs] == blocks and not outs[0][SIZE:].any()
        shm._give_back(reply.grant_id)

        outs = [np.zeros(SIZE, dtype=np.uint8) for _ in range(4)]
        replies = list(raw.stub.LaneGet(_request(shm.ref, keys(4), outs, False), timeout=10))
        assert not any(r.HasField("written") for r in replies)
        assert sum(len(r.blocks) for r in replies) == 4 and all(r.written_direct for r in replies)
        assert [o.tobytes() for o in outs] == blocks
        for r in replies:
            shm._give_back(r.grant_id)
    finally:
        shm.close()
        raw.close()
    assert _leases_end(server, keys(4))


def test_the_client_takes_columns_and_checks_each_crc(make_server):
    server = make_server()
    blocks = [os.urandom(SIZE) for _ in range(40)]  # over 1 MiB: the CRC32Cs go on the copy threads
    with Client(f"127.0.0.1:{server.port}", lane="shm") as kv:
        kv.put("ns", keys(40), blocks)
        outs = [np.empty(SIZE, dtype=np.uint8) for _ in range(40)]
        got = kv.get("ns", keys(40), out=outs)
        assert all(g is o for g, o in zip(got, outs)) and [o.tobytes() for o in outs] == blocks
        (lease,) = server.store.acquire("ns", keys(40)[33:34])
        try:
            np.frombuffer(lease.buffer, dtype=np.uint8)[1234] ^= 0x40  # rot in DRAM, after the Put's check
        finally:
            server.store.release([lease])
        with pytest.raises(KVStoreError) as err:
            kv.get("ns", keys(40), out=outs)
        assert err.value.code == grpc.StatusCode.DATA_LOSS and "block 33 " in err.value.message
        assert kv.get("ns", keys(40)[:33], out=outs[:33])[0] is outs[0]  # the others are still served
    assert _leases_end(server, keys(40))


@pytest.mark.parametrize("named", [False, True], ids=["written", "named-in-shared-arena"])
def test_a_short_buffer_is_refused_before_any_write_and_leaves_no_lease(make_server, named):
    """Also where the store names the blocks in its shared DRAM arena (every Get asked: no index) and the client
    copies them: there a refused Get's blocks stay leased until the lane's next request or its close."""
    server = make_server(share_dram=named, dram_index=False)
    blocks = [os.urandom(SIZE) for _ in range(3)]
    with Client(f"127.0.0.1:{server.port}", lane="shm") as kv:
        kv.put("ns", keys(3), blocks)
        outs = [np.zeros(SIZE, dtype=np.uint8), np.zeros(SIZE - 1, dtype=np.uint8), np.zeros(SIZE, dtype=np.uint8)]
        with pytest.raises(KVStoreError) as err:
            kv.get("ns", keys(3), out=outs)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "output buffer 1" in err.value.message
        assert not any(o.any() for o in outs)  # checked before the first write
        assert named or _no_leases(server, keys(3))
        outs[1] = np.zeros(SIZE, dtype=np.uint8)
        assert [g.tobytes() for g in kv.get("ns", keys(3), out=outs)] == blocks
    assert _leases_end(server, keys(3))


def test_a_missing_block_takes_the_descriptor_path(make_server):
    server = make_server()
    blocks = [os.urandom(SIZE) for _ in range(3)]
    with Client(f"127.0.0.1:{server.port}", lane="shm") as kv:
        kv.put("ns", keys(3), blocks)
        hashes = [keys(3)[0], b"\x09" * 16, keys(3)[2]]
        outs = [np.zeros(SIZE, dtype=np.uint8) for _ in range(3)]
        got = kv.get("ns", hashes, out=outs, allow_missing=True)
        assert got[1] is None and got[0].tobytes() == blocks[0] and got[2].tobytes() == blocks[2]
    assert _leases_end(server, keys(3))


CHILD = r"""
import sys, numpy as np
from kvstore.client import Client
target, keys = sys.argv[1], [bytes.fromhex(k) for k in sys.argv[2].split(",")]
with Client(target, timeout=30, lane="shm") as kv:
    out = [np.empty(65536, dtype=np.uint8) for _ in keys]
    print("ready", flush=True)
    while True:
        kv.get("ns", keys, out=out)
"""


@pytest.mark.parametrize("named", [False, True], ids=["written", "named-in-shared-arena"])
def test_a_client_killed_mid_get_leaves_no_lease(make_server, named):
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT

    server = make_server(share_dram=named, dram_index=False)  # named: the killed lane's arena leases must end
    served = "lane_shm_dram_get_bytes" if named else "lane_shm_direct_get_bytes"
    blocks = [os.urandom(SIZE) for _ in range(64)]
    hashes = keys(64)
    with Client(f"127.0.0.1:{server.port}", lane="grpc") as kv:
        kv.put("ns", hashes, blocks)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, f"127.0.0.1:{server.port}", ",".join(k.hex() for k in hashes)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 20
        while server.metrics.counters().get(served, 0) < 20 * 64 * SIZE:
            assert time.monotonic() < deadline, "the child's Gets did not come"
            time.sleep(0.01)
        for _ in range(500):  # kill it while the server is inside a Get
            if not _no_leases(server, hashes):
                break
            time.sleep(0.001)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
    deadline = time.monotonic() + 20
    while not _no_leases(server, hashes):
        assert time.monotonic() < deadline, "a killed client's Get left leases behind"
        time.sleep(0.02)
    with Client(f"127.0.0.1:{server.port}", lane="shm") as kv:
        outs = [np.empty(SIZE, dtype=np.uint8) for _ in range(64)]
        assert [o.tobytes() for o in kv.get("ns", hashes, out=outs)] == blocks
