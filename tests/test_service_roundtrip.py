"""Through a real gRPC server on a loopback port: round trips, prefixes, concurrency."""
from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from kvstore.client import Client, KVStoreError
from kvstore.hashing import block_hashes


def _blocks(rng: random.Random, n: int, lo: int, hi: int) -> list[bytes]:
    return [rng.randbytes(rng.randint(lo, hi)) for _ in range(n)]


def test_thousand_mixed_blocks_round_trip(make_server):
    server = make_server(dram=1536 << 20)
    rng = random.Random(7)
    hashes = [rng.randbytes(16) for _ in range(1000)]
    payloads = _blocks(rng, 1000, 64 << 10, 2 << 20)
    with Client(f"127.0.0.1:{server.port}") as kv:
        for start in range(0, 1000, 100):
            results = kv.put("rt", hashes[start : start + 100], payloads[start : start + 100])
            assert [r.status for r in results] == ["stored"] * 100
        for start in range(0, 1000, 125):
            got = kv.get("rt", hashes[start : start + 125])
            assert all(bytes(g) == p for g, p in zip(got, payloads[start : start + 125]))
        assert kv.stats()["blocks"] == 1000


def test_numpy_and_torch_payloads_and_out_buffers(client):
    torch = pytest.importorskip("torch")
    t = torch.randn(4, 2, 16, 3, 64).to(torch.bfloat16)
    a = np.arange(100_000, dtype=np.float32)
    keys = block_hashes(list(range(32)), 16, "ns", "m")
    assert [r.status for r in client.put("ns", keys, [t, a])] == ["stored", "stored"]
    out_t, out_a = torch.empty_like(t), np.empty_like(a)
    client.get("ns", keys, out=[out_t, out_a])
    assert torch.equal(out_t, t) and np.array_equal(out_a, a)


def test_put_is_idempotent(client):
    keys = block_hashes(list(range(48)), 16, "ns", "m")
    data = [bytes([i]) * 4096 for i in range(3)]
    assert [r.status for r in client.put("ns", keys, data)] == ["stored"] * 3
    assert [r.status for r in client.put("ns", keys, data)] == ["already_present"] * 3
    assert client.stats()["blocks"] == 3


def test_lookup_longest_cached_prefix(client):
    keys = block_hashes(list(range(16 * 10)), 16, "ns", "m")
    client.put("ns", keys[:6], [b"x" * 1000] * 6)
    assert client.lookup("ns", keys) == 6
    client.put("ns", keys[7:8], [b"y" * 1000])  # a hole at 6 stops the prefix
    n, tiers = client.lookup_tiers("ns", keys)
    assert n == 6 and tiers == ["dram"] * 6
    assert client.lookup("other-namespace", keys) == 0
    assert client.lookup("ns", []) == 0


def test_get_missing_and_allow_missing(client):
    keys = block_hashes(list(range(32)), 16, "ns", "m")
    client.put("ns", keys[:1], [b"a" * 10])
    with pytest.raises(KVStoreError) as err:
        client.get("ns", keys)
    assert err.value.code.name == "NOT_FOUND" and keys[1].hex() in err.value.message
    got = client.get("ns", keys, allow_missing=True)
    assert bytes(got[0]) == b"a" * 10 and got[1] is None


def test_delete(client):
    keys = block_hashes(list(range(32)), 16, "ns", "m")
    client.put("ns", keys, [b"a" * 10, b"b" * 10])
    assert client.delete("ns", keys + [b"\0" * 16]) == 2
    assert client.lookup("ns", keys) == 0


def test_eight_concurrent_clients_overlapping_prefixes(make_server):
    server = make_server(dram=512 << 20)
    target = f"127.0.0.1:{server.port}"
    shared = list(range(16 * 8))
    errors: list[BaseException] = []

    def payload_for(key: bytes) -> bytes:
        return (key * (65536 // 16))[: 65536 - key[0]]  # content derived from the key: any mix-up shows

    def worker(seed: int) -> None:
        try:
            rng = random.Random(seed)
            with Client(target) as kv:
                for _ in range(6):
                    tokens = shared + [rng.randrange(1000) for _ in range(16 * rng.randint(1, 6))]
                    keys = block_hashes(tokens, 16, "shared", "m")
                    results = kv.put("shared", keys, [payload_for(k) for k in keys])
                    assert all(r.ok for r in results)
                    n = kv.lookup("shared", keys)
                    assert n == len(keys)
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
    server.store.check_invariants()
