"""``--dram-prefault``: the DRAM tier's pages are made in the background, the bytes it holds are kept."""

from __future__ import annotations

import ctypes
import mmap
import time

import numpy as np

from kvstore.client import Client
from kvstore.prefault import Prefaulter
from kvstore.tiers.arena import ArenaTier

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def _resident_bytes(address: int, size: int) -> int:
    """Bytes of [address, address + size) in memory, by mincore: exactly that range (smaps' Rss is the whole
    mapping, which the kernel may have merged with a neighbour that holds pages of its own)."""
    page = mmap.PAGESIZE
    vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
    if _libc.mincore(address, size, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vec) * page


def test_prefaulter_makes_every_page_and_keeps_what_they_hold():
    size = 64 << 20
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    data = np.frombuffer(region, dtype=np.uint8)
    data[size // 2 : size // 2 + 7] = 7  # written before: kept
    address = int(data.ctypes.data)
    assert _resident_bytes(address, size) <= 1 << 20
    p = Prefaulter(address, size)
    p.join(30)
    assert p.done == size and _resident_bytes(address, size) == size
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
