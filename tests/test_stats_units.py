"""Stats units (kvstore.proto StatsResponse): `lookups` counts calls, the lookup_* fields count hashes, and what a
Stats of one namespace fills is what the .proto says."""

from __future__ import annotations

import subprocess
import sys

from prometheus_client import generate_latest

from kvstore.client import Client
from tests.conftest import ROOT

KEYS = [bytes([i]) * 16 for i in range(1, 9)]


def lookups(kv: Client) -> None:
    kv.put("ns", KEYS[:2], [b"a" * 100, b"b" * 100])
    assert kv.lookup("ns", KEYS[:3]) == 2  # 2 hits, 1 miss
    assert kv.lookup("ns", [KEYS[5], KEYS[0], KEYS[1], KEYS[6], KEYS[7]]) == 0  # 5 misses: the prefix ends at once


def test_lookup_counters_have_one_unit_each(server):
    with Client(f"127.0.0.1:{server.port}", lane="grpc") as kv:
        lookups(kv)
        s = kv.stats()
    assert s["lookups"] == 2
    assert s["lookup_hashes"] == 8
    assert (s["lookup_hits"], s["lookup_misses"]) == (2, 6)
    text = generate_latest(server.metrics.registry).decode()
    assert "kvstore_lookups_total 2.0" in text and "kvstore_lookup_hashes_total 8.0" in text


def test_namespace_stats_fill_what_is_per_namespace(server):
    with Client(f"127.0.0.1:{server.port}", lane="grpc") as kv:
        lookups(kv)
        kv.put("other", [KEYS[7]], [b"c" * 50])
        mine = kv.stats("ns")
    assert mine["blocks"] == 2 and mine["counters"]["namespace_bytes"] == 200
    dram = next(t for t in mine["tiers"] if t["name"] == "dram")
    assert (dram["used_bytes"], dram["blocks"]) == (200, 2) and dram["capacity_bytes"] > 0
    node_wide = ("lookups", "lookup_hits", "lookup_misses", "lookup_hashes", "bytes_in", "bytes_out")
    assert all(mine[k] == 0 for k in node_wide)  # the .proto says these stay 0 in a namespace Stats


def test_cli_stats_names_calls_and_hashes(server):
    with Client(f"127.0.0.1:{server.port}", lane="grpc") as kv:
        lookups(kv)
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "stats", "--target", f"127.0.0.1:{server.port}"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=True,
    ).stdout
    assert "2 lookups of 8 hashes (2 hit, 6 missed)" in out
