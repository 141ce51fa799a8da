"""``--dram-prefault``: the DRAM tier's pages are made in the background, the bytes it holds are kept."""

from __future__ import annotations

import ctypes
import mmap
import time

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.prefault import Prefaulter, populate
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


def test_populate_makes_every_page_now_and_keeps_what_they_hold():
    size = 16 << 20
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    data = np.frombuffer(region, dtype=np.uint8)
    data[size // 2 : size // 2 + 7] = 7
    address = int(data.ctypes.data)
    assert _resident_bytes(address, size) <= 1 << 20
    populate(data[100:])  # an unaligned start: its own page is made too, with the rest
    assert _resident_bytes(address, size) == size
    assert data[size // 2 : size // 2 + 7].tolist() == [7] * 7 and not data[:4096].any()
    del data
    region.close()


def test_populate_without_the_madvise_writes_each_page_with_what_it_holds(monkeypatch):
    import kvstore.prefault as prefault

    monkeypatch.setattr(prefault, "madvise", lambda *args: -1)  # a kernel older than 5.14
    size = 4 << 20
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    data = np.frombuffer(region, dtype=np.uint8)
    data[100 : 100 + 3 * mmap.PAGESIZE] = 9
    populate(data[100:])
    assert _resident_bytes(int(data.ctypes.data), size) == size
    assert (data[100 : 100 + 3 * mmap.PAGESIZE] == 9).all() and not data[100 + 3 * mmap.PAGESIZE :].any()
    del data
    region.close()


def test_a_workers_pool_is_made_at_once_only_when_asked():
    torch = pytest.importorskip("torch")
    from kvstore.model import PagedKVPool, load_model

    model, _ = load_model("tiny")
    lazy, made = PagedKVPool(model.config, 64), PagedKVPool(model.config, 64, prefault=True)
    for pool, expected in ((lazy, 0), (made, pool_bytes(made))):
        assert _resident_bytes(pool.kv.data_ptr(), pool_bytes(pool)) >= expected
    assert _resident_bytes(lazy.kv.data_ptr(), pool_bytes(lazy)) < pool_bytes(lazy)
    assert not made.kv.any() and torch.equal(lazy.kv, made.kv)  # zeroed either way


def pool_bytes(pool) -> int:
    return pool.kv.numel() * pool.kv.element_size()


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
