"""Leases on the lanes: a client killed or stalled mid-Put leaves no slot behind and no partial block."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import grpc
import pytest

from kvstore.client import Client, KVStoreError
from kvstore.lanes import framing
from kvstore.lanes.base import LaneBroken
from kvstore.v1 import lanes_pb2 as lpb
from tests.conftest import ROOT
from tests.test_lanes_support import RawLanes, header, keys

LEASE = 1.0
BLOCK = 1 << 20


@pytest.fixture
def lane_server(make_server):
    return make_server(dram=64 << 20, shm_lane_bytes=16 << 20, lane_lease=LEASE)


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


CHILD = textwrap.dedent("""
    import sys, time
    from kvstore.client import Client
    from kvstore.checksum import crc32c
    from kvstore.v1 import kvstore_pb2 as pb

    with Client(sys.argv[1], lane=sys.argv[2]) as kv:
        blocks = [bytes([i + 1]) * (1 << 20) for i in range(8)]
        headers = [pb.BlockHeader(hash=bytes([9, i]) * 8, raw_length=len(b), stored_length=len(b),
                                  crc32c=crc32c(b), dtype="uint8") for i, b in enumerate(blocks)]
        def half_a_put(lane):
            if lane.kind in ("shm", "cuda_ipc"):
                stream = lane.open_put()
                grant = stream.reserve("ns", headers)
                for slot, block in zip(grant.slots[:4], blocks):
                    lane.write(slot, memoryview(block))  # written, never committed
            else:
                from kvstore.lanes import framing
                from kvstore.v1 import lanes_pb2 as lpb
                meta = lpb.TcpPut(namespace="ns", headers=headers).SerializeToString()
                parts = [memoryview(framing.HEADER.pack(framing.MAGIC, framing.PUT, len(meta), 8 * ((1 << 20) + 4))),
                         memoryview(meta)]
                for b in blocks[:3]:
                    parts += [memoryview(b), memoryview(framing.CRC.pack(crc32c(b)))]
                framing.send_all(lane.sock, parts + [memoryview(blocks[3])[:1000]])
            print("READY", flush=True)
            time.sleep(60)
        kv._lanes.run(half_a_put)
""")


@pytest.mark.parametrize("lane", ["shm", "tcp", "cuda_ipc"])
def test_client_killed_mid_put_leaks_nothing(lane_server, lane):
    target = f"127.0.0.1:{lane_server.port}"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, target, lane], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = child.stdout.readline()
        assert line.strip() == "READY", child.stderr.read()
        hashes = [bytes([9, i]) * 8 for i in range(8)]
        partial = 0  # tcp commits the blocks of a frame 64 at a time (and at its end), shm on commit
        # shm: 8 slots reserved, 4 written; tcp: 3 blocks received (not committed) and the 4th slot filling
        held = 8 * BLOCK if lane != "tcp" else 4 * BLOCK
        assert wait_until(lambda: lane_server.store.top.used_bytes == held)
        assert lane_server.store.lookup("ns", hashes)[0] == partial
    finally:
        child.kill()  # SIGKILL: no cleanup of any kind in the client
        child.wait()
    assert wait_until(lambda: lane_server.store.top.used_bytes == partial * BLOCK, timeout=LEASE * 5)
    assert lane_server.store.lookup("ns", hashes)[0] == partial  # only whole, verified blocks are visible
    assert lane_server.store.stats()["blocks"] == partial
    lane_server.store.check_invariants()
    with Client(target, lane=lane) as kv:  # the node is fine afterwards
        assert kv.put("ns", hashes[:1], [b"z" * 100])[0].status in ("stored", "already_present")


def test_stalled_put_grant_expires_after_its_lease(lane_server):
    raw = RawLanes(lane_server)
    shm = raw.shm()
    stream = shm.open_put()
    ks = keys(4)
    data = b"s" * BLOCK
    grant = stream.reserve("ns", [header(k, data) for k in ks])
    crc = shm.write(grant.slots[0], memoryview(data))
    assert lane_server.store.top.used_bytes == 4 * BLOCK
    assert wait_until(lambda: lane_server.store.top.used_bytes == 0, timeout=LEASE * 5)  # stream still open
    assert lane_server.metrics.counters()["lane_grants_expired"] >= 4
    stream.send_commit(
        grant.grant_id,
        [lpb.BlockDescriptor(index=0, hash=ks[0], offset=grant.slots[0].offset, length=BLOCK, crc32c=crc)],
    )
    with pytest.raises(LaneBroken, match="expired"):
        stream.committed()
    stream.close()
    assert lane_server.store.stats()["blocks"] == 0
    raw.close()


def test_put_stream_closed_early_gives_slots_back_at_once(make_server):
    # a lease far longer than the wait: the slots come back because the stream closed, not because it expired
    server = make_server(dram=64 << 20, shm_lane_bytes=16 << 20, lane_lease=60.0)
    raw = RawLanes(server)
    shm = raw.shm()
    stream = shm.open_put()
    stream.reserve("ns", [header(k, b"e" * BLOCK) for k in keys(4)])
    assert server.store.top.used_bytes == 4 * BLOCK
    stream.close()
    assert wait_until(lambda: server.store.top.used_bytes == 0, timeout=10)
    raw.close()


def test_tcp_peer_that_stops_sending_is_cut_after_the_lease(lane_server):
    raw = RawLanes(lane_server)
    tcp = raw.tcp()
    meta = lpb.TcpPut(namespace="ns", headers=[header(k, b"t" * BLOCK) for k in keys(2)]).SerializeToString()
    framing.send_all(
        tcp.sock,
        [
            memoryview(framing.HEADER.pack(framing.MAGIC, framing.PUT, len(meta), 2 * BLOCK + 8)),
            memoryview(meta),
            memoryview(b"t" * 1000),
        ],
    )
    assert wait_until(lambda: lane_server.store.top.used_bytes == BLOCK)
    assert wait_until(lambda: lane_server.store.top.used_bytes == 0, timeout=LEASE * 5)
    assert lane_server.store.stats()["blocks"] == 0
    assert wait_until(lambda: len(lane_server.lanes.registry) == 0)  # the connection and its lane are gone
    tcp.close()
    raw.close()


def test_idle_lanes_close_and_the_client_reopens(make_server):
    server = make_server(shm_lane_bytes=8 << 20, lane_lease=0.2)  # idle after 10 leases: 2 s
    with Client(f"127.0.0.1:{server.port}", lane="shm") as kv:
        kv.put("ns", keys(1), [b"a" * 100])
        assert len(server.lanes.registry) == 1
        assert wait_until(lambda: len(server.lanes.registry) == 0, timeout=5)
        assert bytes(kv.get("ns", keys(1))[0]) == b"a" * 100  # LaneBroken -> a fresh lane, transparently
        assert kv.lane_kind == "shm" and len(server.lanes.registry) == 1


@pytest.mark.parametrize("lane", ["shm", "tcp", "cuda_ipc"])
def test_lanes_closed_by_the_server_are_reopened(make_server, lane):
    server = make_server(shm_lane_bytes=8 << 20)
    with Client(f"127.0.0.1:{server.port}", lane=lane) as kv:
        kv.put("ns", keys(2), [b"a" * 100, b"b" * 100])
        server.lanes.registry.close_all()
        assert [bytes(b) for b in kv.get("ns", keys(2))] == [b"a" * 100, b"b" * 100]
        assert kv.put("ns", keys(3), [b"a" * 100, b"b" * 100, b"c" * 100])[2].status == "stored"


def test_server_stop_ends_lanes(make_server):
    server = make_server(shm_lane_bytes=8 << 20)
    target = f"127.0.0.1:{server.port}"
    with Client(target, lane="tcp", retries=0, timeout=5) as kv:
        kv.put("ns", keys(1), [b"a"])
        server.stop(0)
        with pytest.raises(Exception) as err:
            kv.get("ns", keys(1))
        assert getattr(err.value, "code", grpc.StatusCode.UNAVAILABLE) == grpc.StatusCode.UNAVAILABLE


def test_get_results_lent_in_place_are_returned_when_dropped(make_server, monkeypatch):
    import gc

    from kvstore.lanes.server import shm_get

    monkeypatch.setattr(shm_get, "FIRST_YIELD_BYTES", shm_get.YIELD_BYTES)  # one message per get here
    server = make_server(shm_lane_bytes=8 << 20)
    blocks = [bytes([i]) * (1 << 20) for i in range(3)]
    with Client(f"127.0.0.1:{server.port}", lane="shm") as kv:
        kv.put("ns", keys(3), blocks)
        (lane,) = server.lanes.registry._lanes.values()
        got = kv.get("ns", keys(3))  # 3 MiB lent: under half of the 8 MiB region
        assert [bytes(g) for g in got] == blocks
        assert lane.grants.ranges.used_bytes == 3 << 20
        kept = kv.get("ns", keys(3))  # over the budget now: copied out, and its grant given back
        assert [bytes(g) for g in kept] == blocks
        del got
        gc.collect()
        kv.get("ns", keys(1)[:1])  # the next request carries the releases
        assert lane.grants.ranges.used_bytes == 1 << 20  # only the block just lent
        assert [bytes(g) for g in kept] == blocks


def test_lent_views_outlive_their_lane(make_server):
    server = make_server(shm_lane_bytes=8 << 20)
    with Client(f"127.0.0.1:{server.port}", lane="shm") as kv:
        kv.put("ns", keys(2), [b"a" * 5000, b"b" * 7000])
        got = kv.get("ns", keys(2))
    server.lanes.registry.close_all()
    assert bytes(got[0]) == b"a" * 5000 and bytes(got[1]) == b"b" * 7000


def test_a_region_full_of_lent_blocks_moves_the_client_to_a_fresh_lane(make_server):
    server = make_server(shm_lane_bytes=8 << 20)
    with Client(f"127.0.0.1:{server.port}", lane="shm") as kv:
        kv.put("ns", keys(2), [b"a" * (3 << 20), b"b" * (1 << 20)])
        kept = kv.get("ns", keys(2)[:1])  # 3 MiB lent from the 8 MiB region
        big = keys(1, seed=5)
        assert kv.put("ns", big, [b"c" * (6 << 20)])[0].status == "stored"  # 5 MiB free: needs another lane
        assert bytes(kv.get("ns", big)[0]) == b"c" * (6 << 20)
        assert bytes(kept[0]) == b"a" * (3 << 20)


def test_result_buffers_are_recycled_once_dropped():
    import gc

    from kvstore.lanes.buffers import BufferPool

    pool = BufferPool(limit=8 << 20)
    views = pool.alloc_blocks([1 << 20, 3 << 20])
    views[1][:5] = b"hello"
    assert pool.pooled_bytes == 0
    del views
    gc.collect()
    assert pool.pooled_bytes == 4 << 20
    again = pool.alloc_blocks([4 << 20])
    assert pool.pooled_bytes == 0 and len(again[0]) == 4 << 20
    too_big = pool.alloc_blocks([16 << 20])
    del too_big, again
    gc.collect()
    assert pool.pooled_bytes == 4 << 20  # over the limit: unmapped, not pooled
    newer = pool.alloc_blocks([6 << 20])
    del newer
    gc.collect()
    assert pool.pooled_bytes == 6 << 20  # the newest size pushes out the oldest
    assert len(pool.alloc_blocks([6 << 20])[0]) == 6 << 20 and pool.pooled_bytes == 0


def test_a_failed_lane_get_leaves_no_region_in_use(make_server):
    server = make_server(shm_lane_bytes=8 << 20)
    with Client(f"127.0.0.1:{server.port}", lane="shm", retries=0) as kv:
        kv.put("ns", keys(2), [b"a" * 1000, b"b" * 1000])
        (lane,) = server.lanes.registry._lanes.values()
        with pytest.raises(KVStoreError):
            kv.get("ns", keys(3))  # NOT_FOUND for the third hash: nothing copied, nothing held
        assert lane.grants.ranges.used_bytes == 0 and len(lane.grants) == 0
