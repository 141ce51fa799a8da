"""The foundation's round trips, over every lane (grpc, shm, tcp, cuda_ipc), through a real server.

cuda_ipc runs here on its cpu stand-in (``--cuda-lane-device cpu``: the same lane
code over a host region); tests/test_cuda_lane.py runs it on a GPU where one exists.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from kvstore.client import Client, KVStoreError
from kvstore.hashing import block_hashes

LANES = ["grpc", "shm", "tcp", "cuda_ipc"]


@pytest.fixture(params=LANES)
def lane(request) -> str:
    return request.param


@pytest.fixture
def lane_server(make_server):
    # A small region, so a batch needs several rounds on the shm lane.
    return make_server(dram=512 << 20, shm_lane_bytes=16 << 20, cuda_lane_bytes=16 << 20, lane_lease=5.0)


@pytest.fixture
def kv(lane_server, lane):
    with Client(f"127.0.0.1:{lane_server.port}", lane=lane, timeout=30) as c:
        yield c


def test_mixed_blocks_round_trip_in_rounds(kv, lane, lane_server):
    rng = random.Random(7)
    hashes = [rng.randbytes(16) for _ in range(120)]
    payloads = [rng.randbytes(rng.randint(1, 2 << 20)) for _ in range(120)]  # ~120 MiB: 8 rounds of 16 MiB
    for start in range(0, 120, 60):
        results = kv.put("rt", hashes[start : start + 60], payloads[start : start + 60])
        assert [r.status for r in results] == ["stored"] * 60
    assert kv.lane_kind == lane
    got = kv.get("rt", hashes)
    assert all(bytes(g) == p for g, p in zip(got, payloads))
    assert kv.stats()["blocks"] == 120
    counters = kv.stats()["counters"]
    if lane != "grpc":
        total = sum(len(p) for p in payloads)
        assert counters[f"lane_{lane}_put_bytes"] == total and counters[f"lane_{lane}_get_bytes"] == total
    lane_server.store.check_invariants()


def test_numpy_and_torch_payloads_and_out_buffers(kv):
    torch = pytest.importorskip("torch")
    t = torch.randn(4, 2, 16, 3, 64).to(torch.bfloat16)
    a = np.arange(100_000, dtype=np.float32)
    keys = block_hashes(list(range(32)), 16, "ns", "m")
    assert [r.status for r in kv.put("ns", keys, [t, a])] == ["stored", "stored"]
    out_t, out_a = torch.empty_like(t), np.empty_like(a)
    kv.get("ns", keys, out=[out_t, out_a])
    assert torch.equal(out_t, t) and np.array_equal(out_a, a)


def test_put_is_idempotent(kv):
    keys = block_hashes(list(range(48)), 16, "ns", "m")
    data = [bytes([i]) * 4096 for i in range(3)]
    assert [r.status for r in kv.put("ns", keys, data)] == ["stored"] * 3
    assert [r.status for r in kv.put("ns", keys, data)] == ["already_present"] * 3
    mixed = block_hashes(list(range(64)), 16, "ns", "m")
    assert [r.status for r in kv.put("ns", mixed, data + [b"d" * 4096])] == ["already_present"] * 3 + ["stored"]
    assert kv.stats()["blocks"] == 4


def test_get_missing_and_allow_missing(kv):
    keys = block_hashes(list(range(48)), 16, "ns", "m")
    kv.put("ns", keys[:1], [b"a" * 10])
    kv.put("ns", keys[2:3], [b"c" * 20])
    with pytest.raises(KVStoreError) as err:
        kv.get("ns", keys)
    assert err.value.code.name == "NOT_FOUND" and keys[1].hex() in err.value.message
    got = kv.get("ns", keys, allow_missing=True)
    assert bytes(got[0]) == b"a" * 10 and got[1] is None and bytes(got[2]) == b"c" * 20
    assert kv.get("ns", []) == []


def test_lookup_and_delete_beside_lanes(kv):
    keys = block_hashes(list(range(16 * 4)), 16, "ns", "m")
    kv.put("ns", keys, [b"x" * 1000] * 4)
    assert kv.lookup("ns", keys) == 4
    assert kv.delete("ns", keys) == 4
    assert kv.lookup("ns", keys) == 0


def test_out_buffer_too_small(kv):
    keys = block_hashes(list(range(16)), 16, "ns", "m")
    kv.put("ns", keys, [b"q" * 1000])
    with pytest.raises((KVStoreError, ValueError)):
        kv.get("ns", keys, out=[bytearray(10)])
    assert bytes(kv.get("ns", keys)[0]) == b"q" * 1000  # the lane is still usable


def test_eight_threads_share_one_client(lane_server, lane):
    """Concurrent calls on one Client hold separate lanes (or wait for one)."""
    errors: list[BaseException] = []
    with Client(f"127.0.0.1:{lane_server.port}", lane=lane, timeout=30) as kv:

        def worker(seed: int) -> None:
            try:
                rng = random.Random(seed)
                for _ in range(4):
                    keys = [rng.randbytes(16) for _ in range(rng.randint(1, 12))]
                    blocks = [(k * 4096)[: rng.randint(1, 65536)] for k in keys]
                    assert all(r.ok for r in kv.put("t", keys, blocks))
                    assert [bytes(b) for b in kv.get("t", keys)] == blocks
            except BaseException as err:  # noqa: BLE001 - surfaced below
                errors.append(err)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    lane_server.store.check_invariants()


def test_eight_concurrent_clients_overlapping_prefixes(lane_server, lane):
    target = f"127.0.0.1:{lane_server.port}"
    shared = list(range(16 * 8))
    errors: list[BaseException] = []

    def payload_for(key: bytes) -> bytes:
        return (key * (65536 // 16))[: 65536 - key[0]]  # content derived from the key: any mix-up shows

    def worker(seed: int) -> None:
        try:
            rng = random.Random(seed)
            with Client(target, lane=lane) as kv:
                for _ in range(4):
                    tokens = shared + [rng.randrange(1000) for _ in range(16 * rng.randint(1, 6))]
                    keys = block_hashes(tokens, 16, "shared", "m")
                    results = kv.put("shared", keys, [payload_for(k) for k in keys])
                    assert all(r.ok for r in results)
                    assert kv.lookup("shared", keys) == len(keys)
                    got = kv.get("shared", keys)
                    assert all(bytes(g) == payload_for(k) for g, k in zip(got, keys))
        except BaseException as err:  # noqa: BLE001 - surfaced below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    lane_server.store.check_invariants()
    deadline = time.monotonic() + 5  # tcp lanes close when the server sees their connection end
    while len(lane_server.lanes.registry) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(lane_server.lanes.registry) == 0  # every client closed its lanes


def test_batch_larger_than_the_memory_tier(make_server, lane):
    """As on gRPC, a batch bigger than DRAM is stored block by block, evicting the batch's own older blocks."""
    server = make_server(dram=8 << 20, shm_lane_bytes=32 << 20)
    rng = random.Random(3)
    hashes = [rng.randbytes(16) for _ in range(24)]
    payloads = [rng.randbytes(1 << 20) for _ in range(24)]
    with Client(f"127.0.0.1:{server.port}", lane=lane) as kv:
        results = kv.put("big", hashes, payloads, chained=False)
        assert [r.status for r in results] == ["stored"] * 24
        n, _ = kv.lookup_tiers("big", hashes[-4:])
        assert n == 4 and bytes(kv.get("big", hashes[-1:])[0]) == payloads[-1]
    server.store.check_invariants()
