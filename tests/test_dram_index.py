"""The shared DRAM arena's index (``serve --share-dram``, ``kvstore/arena_index.py``): clients find DRAM hits
and copy them without asking the store.

The table alone (property tests against a dict, the compiled and the numpy probe and writes, the seqlock), then real
in-process servers and shm clients: a Get served from the index returns the stored bytes and reports its hits
to the store afterwards (counted, and the grants of the last asked Get given back); deleted, evicted and
rewritten blocks are never served from it; a corrupt block is DATA_LOSS; a namespace the store has not served
this lane is asked of the store; and Gets racing deletes and rewrites never return other bytes.
"""

from __future__ import annotations

import os
import threading
import time

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import arena_index
from kvstore.arena_index import WAYS, ArenaIndex, ArenaIndexView, keys_of
from kvstore.client import Client, KVStoreError
from kvstore.tiers.arena import ArenaTier

MiB = 1 << 20
KiB = 1 << 10

pytestmark = pytest.mark.skipif(not arena_index.supported(), reason="the index is built on x86-64 only")


def hashes(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(16) for _ in range(n)]


def new_index(tmp_path, arena_bytes: int = 64 * MiB) -> tuple[ArenaIndex, ArenaIndexView]:
    index = ArenaIndex.create(str(tmp_path), arena_bytes)
    view = ArenaIndexView(np.frombuffer(index._region, dtype=np.uint64))  # noqa: SLF001 - the same memory
    return index, view


def publish(index: ArenaIndex, ns: str, hs: list[bytes], offsets: list[int], length: int = 4096) -> int:
    keys = keys_of(ns, hs)
    assert keys is not None
    n = len(hs)
    return index.publish_many(
        keys, np.array(offsets, dtype=np.uint64), np.full(n, length), np.arange(n, dtype=np.uint64) + 7
    )


@pytest.mark.parametrize("compiled", [True, False])
@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 63)), max_size=120))
def test_the_table_names_exactly_what_was_published(tmp_path_factory, compiled, ops):
    if compiled:
        arena_index.warm_up()
    index, view = new_index(tmp_path_factory.mktemp("idx"))
    pool = hashes(64, seed=1)
    model: dict[bytes, int] = {}
    for add, k in ops:
        if add:
            publish(index, "ns", [pool[k]], [k * 4096])
            model[pool[k]] = k * 4096
        else:
            keys = keys_of("ns", [pool[k]])
            assert keys is not None
            index.withdraw_many(keys)
            model.pop(pool[k], None)
    assert len(index) == len(model)
    original = arena_index.ready
    arena_index.ready = lambda: compiled  # take the path under test
    try:
        for h in pool:
            found = view.find("ns", [h])
            assert (found is not None) == (h in model)
            if found is not None:
                assert found.offsets == [model[h]] and found.lengths == [4096] and found.unchanged()
            assert view.find("other-ns", [h]) is None  # namespaces are separate keys
        present = [h for h in pool if h in model]
        if present:
            found = view.find("ns", present)
            assert found is not None and found.offsets == [model[h] for h in present]
    finally:
        arena_index.ready = original
    index.close()


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_a_batch_publishes_as_its_keys_one_by_one(tmp_path_factory, data):
    """Batches of new keys (sharing buckets: 64 buckets of 8 ways, so full ones too), of keys named before,
    withdrawn or not, and of a key twice leave the table, its seqs and counts as publishing or withdrawing
    their keys one call each, in order, does."""
    pool = hashes(2048, seed=3)
    batched, _ = new_index(tmp_path_factory.mktemp("batched"), 0)
    single, _ = new_index(tmp_path_factory.mktemp("single"), 0)
    assert batched.buckets == 64
    fresh = 0
    for _ in range(data.draw(st.integers(1, 12))):
        kind = data.draw(st.sampled_from(["new", "again", "withdraw"]))
        size = data.draw(st.integers(1, 48))
        if kind == "new" or not fresh:
            picks = list(range(fresh, min(fresh + size, len(pool))))
            fresh = picks[-1] + 1 if picks else fresh
        else:
            picks = data.draw(st.lists(st.integers(0, fresh - 1), min_size=1, max_size=size))
        if not picks:
            continue
        keys = keys_of("ns", [pool[k] for k in picks])
        assert keys is not None
        offsets = np.array(picks, dtype=np.uint64) * 4096
        if kind != "withdraw":
            n = batched.publish_many(keys, offsets, np.full(len(picks), 4096), offsets + 7)
            one = [single.publish_many(keys[i : i + 1], offsets[i : i + 1], np.full(1, 4096), offsets[i : i + 1] + 7)
                   for i in range(len(picks))]  # fmt: skip
            assert n == sum(one)
        else:
            batched.withdraw_many(keys)
            for i in range(len(picks)):
                single.withdraw_many(keys[i : i + 1])
        assert np.array_equal(batched._entries, single._entries)  # noqa: SLF001 - the very words, seqs included
        assert (batched.published, batched.full, len(batched)) == (single.published, single.full, len(single))
    batched.close()
    single.close()


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_the_compiled_writes_leave_the_words_numpy_calls_leave(tmp_path_factory, data):
    """Publishes of new keys, of keys named before (rewritten in their way) and of a key twice in a batch, into
    buckets that fill up, and withdrawals of named and absent keys leave the very same words, seqs included, and
    counts whether they ran compiled or as numpy calls."""
    if not arena_index.AVAILABLE:
        pytest.skip("numba is not installed: only the numpy writes run")
    arena_index.warm_up()
    pool = hashes(1024, seed=4)
    tables = {path: new_index(tmp_path_factory.mktemp(f"w{path}"), 0)[0] for path in (True, False)}
    original = arena_index.ready
    try:
        for _ in range(data.draw(st.integers(1, 10))):
            picks = data.draw(st.lists(st.integers(0, len(pool) - 1), min_size=1, max_size=64))
            keys = keys_of("ns", [pool[k] for k in picks])
            assert keys is not None
            offsets = np.array(picks, dtype=np.uint64) * 4096
            publishing = data.draw(st.booleans())
            written = []
            for compiled, index in tables.items():
                arena_index.ready = lambda compiled=compiled: compiled  # type: ignore[misc]
                if publishing:
                    written.append(index.publish_many(keys, offsets, np.full(len(picks), 4096), offsets + 7))
                else:
                    index.withdraw_many(keys)
            assert len(set(written)) <= 1
            fast, slow = tables[True], tables[False]
            assert np.array_equal(fast._entries, slow._entries)  # noqa: SLF001 - the very words
            assert (fast.published, fast.full, len(fast)) == (slow.published, slow.full, len(slow))
            assert len(fast) == int(np.count_nonzero(fast._entries[:, 1:3].any(axis=1)))  # noqa: SLF001
    finally:
        arena_index.ready = original
        for index in tables.values():
            index.close()


@pytest.mark.parametrize("compiled", [True, False])
def test_a_copy_taken_for_stable_racing_the_writes_holds_what_its_entry_names(tmp_path, compiled):
    """The protocol end to end, on the table alone: a writer withdraws keys, rewrites their slots (each stamped
    with the write's version) and names them again, as fast as it can; a reader finds a key, copies its slot,
    then checks ``unchanged``. Every copy the reader keeps holds the version its entry names: the entry moved
    before its slot was written again. The compiled writes release the GIL, so both run at once here."""
    if compiled and not arena_index.AVAILABLE:
        pytest.skip("numba is not installed")
    if compiled:
        arena_index.warm_up()
    index, view = new_index(tmp_path, 0)
    pool = hashes(16, seed=5)
    keys = keys_of("ns", pool)
    assert keys is not None
    slots = np.zeros((len(pool), 16 << 10), dtype=np.uint32)  # 64 KiB a block, stamped with its version
    original = arena_index.ready
    arena_index.ready = lambda: compiled  # both sides on the path under test
    stop = threading.Event()
    wrong: list[tuple[int, int, int]] = []

    def write() -> None:
        version = 0
        while not stop.is_set():
            version += 1
            picks = np.arange(version % 2, len(pool), 2)
            index.withdraw_many(keys[picks])
            slots[picks] = version  # only once nobody can take the old entries for stable
            offsets = picks.astype(np.uint64) * np.uint64(1 << 16) + np.uint64(version << 32)
            index.publish_many(keys[picks], offsets, np.full(len(picks), 4096), picks.astype(np.uint64))
            if version % 4 == 0:
                time.sleep(1e-4)  # a gap now and then: on a loaded machine a writer that never stops starves the reader

    writer = threading.Thread(target=write)
    writer.start()
    kept = moved = 0
    try:
        start = time.monotonic()
        # at least a second of racing, then until enough copies were kept (a loaded CI machine is slow to get there)
        while time.monotonic() - start < 1.0 or (kept < 200 and time.monotonic() - start < 30.0):
            for k, h in enumerate(pool):
                found = view.find("ns", [h])
                if found is None:
                    continue
                copy = slots[k].copy()
                if not found.unchanged():
                    moved += 1
                    continue
                kept += 1
                named = found.offsets[0] >> 32
                if found.offsets[0] & 0xFFFFFFFF != k << 16 or not (copy == named).all():
                    wrong.append((k, named, int(copy[0])))
    finally:
        stop.set()
        writer.join()
        arena_index.ready = original
        index.close()
    assert kept >= 200 and moved > 0 and not wrong, (kept, moved, wrong[:3])


def test_a_full_bucket_publishes_nothing_more(tmp_path):
    index, view = new_index(tmp_path)
    mask = index.buckets - 1
    same: list[bytes] = []
    for h in hashes(20_000, seed=2):  # keys that fall into bucket 0
        keys = keys_of("ns", [h])
        assert keys is not None
        if int(keys[0, 0]) & mask == 0:
            same.append(h)
        if len(same) == WAYS + 2:
            break
    assert publish(index, "ns", same, list(range(0, len(same) * 4096, 4096))) == WAYS
    assert index.full == 2
    assert view.find("ns", same[:WAYS]) is not None and view.find("ns", same[WAYS:]) is None


def test_an_entry_that_changes_after_find_is_caught(tmp_path):
    index, view = new_index(tmp_path)
    hs = hashes(4)
    publish(index, "ns", hs, [0, 4096, 8192, 12288])
    found = view.find("ns", hs)
    assert found is not None and found.unchanged()
    keys = keys_of("ns", hs[2:3])
    assert keys is not None
    index.withdraw_many(keys)
    publish(index, "ns", hs[2:3], [8192])  # back where it was: still another seq
    assert not found.unchanged()
    again = view.find("ns", hs)
    assert again is not None and again.unchanged()


# -- through a store --------------------------------------------------------------------------------------
def blocks(n: int, size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def lane_of(kv: Client):
    return kv._lanes.run(lambda lane: lane)  # noqa: SLF001 - the shm lane the client opened


def arena_of(server) -> ArenaTier:
    return next(t for t in server.store.tiers if isinstance(t, ArenaTier) and t.shared is not None)


def settle(check, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(check())


@pytest.fixture
def server(make_server):
    return make_server(share_dram=True, dram=64 * MiB)


def test_dram_hits_are_served_from_the_index_and_reported(server):
    arena_index.warm_up()
    data = blocks(32, 64 * KiB)
    hs = hashes(32)
    with Client(f"127.0.0.1:{server.port}", lane="shm", timeout=30) as kv:
        kv.put("ns", hs, data)
        out = [np.zeros(64 * KiB, np.uint8) for _ in data]
        kv.get("ns", hs, out=out)  # asked: the store serves the namespace to this lane
        lane = lane_of(kv)
        assert lane.indexed is not None and lane.indexed.hits == 0
        assert settle(lambda: int(server.store.table.leases.sum()) == 32)  # the asked Get's pins
        for o in out:
            o[:] = 0
        got = kv.get("ns", hs, out=out)
        assert all(g is o for g, o in zip(got, out))
        assert all(np.array_equal(a, b) for a, b in zip(out, data))
        assert lane.indexed.hits == 32
        # the TOUCH frame gave back the asked Get's grant, and reports hits once enough are pending
        assert settle(lambda: int(server.store.table.leases.sum()) == 0)
        hits_before = server.store.counters.tiers[arena_of(server).rank].hits
        for _ in range(8):
            kv.get("ns", hs, out=out)
        assert settle(lambda: server.metrics.counters().get("lane_shm_index_hits", 0) >= 256)
        assert server.store.counters.tiers[arena_of(server).rank].hits >= hits_before + 256


def test_deleted_and_evicted_blocks_are_never_served_from_the_index(make_server):
    server = make_server(share_dram=True, dram=64 * MiB, eviction_policy="lru")  # evicts what the test expects
    data = blocks(8, MiB)
    hs = hashes(8, seed=3)
    with Client(f"127.0.0.1:{server.port}", lane="shm", timeout=30) as kv:
        kv.put("ns", hs, data)
        out = [np.zeros(MiB, np.uint8) for _ in data]
        kv.get("ns", hs, out=out)
        kv.get("ns", hs, out=out)
        lane = lane_of(kv)
        served = lane.indexed.hits
        assert served == 8
        kv.delete("ns", hs[:1])
        with pytest.raises(KVStoreError) as err:
            kv.get("ns", hs, out=out)
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        # fill DRAM (64 MiB, no NVMe) many times over: the first blocks are evicted and their slots reused
        for round_ in range(4):
            kv.put("ns", hashes(24, seed=10 + round_), blocks(24, MiB, seed=10 + round_))
        assert kv.lookup("ns", hs[1:]) == 0
        got = kv.get("ns", hs[1:], out=out[1:], allow_missing=True)
        for g, o, d in zip(got, out[1:], data[1:]):
            assert g is None or (g is o and np.array_equal(o, d))
        assert lane.indexed.hits == served  # none of those came from the index


def test_a_corrupt_block_read_through_the_index_is_data_loss(server):
    data = blocks(3, MiB)
    hs = hashes(3, seed=4)
    with Client(f"127.0.0.1:{server.port}", lane="shm", timeout=30) as kv:
        kv.put("ns", hs, data)
        out = [np.zeros(MiB, np.uint8) for _ in data]
        kv.get("ns", hs, out=out)
        arena = arena_of(server)
        view = np.frombuffer(arena.view(0, arena.capacity_bytes), dtype=np.uint8)
        at = np.flatnonzero(view[: 4 * MiB] != 0)[0]
        view[at] ^= 0xFF
        with pytest.raises(KVStoreError) as err:
            kv.get("ns", hs, out=out)
        assert err.value.code == grpc.StatusCode.DATA_LOSS
        assert lane_of(kv).indexed.hits == 0
        view[at] ^= 0xFF
        kv.get("ns", hs, out=out)
        assert all(np.array_equal(a, b) for a, b in zip(out, data))


def test_a_namespace_is_read_through_the_index_only_after_the_store_served_it(make_server, tmp_path):
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(
        "tenants:\n"
        "  - {name: a, token: token-a-0123456789abcdef, namespaces: [team-a]}\n"
        "  - {name: b, token: token-b-0123456789abcdef, namespaces: [team-b]}\n"
    )
    server = make_server(share_dram=True, dram=64 * MiB, tenants=str(tenants))
    data = blocks(4, 64 * KiB)
    hs = hashes(4, seed=5)
    with Client(f"127.0.0.1:{server.port}", lane="shm", timeout=30, token="token-a-0123456789abcdef") as a:
        a.put("team-a", hs, data)
        out = [np.zeros(64 * KiB, np.uint8) for _ in data]
        a.get("team-a", hs, out=out)
        a.get("team-a", hs, out=out)
        assert lane_of(a).indexed.hits == 4
    with Client(f"127.0.0.1:{server.port}", lane="shm", timeout=30, token="token-b-0123456789abcdef") as b:
        for _ in range(2):  # the index names team-a's blocks, but this lane is never served team-a
            with pytest.raises(KVStoreError) as err:
                b.get("team-a", hs, out=out)
            assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert lane_of(b).indexed.hits == 0


def test_a_block_withdrawn_while_it_is_copied_is_asked_of_the_store(server, monkeypatch):
    from kvstore.lanes.client import indexed

    data = blocks(4, 64 * KiB)
    hs = hashes(4, seed=7)
    with Client(f"127.0.0.1:{server.port}", lane="shm", timeout=30) as kv:
        kv.put("ns", hs, data)
        out = [np.zeros(64 * KiB, np.uint8) for _ in data]
        kv.get("ns", hs, out=out)
        kv.get("ns", hs, out=out)
        served = lane_of(kv).indexed.hits
        real = indexed.copy_outs

        def copy_then_delete(copies):  # the store drops a block between the client's find and its check
            crcs = real(copies)
            server.store.delete("ns", hs[2:3])
            return crcs

        monkeypatch.setattr(indexed, "copy_outs", copy_then_delete)
        with pytest.raises(KVStoreError) as err:
            kv.get("ns", hs, out=out)
        assert err.value.code == grpc.StatusCode.NOT_FOUND  # the store's answer, not the copied bytes
        assert lane_of(kv).indexed.hits == served


def test_gets_racing_deletes_and_rewrites_return_the_stored_bytes_or_nothing(server):
    size = 256 * KiB
    hs = hashes(16, seed=6)
    data = blocks(16, size, seed=6)
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            with Client(f"127.0.0.1:{server.port}", lane="shm", timeout=30) as w:
                k = 0
                while not stop.is_set():
                    w.delete("ns", hs[k % 16 : k % 16 + 1])
                    w.put("ns", hs, data)  # the deleted one comes back, in some slot
                    w.put("ns", hashes(8, seed=100 + k), blocks(8, size, seed=100 + k))  # slots get reused
                    k += 1
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    with Client(f"127.0.0.1:{server.port}", lane="shm", timeout=30) as kv:
        kv.put("ns", hs, data)
        out = [np.zeros(size, np.uint8) for _ in hs]
        kv.get("ns", hs, out=out)
        writer = threading.Thread(target=churn)
        writer.start()
        try:
            start = time.monotonic()
            # two seconds of racing, then on until the index has served a hit (a loaded CI machine gets few Gets in)
            while time.monotonic() - start < 2.0 or (lane_of(kv).indexed.hits == 0 and time.monotonic() - start < 30.0):
                for o in out:
                    o[:] = 0
                got = kv.get("ns", hs, out=out, allow_missing=True)
                for g, o, d in zip(got, out, data):
                    assert g is None or np.array_equal(o, d)
        finally:
            stop.set()
            writer.join(30)
        assert not errors
        assert lane_of(kv).indexed.hits > 0


def test_a_store_without_the_index_serves_as_before(make_server):
    server = make_server(share_dram=True, dram_index=False)
    assert arena_of(server).index is None and arena_of(server).shared.index_path == ""  # type: ignore[union-attr]
    with Client(f"127.0.0.1:{server.port}", lane="shm", timeout=30) as kv:
        kv.put("ns", hashes(2), blocks(2, 4096))
        out = [np.zeros(4096, np.uint8) for _ in range(2)]
        kv.get("ns", hashes(2), out=out)
        assert lane_of(kv).indexed is None


def test_the_index_file_goes_with_the_store(make_server):
    server = make_server(share_dram=True)
    path = arena_of(server).shared.index_path  # type: ignore[union-attr]
    assert path and os.stat(path).st_mode & 0o777 == 0o600
    server.stop(0)
    server.store.close()
    assert not os.path.exists(path)


def test_a_store_that_is_gone_is_not_read_through_its_index(server):
    """The client still maps a stopped store's arena and index (unlinked, not unmapped): nothing may be served
    from them. The lane's channel tells it the store is gone, and the Get is asked, and fails."""
    data = blocks(4, 64 * KiB)
    hs = hashes(4, seed=8)
    with Client(f"127.0.0.1:{server.port}", lane="shm", timeout=5, retries=0) as kv:
        kv.put("ns", hs, data)
        out = [np.zeros(64 * KiB, np.uint8) for _ in data]
        kv.get("ns", hs, out=out)
        kv.get("ns", hs, out=out)
        assert lane_of(kv).indexed.hits == 4
        server.stop(0)
        with pytest.raises(KVStoreError) as err:
            kv.get("ns", hs, out=out)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_killed_store_process_is_not_read_through_its_index(short_dir):
    import signal

    from kvstore.server.process import store_process

    data = blocks(4, 64 * KiB)
    hs = hashes(4, seed=9)
    with store_process("--dram", "64MiB", "--shm-dir", str(short_dir), "--share-dram", "true") as (target, proc):
        with Client(target, lane="shm", timeout=5, retries=0) as kv:
            kv.put("ns", hs, data)
            out = [np.zeros(64 * KiB, np.uint8) for _ in data]
            kv.get("ns", hs, out=out)
            kv.get("ns", hs, out=out)
            assert lane_of(kv).indexed.hits == 4
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            with pytest.raises(KVStoreError) as err:
                kv.get("ns", hs, out=out)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            assert kv._lanes._idle == []  # noqa: SLF001 - the broken lane (and its stale mappings) is gone
