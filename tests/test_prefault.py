"""``--dram-prefault``: the DRAM tier's pages are made in the background, the bytes it holds are kept."""

from __future__ import annotations

import mmap
import time

import numpy as np

from kvstore.client import Client
from kvstore.prefault import Prefaulter
from kvstore.tiers.arena import ArenaTier


def _rss_of_mapping(address: int) -> int:
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("mapping not found")


def test_prefaulter_makes_every_page_and_keeps_what_they_hold():
    size = 64 << 20
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    data = np.frombuffer(region, dtype=np.uint8)
    data[size // 2 : size // 2 + 7] = 7  # written before: kept
    address = int(data.ctypes.data)
    assert _rss_of_mapping(address) <= 1 << 20
    p = Prefaulter(address, size)
    p.join(30)
    assert p.done == size and _rss_of_mapping(address) == size
    assert data[size // 2 : size // 2 + 7].tolist() == [7] * 7 and not data[:4096].any()
    del data
    region.close()


def test_prefaulter_stops_between_calls():
    size = 1 << 30
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = int(np.frombuffer(region, dtype=np.uint8).ctypes.data)
    p = Prefaulter(address, size)
    p.stop()
    done = p.done
    p.join(5)
    assert done < size and p.done <= done + (16 << 20)
    region.close()


def test_arena_tier_prefaults_only_when_asked():
    tier = ArenaTier(32 << 20, prefault=True)
    assert tier.prefaulter is not None
    tier.prefaulter.join(30)
    assert tier.prefaulter.done == tier.slabs.capacity
    tier.close()
    assert ArenaTier(32 << 20).prefaulter is None


def test_a_prefaulting_store_serves_from_its_start(spawn_server):
    proc = spawn_server("--dram", "256MiB", "--dram-prefault", "true")
    keys = [i.to_bytes(16, "little") for i in range(32)]
    blocks = [bytes([i]) * (1 << 20) for i in range(32)]
    with Client(proc.target, timeout=30) as kv:
        assert all(r.ok for r in kv.put("ns", keys, blocks))  # while the pages are being made
        deadline = time.monotonic() + 30
        while proc.rss_bytes() < 256 << 20 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.rss_bytes() >= 256 << 20
        assert [bytes(b) for b in kv.get("ns", keys)] == blocks
