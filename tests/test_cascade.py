"""The tier cascade through a real server: DRAM -> NVMe demotion, promotion, recovery, faults."""

from __future__ import annotations

import random
import threading

import grpc
import pytest

from kvstore.client import Client, KVStoreError
from kvstore.config import ServeConfig
from kvstore.hashing import block_hashes
from kvstore.server.app import StoreServer, build_store
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.nvme import NvmeTier, PosixBackend
from kvstore.tiers.nvme.faults import InstrumentedBackend


def payload(key: bytes, size: int) -> bytes:
    return (key * (size // 16 + 1))[:size]


def nvme_server(make_server, tmp_path, **kw):
    return make_server(dram=8 << 20, nvme_dir=str(tmp_path / "nvme"), nvme=256 << 20, nvme_segment=16 << 20, **kw)


def test_round_trip_through_nvme(make_server, tmp_path):
    server = nvme_server(make_server, tmp_path)
    keys = block_hashes(list(range(16 * 96)), 16, "ns", "m")  # 96 x 256 KiB = 24 MiB through an 8 MiB DRAM tier
    data = [payload(k, 256 << 10) for k in keys]
    with Client(f"127.0.0.1:{server.port}") as kv:
        for i in range(0, 96, 16):
            assert all(
                r.ok for r in kv.put("ns", keys[i : i + 16], data[i : i + 16], parent=keys[i - 1] if i else None)
            )
        n, tiers = kv.lookup_tiers("ns", keys)
        assert n == 96 and "nvme" in tiers and "dram" in tiers
        got = kv.get("ns", keys)
        assert all(bytes(g) == d for g, d in zip(got, data))
        stats = kv.stats()
    nvme = next(t for t in stats["tiers"] if t["name"] == "nvme")
    assert nvme["used_bytes"] > 0 and nvme["hits"] > 0
    server.store.check_invariants()


def test_acknowledged_blocks_survive_kill9(spawn_server, tmp_path):
    """Write-through: a Put is acked once its blocks are on NVMe; kill -9 mid-burst loses none of them."""
    args = (
        "--dram",
        "16MiB",
        "--nvme-dir",
        str(tmp_path / "d"),
        "--nvme",
        "512MiB",
        "--nvme-segment",
        "32MiB",
        "--write-policy",
        "write-through",
    )
    proc = spawn_server(*args)
    acked: list[tuple[bytes, bytes]] = []
    stop = threading.Event()

    def writer():
        rng = random.Random(1)
        with Client(proc.target, retries=0, timeout=10) as kv:
            while not stop.is_set():
                keys = [rng.randbytes(16) for _ in range(8)]
                data = [rng.randbytes(rng.choice([64 << 10, 200 << 10])) for _ in keys]
                try:
                    results = kv.put("ns", keys, data, chained=False)
                except KVStoreError:
                    return
                acked.extend((k, d) for k, d, r in zip(keys, data, results) if r.status == "stored")

    thread = threading.Thread(target=writer)
    thread.start()
    while len(acked) < 80:
        threading.Event().wait(0.05)
    proc.kill9()
    stop.set()
    thread.join()
    proc2 = spawn_server(*args)
    with Client(proc2.target) as kv:
        got = kv.get("ns", [k for k, _ in acked], allow_missing=True)
    missing = sum(g is None for g in got)
    assert missing == 0, f"{missing} acknowledged blocks lost"
    assert all(bytes(g) == d for g, (_, d) in zip(got, acked))


def test_write_back_flushes_on_graceful_shutdown(make_server, tmp_path):
    cfg = dict(dram=64 << 20, nvme_dir=str(tmp_path / "wb"), nvme=128 << 20, nvme_segment=16 << 20)
    server = make_server(**cfg)
    keys = block_hashes(list(range(16 * 8)), 16, "ns", "m")
    with Client(f"127.0.0.1:{server.port}") as kv:
        kv.put("ns", keys, [payload(k, 100_000) for k in keys])
    server.stop(0)
    again = make_server(**cfg)
    with Client(f"127.0.0.1:{again.port}") as kv:
        n, tiers = kv.lookup_tiers("ns", keys)
        assert n == 8 and set(tiers) == {"nvme"}
        assert all(bytes(g) == payload(k, 100_000) for g, k in zip(kv.get("ns", keys), keys))


def test_corrupt_record_is_reported_not_served(make_server, tmp_path):
    server = nvme_server(make_server, tmp_path, promote_on_hit=False)
    keys = block_hashes(list(range(16 * 64)), 16, "ns", "m")
    with Client(f"127.0.0.1:{server.port}") as kv:
        assert all(r.ok for r in kv.put("ns", keys, [payload(k, 256 << 10) for k in keys]))
        server.store.flush()
        n, tiers = kv.lookup_tiers("ns", keys)
        assert n == 64, (n, server.store.stats())
        cold = [k for k, t in zip(keys, tiers) if t == "nvme"]
        victim = cold[0]
        needle = payload(victim, 256 << 10)[:4096]
        for seg in sorted((tmp_path / "nvme").glob("seg-*.log")):
            raw = seg.read_bytes()
            at = raw.find(needle)
            if at >= 0:
                with open(seg, "r+b") as f:  # flip one byte of the payload on disk
                    f.seek(at + 100)
                    f.write(bytes([raw[at + 100] ^ 0xFF]))
                break
        else:
            raise AssertionError("victim's record not found on disk")
        with pytest.raises(KVStoreError) as err:
            kv.get("ns", [victim])
        assert err.value.code == grpc.StatusCode.DATA_LOSS
        assert kv.lookup("ns", [victim]) == 0  # dropped from the index
        assert kv.stats()["counters"]["corrupt"] >= 1


def test_enospc_degrades_and_dram_keeps_serving(tmp_path):
    backend = InstrumentedBackend(PosixBackend())
    tiers = [
        ArenaTier(8 << 20, page_size=8 << 20),
        NvmeTier(tmp_path / "full", 64 << 20, segment_bytes=8 << 20, backend=backend, probe_interval_s=60),
    ]
    cfg = ServeConfig(listen="127.0.0.1:0", metrics_port=0, dram=8 << 20)
    server = StoreServer(cfg, store=build_store(cfg, tiers)).start()
    try:
        backend.fail_writes_after(4 << 20)
        keys = block_hashes(list(range(16 * 64)), 16, "ns", "m")
        data = [payload(k, 256 << 10) for k in keys]
        with Client(f"127.0.0.1:{server.port}") as kv:
            for i in range(0, 64, 8):
                results = kv.put("ns", keys[i : i + 8], data[i : i + 8], parent=keys[i - 1] if i else None)
                assert all(r.ok for r in results)
            stats = kv.stats()
            nvme = next(t for t in stats["tiers"] if t["name"] == "nvme")
            assert nvme["degraded"] and "No space" in nvme["fault"]
            n, tiers = kv.lookup_tiers("ns", keys)
            assert n > 0
            got = kv.get("ns", keys[:n])
            assert all(bytes(g) == d for g, d in zip(got, data))
            # the store keeps taking and serving blocks from DRAM while the disk is full
            fresh = block_hashes(list(range(1000, 1000 + 16 * 4)), 16, "ns", "m")
            assert all(r.ok for r in kv.put("ns", fresh, [payload(k, 256 << 10) for k in fresh]))
            assert all(bytes(g) == payload(k, 256 << 10) for g, k in zip(kv.get("ns", fresh), fresh))
    finally:
        server.stop(0)


# -- NVMe admission ------------------------------------------------------------------------------------------
def put_blocks(store, keys, size):
    from kvstore.checksum import crc32c
    from kvstore.tiers.base import BlockMeta

    for k in keys:
        data = payload(k, size)
        ticket = store.begin_put("ns", BlockMeta("ns", k, b"", 0, "uint8", size, size, crc32c(data)))
        if ticket is not None:
            ticket.buffer[:] = data
            store.commit_put(ticket)


def test_a_gets_promotions_are_one_dram_copy_each_and_keep_the_chain(tmp_path):
    """A Get's NVMe-only blocks are promoted in one batch at its release: a block the Get names twice gets one
    DRAM copy (the other slot is freed), parents and children promoted together keep the leaf structure, and a
    block deleted while the Get held it is not promoted."""
    from kvstore.checksum import crc32c
    from kvstore.store import BlockStore
    from kvstore.tiers.base import BlockMeta

    size = 256 << 10
    store = BlockStore(
        [ArenaTier(8 << 20, page_size=1 << 20), NvmeTier(tmp_path / "n", 64 << 20, segment_bytes=8 << 20)]
    )
    keys = block_hashes(list(range(16 * 6)), 16, "ns", "chain")
    for parent, k in zip([b""] + keys[:-1], keys):
        data = payload(k, size)
        ticket = store.begin_put("ns", BlockMeta("ns", k, parent, 0, "uint8", size, size, crc32c(data)))
        assert ticket is not None
        ticket.buffer[:] = data
        store.commit_put(ticket)
    for _ in keys:  # leaf first: each round demotes the chain's last block in DRAM
        store._evict(store.top, store.top.used_bytes)  # noqa: SLF001 - as demotion does
    assert set(store.lookup("ns", keys)[1]) == {store.tiers[1].rank}
    leases = store.acquire("ns", keys + keys[:2])
    store.materialize(leases)
    assert all(bytes(x.buffer[:size]) == payload(k, size) for x, k in zip(leases, keys + keys[:2]))
    store.delete("ns", keys[5:])
    store.release(leases)
    n, ranks = store.lookup("ns", keys)
    assert n == 5 and set(ranks) == {store.top.rank}
    assert store.top.used_bytes == 5 * size
    assert next(t for t in store.stats()["tiers"] if t["name"] == "dram")["promotions"] == 5
    store.check_invariants()
    store.close()


def test_nvme_admission_demotes_reused_blocks_and_drops_the_rest(tmp_path):
    from kvstore.store import BlockStore
    from kvstore.store.policies import policy_factory

    size = 256 << 10
    store = BlockStore(
        [ArenaTier(8 << 20, page_size=1 << 20), NvmeTier(tmp_path / "n", 64 << 20, segment_bytes=8 << 20)],
        policy_factory=policy_factory("freq"),
        nvme_admit_uses=2,
    )
    reused = block_hashes(list(range(16 * 8)), 16, "ns", "reused")
    once = block_hashes(list(range(16 * 8)), 16, "ns", "once")
    put_blocks(store, reused + once, size)
    store.release(store.acquire("ns", reused))  # a second use of each reused block
    store._evict(store.top, store.top.used_bytes)  # everything leaves DRAM
    n, ranks = store.lookup("ns", reused)
    assert n == 8 and set(ranks) == {store.tiers[1].rank}  # demoted: all on NVMe
    assert all(store.lookup("ns", [k])[0] == 0 for k in once)  # used once: dropped, not written to disk
    dram = next(t for t in store.stats()["tiers"] if t["name"] == "dram")
    assert dram["not_admitted"] == 8 and dram["demotions"] == 8
    leases = store.acquire("ns", reused)
    try:
        store.materialize(leases)
        assert all(bytes(lease.buffer[:size]) == payload(k, size) for lease, k in zip(leases, reused))
    finally:
        store.release(leases)
    store.check_invariants()
    store.close()


def test_nvme_admission_never_drops_at_a_graceful_stop(tmp_path):
    # write-back: a stop flushes every memory-only block to NVMe, used once or not
    from kvstore.store import BlockStore
    from kvstore.store.policies import policy_factory

    def open_store():
        return BlockStore(
            [ArenaTier(8 << 20, page_size=1 << 20), NvmeTier(tmp_path / "n", 64 << 20, segment_bytes=8 << 20)],
            policy_factory=policy_factory("freq"),
            nvme_admit_uses=3,
        )

    keys = block_hashes(list(range(16 * 6)), 16, "ns", "once")
    store = open_store()
    put_blocks(store, keys, 100_000)
    store.close(flush=True)
    again = open_store()
    assert again.lookup("ns", keys)[0] == 6
    again.close()


def test_nvme_admission_needs_a_policy_that_counts_uses(tmp_path):
    from kvstore import config
    from kvstore.store import BlockStore

    with pytest.raises(ValueError, match="counts uses"):
        BlockStore([ArenaTier(1 << 20, page_size=1 << 20)], nvme_admit_uses=2)  # the default policy factory: lru
    with pytest.raises(ValueError, match="--eviction-policy adaptive or freq"):
        config.load(env={"KVSTORE_NVME_ADMIT_USES": "2", "KVSTORE_EVICTION_POLICY": "lru"})
    with pytest.raises(ValueError, match="1 or more"):
        config.load(env={"KVSTORE_NVME_ADMIT_USES": "0"})
    assert config.load(env={"KVSTORE_NVME_ADMIT_USES": "2", "KVSTORE_NVME_DIR": "/nvme"}).nvme_admit_uses == 2


def test_a_put_never_waits_for_a_running_compaction(tmp_path):
    """A Put that makes room holds the store's lock and may find NVMe full; a background compaction meanwhile
    holds the compaction lock and needs the store's lock to report its moves. Waiting for that compaction
    deadlocked the store (found by bench.vllm_pd: Puts and the shutdown hung for good)."""
    from kvstore.store import BlockStore

    size = 256 << 10
    nvme = NvmeTier(tmp_path / "n", 16 << 20, segment_bytes=2 << 20)
    store = BlockStore([ArenaTier(4 << 20, page_size=1 << 20), nvme])
    nvme.on_relocate = lambda moves: store.relocate(nvme.rank, moves)
    keys = block_hashes(list(range(16 * 80)), 16, "ns", "fill")
    put_blocks(store, keys[:70], size)  # DRAM and NVMe both full
    compacting, done = threading.Event(), threading.Event()

    def background_compaction() -> None:  # what compact_once does: the lock, then a relocation report
        with nvme._compact_lock:
            compacting.set()
            done.wait(30)
            store.relocate(nvme.rank, [])

    def more_puts() -> None:
        put_blocks(store, keys[70:], size)  # every one needs room on NVMe
        done.set()

    bg = threading.Thread(target=background_compaction, daemon=True)
    bg.start()
    assert compacting.wait(10)
    writer = threading.Thread(target=more_puts, daemon=True)
    writer.start()
    writer.join(30)
    assert not writer.is_alive(), "the Put waited for the compaction holding the store's lock"
    bg.join(30)
    assert not bg.is_alive()
    store.check_invariants()
    store.close()


def test_a_chain_copied_down_in_one_batch_keeps_one_copy_each_and_its_leaves(tmp_path):
    """Write-through copies a Put's blocks to NVMe and adds the copies in one batch: a chain keeps its leaf
    structure in the NVMe tier (only the last block a leaf), and a block named twice gets one copy (the other
    record is freed)."""
    from kvstore.checksum import crc32c
    from kvstore.store import BlockStore
    from kvstore.store.index import NO_LOC
    from kvstore.tiers.base import BlockMeta

    size = 64 << 10
    nvme = NvmeTier(tmp_path / "n", 64 << 20, segment_bytes=8 << 20)
    store = BlockStore([ArenaTier(8 << 20, page_size=1 << 20), nvme], write_through=True)
    keys = block_hashes(list(range(16 * 8)), 16, "ns", "wt")
    entries = []
    for parent, k in zip([b""] + keys[:-1], keys):
        data = payload(k, size)
        ticket = store.begin_put("ns", BlockMeta("ns", k, parent, 0, "uint8", size, size, crc32c(data)))
        assert ticket is not None
        ticket.buffer[:] = data
        entries.append(store.commit_put(ticket)[1])
    store.persist(entries + entries[:1])
    t = store.table
    assert all(t.loc_of(e, nvme.rank) != NO_LOC for e in entries)
    assert [bool(t.nchild[e, nvme.rank] == 0) for e in entries] == [False] * 7 + [True]
    assert nvme.stats().used_bytes == 8 * (size + 4096)  # the second record of entries[0] was freed
    store.check_invariants()
    store.close(flush=False)
