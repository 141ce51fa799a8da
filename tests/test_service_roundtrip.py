"""Through a real server on a loopback port: round trips, prefixes, concurrency.

The per-block cases (tensors, idempotent Put, missing hashes) run on every lane in test_lanes_roundtrip.py."""

from __future__ import annotations

import random
import threading

from kvstore.client import Client
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


def test_lookup_longest_cached_prefix(client):
    keys = block_hashes(list(range(16 * 10)), 16, "ns", "m")
    client.put("ns", keys[:6], [b"x" * 1000] * 6)
    assert client.lookup("ns", keys) == 6
    client.put("ns", keys[7:8], [b"y" * 1000])  # a hole at 6 stops the prefix
    n, tiers = client.lookup_tiers("ns", keys)
    assert n == 6 and tiers == ["dram"] * 6
    assert client.lookup("other-namespace", keys) == 0
    assert client.lookup("ns", []) == 0


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
