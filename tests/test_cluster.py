"""Cluster mode end to end on one real redis-server: three store nodes, two clients, failures."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import redis

from kvstore.cli import main as cli_main
from kvstore.client import Client, KVStoreError
from kvstore.cluster.client import ClusterClient
from kvstore.cluster.keys import KeyLayout
from kvstore.cluster.localredis import LocalRedis, RedisNotAvailable
from kvstore.cluster.membership import read_members
from kvstore.server.app import StoreServer

TTL = 2.0
SETTLE_S = 1.0  # a block put this long ago is indexed: publishing lags a loaded host's Puts by less
BLOCK = 64 << 10


def wait_until(pred: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
def local_redis() -> Iterator[LocalRedis]:
    try:
        server = LocalRedis().start()
    except RedisNotAvailable as err:
        pytest.skip(f"cannot start redis-server: {err}")
    yield server
    server.close()


def chain(n: int) -> tuple[list[bytes], list[bytes]]:
    return [os.urandom(16) for _ in range(n)], [os.urandom(BLOCK) for _ in range(n)]


def members(url: str) -> list[str]:
    r = redis.Redis.from_url(url)
    try:
        return [m.id for m in read_members(r, KeyLayout())]
    finally:
        r.close()


def holder_of(servers: list[StoreServer], ns: str, hashes: list[bytes]) -> list[StoreServer]:
    return [s for s in servers if s.store.lookup(ns, hashes)[0] == len(hashes)]


def test_prefix_put_by_one_client_is_found_and_fetched_by_another(make_server, local_redis):
    servers = [make_server(redis=local_redis.url, cluster_ttl=TTL) for _ in range(3)]
    wait_until(lambda: len(members(local_redis.url)) == 3, what="3 members")
    chains = [chain(6) for _ in range(9)]
    with Client(local_redis.url, refresh=0.1) as a, Client(local_redis.url, refresh=0.1) as b:
        assert isinstance(a, ClusterClient)
        assert b.warm_up() == "cluster"  # the kernels now; each node's lane at its first use
        for hashes, data in chains:
            assert all(r.status == "stored" for r in a.put("ns", hashes, data))
        used = set()
        for hashes, _ in chains:
            holders = holder_of(servers, "ns", hashes)
            assert len(holders) == 1, "a prefix's blocks stay together on one node"
            used.add(holders[0].port)
        assert len(used) >= 2, "rendezvous spreads prefixes over the nodes"
        for hashes, data in chains:
            wait_until(lambda: b.lookup("ns", hashes) == 6, what="index published")
            assert b.lookup_tiers("ns", hashes + [os.urandom(16)]) == (6, ["dram"] * 6)
            assert [bytes(x) for x in b.get("ns", hashes)] == data
        # an extension put with its parent lands beside its prefix
        hashes, _ = chains[0]
        more, more_data = chain(3)
        a.put("ns", more, more_data, parent=hashes[-1])
        assert holder_of(servers, "ns", hashes) == holder_of(servers, "ns", more)
        wait_until(lambda: b.lookup("ns", hashes + more) == 9, what="extension published")
        for _ in range(5):  # chunked prefill: each chunk put right after the last, before the index lists it
            first, first_data = chain(2)
            second, second_data = chain(2)
            a.put("ns", first, first_data)
            a.put("ns", second, second_data, parent=first[-1])
            assert holder_of(servers, "ns", first) == holder_of(servers, "ns", second)
        # a miss anywhere is NOT_FOUND, or None with allow_missing
        unknown = os.urandom(16)
        with pytest.raises(KVStoreError) as err:
            b.get("ns", [hashes[0], unknown])
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        got = b.get("ns", [hashes[0], unknown], allow_missing=True)
        assert bytes(got[0]) == chains[0][1][0] and got[1] is None
        stats = b.stats()
        assert stats["redis_up"] and stats["blocks"] == 9 * 6 + 3 + 20 and len(stats["nodes"]) == 3
        assert stats["tiers"][0]["name"] == "dram" and stats["tiers"][0]["blocks"] == 9 * 6 + 3 + 20
        assert cli_main(["stats", "--target", local_redis.url]) == 0  # `kvstore stats` takes a cluster URL too
        assert b.delete("ns", more) == 3
        wait_until(lambda: b.lookup("ns", hashes + more) == 6, what="delete published")
    for s in servers:
        counters = s.metrics.counters()
        assert counters["redis_up"] == 1 and counters.get("cluster_index_publish_failures", 0) == 0


def test_graceful_stop_deregisters_and_requests_keep_succeeding(make_server, local_redis):
    servers = [make_server(redis=local_redis.url, cluster_ttl=TTL) for _ in range(3)]
    wait_until(lambda: len(members(local_redis.url)) == 3, what="3 members")
    chains = [chain(4) for _ in range(6)]
    with Client(local_redis.url, refresh=0.1) as kv:
        for hashes, data in chains:
            kv.put("ns", hashes, data)
        victim = holder_of(servers, "ns", chains[0][0])[0]
        lost = [h for h, _ in chains if holder_of([victim], "ns", h)]
        kept = [(h, d) for h, d in chains if not holder_of([victim], "ns", h)]
        wait_until(lambda: all(kv.lookup("ns", h) == 4 for h, _ in chains), what="all indexed")
        victim.stop(0)
        assert victim.cluster.node_id not in members(local_redis.url), "deregistered at once"
        for hashes in lost:
            assert kv.lookup("ns", hashes) == 0
            assert kv.get("ns", hashes, allow_missing=True) == [None] * 4
        for hashes, data in kept:
            assert [bytes(x) for x in kv.get("ns", hashes)] == data
        # new prefixes go to the survivors
        hashes, data = chain(4)
        assert all(r.ok for r in kv.put("ns", hashes, data))
        assert [bytes(x) for x in kv.get("ns", hashes)] == data


def test_redis_stopped_and_restarted_mid_run_fails_no_request(make_server, local_redis):
    servers = [make_server(redis=local_redis.url, cluster_ttl=TTL) for _ in range(3)]
    wait_until(lambda: len(members(local_redis.url)) == 3, what="3 members")
    failures: list[BaseException] = []
    done: list[tuple[float, list[bytes], list[bytes]]] = []
    short_lookups: list[float] = []
    stop = threading.Event()

    def traffic() -> None:
        with Client(local_redis.url, refresh=0.1, redis_timeout=0.5) as kv:
            while not stop.is_set():
                try:
                    hashes, data = chain(3)
                    results = kv.put("ns", hashes, data)
                    if not all(r.ok for r in results):
                        raise AssertionError(f"put rejected: {[r for r in results if not r.ok][0]}")
                    done.append((time.monotonic(), hashes, data))
                    _, old_h, old_d = done[len(done) // 2]
                    if [bytes(x) for x in kv.get("ns", old_h)] != old_d:
                        raise AssertionError("get returned other bytes")
                    settled = [h for t, h, _ in done if t < time.monotonic() - SETTLE_S]
                    if settled and kv.lookup("ns", settled[len(settled) // 2]) != 3:
                        short_lookups.append(time.monotonic())  # a hint lagging, not a failed request
                except BaseException as err:  # noqa: BLE001 (collected and re-raised by the test)
                    failures.append(err)
                    return

    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        wait_until(lambda: len(done) >= 10 or failures, what="traffic")
        local_redis.stop()
        wait_until(lambda: all(s.metrics.counters().get("redis_up") == 0 for s in servers), what="redis_up 0")
        n = len(done)
        wait_until(lambda: len(done) >= n + 10 or failures, what="traffic while Redis is down")
        for s in servers:
            with Client(f"127.0.0.1:{s.port}") as direct:
                counters = direct.stats()["counters"]
            assert counters["redis_up"] == 0 and counters["cluster_index_publish_failures"] > 0
            assert cli_main(["health", "--target", f"127.0.0.1:{s.port}"]) == 0, "local serving still works"
        resyncs = [s.metrics.counters().get("cluster_index_resyncs", 0) for s in servers]
        local_redis.start()  # empty: nodes re-register and resync their whole index
        wait_until(lambda: len(members(local_redis.url)) == 3, timeout=8, what="re-registration")
        # each node finished a resync since Redis came back (with traffic running, the three publishers'
        # queues are rarely all empty at the same instant, so that is no signal)
        wait_until(
            lambda: all(
                s.metrics.counters().get("redis_up") == 1
                and s.metrics.counters().get("cluster_index_resyncs", 0) > before
                for s, before in zip(servers, resyncs)
            ),
            timeout=10,
            what="resync",
        )
        settled_at = time.monotonic()
        n = len(done)
        wait_until(
            lambda: (len(done) >= n + 10 and time.monotonic() > settled_at + 2 * SETTLE_S + 1) or failures,
            timeout=30,
            what="traffic after Redis came back",
        )
    finally:
        stop.set()
        thread.join(30)
    assert not failures, failures[0]
    assert not [t for t in short_lookups if t > settled_at + 2 * SETTLE_S], "lookups kept missing after the resync"
    with Client(local_redis.url, refresh=0.1) as kv:
        assert kv.stats()["redis_up"]
        for _, hashes, _ in done[:: max(1, len(done) // 10)]:  # blocks put while Redis was down are indexed too
            assert kv.lookup("ns", hashes) == 3


def test_killed_node_expires_and_its_restart_republishes_from_nvme(spawn_server, local_redis, tmp_path):
    def args(i: int) -> tuple[str, ...]:
        return (
            "--redis",
            local_redis.url,
            "--cluster-ttl",
            str(TTL),
            "--node-id",
            f"node-{i}",
            "--dram",
            "32MiB",
            "--nvme-dir",
            str(tmp_path / f"nvme{i}"),
            "--nvme",
            "128MiB",
            "--nvme-segment",
            "16MiB",
            "--write-policy",
            "write-through",
        )

    procs = [spawn_server(*args(i)) for i in range(3)]
    wait_until(lambda: len(members(local_redis.url)) == 3, what="3 members")
    chains = [chain(4) for _ in range(9)]
    with Client(local_redis.url, refresh=0.1) as a, Client(local_redis.url, refresh=0.1) as b:
        for hashes, data in chains:
            a.put("ns", hashes, data)
        wait_until(lambda: all(b.lookup("ns", h) == 4 for h, _ in chains), what="all indexed")
        by_node: dict[str, list[int]] = {}
        for i, (hashes, _) in enumerate(chains):
            for p in procs:
                with Client(p.target) as direct:
                    if direct.lookup("ns", hashes) == 4:
                        by_node.setdefault(direct.stats()["node_id"], []).append(i)
        victim_id = max(by_node, key=lambda n: len(by_node[n]))
        victim = procs[int(victim_id.split("-")[1])]
        lost = by_node[victim_id]
        r = redis.Redis.from_url(local_redis.url)
        dead_index = b"%d" % next(m.index for m in read_members(r, KeyLayout()) if m.id == victim_id)
        assert any(k.endswith(b":" + dead_index) for k in r.scan_iter(b"kv:{ns:*"))
        victim.kill9()
        for i, (hashes, data) in enumerate(chains):  # right away: misses for its blocks, never errors
            got = b.get("ns", hashes, allow_missing=True)
            if i in lost:
                assert got == [None] * 4
            else:
                assert [bytes(x) for x in got] == data
        assert all(b.lookup("ns", chains[i][0]) == 0 for i in lost)
        wait_until(lambda: victim_id not in members(local_redis.url), timeout=TTL + 2, what="membership expiry")
        wait_until(
            lambda: not any(k.endswith(b":" + dead_index) for k in r.scan_iter(b"kv:{ns:*")),
            timeout=TTL + 2,
            what="the dead node's index keys to expire",
        )
        r.close()
        with Client(local_redis.url, refresh=0.1) as fresh:  # a client that never saw it fail
            assert all(fresh.lookup("ns", chains[i][0]) == 0 for i in lost)
        procs.append(spawn_server(*args(int(victim_id.split("-")[1]))))  # same NVMe directory, new port
        wait_until(
            lambda: all(b.lookup("ns", chains[i][0]) == 4 for i in lost),
            timeout=10,
            what="recovered blocks re-registered",
        )
        for hashes, data in chains:
            assert [bytes(x) for x in b.get("ns", hashes)] == data


def test_node_started_before_redis_serves_and_registers_later(make_server, local_redis):
    local_redis.stop()
    server = make_server(redis=local_redis.url, cluster_ttl=TTL)
    hashes, data = chain(4)
    with Client(f"127.0.0.1:{server.port}") as direct:
        assert all(r.ok for r in direct.put("ns", hashes, data))  # local serving needs no Redis
        assert direct.stats()["counters"]["redis_up"] == 0
    local_redis.start()
    # the connector's backoff (at most 2 s) and the membership loop's beat (TTL / 3) come before it: ample margin
    wait_until(lambda: members(local_redis.url) == [server.cluster.node_id], timeout=15, what="registration")
    with Client(local_redis.url, refresh=0.1) as kv:
        wait_until(lambda: kv.lookup("ns", hashes) == 4, what="blocks stored before Redis came up are indexed")
        assert [bytes(x) for x in kv.get("ns", hashes)] == data
    assert server.metrics.counters()["redis_up"] == 1


def test_cluster_client_passes_codecs_to_the_node(make_server, local_redis):
    torch = pytest.importorskip("torch")
    from kvstore.v1 import kvstore_pb2 as pb

    servers = [make_server(redis=local_redis.url, cluster_ttl=TTL, lossy_namespaces="lossy-*") for _ in range(2)]
    wait_until(lambda: len(members(local_redis.url)) == 2, what="2 members")
    gen = torch.Generator().manual_seed(7)
    blocks = [(torch.randn(256, 64, generator=gen) * 3).to(torch.bfloat16) for _ in range(4)]
    hashes = [os.urandom(16) for _ in blocks]
    with Client(local_redis.url, refresh=0.1, lane="grpc") as kv:
        assert all(r.status == "stored" for r in kv.put("ns", hashes, blocks, codec="zstd"))
        (holder,) = holder_of(servers, "ns", hashes)
        leases = holder.store.acquire("ns", hashes)
        try:
            assert {lease.codec for lease in leases} == {pb.CODEC_ZSTD}
        finally:
            holder.store.release(leases)
        out = [torch.empty_like(b) for b in blocks]
        kv.get("ns", hashes, out=out)
        assert all(torch.equal(o, b) for o, b in zip(out, blocks))
        with pytest.raises(KVStoreError) as err:  # the node's lossy policy still rules
            kv.put("ns", [os.urandom(16)], blocks[:1], codec="fp8", lossy_ok=True)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        lossy = [os.urandom(16) for _ in blocks]
        assert all(r.status == "stored" for r in kv.put("lossy-a", lossy, blocks, codec="fp8", lossy_ok=True))
        got = kv.get("lossy-a", lossy, lossy_ok=True)
        assert all(len(bytes(g)) == b.numel() * 2 for g, b in zip(got, blocks))  # decoded back to bf16 bytes


def test_a_cluster_clients_shared_pool_is_offered_to_every_node(make_server, local_redis):
    # the nodes' DRAM arenas private: the nodes write the blocks into the pool (a shared arena's hits, found in
    # its index after a namespace's first Get, are copied into it by the client unasked: index hits, not pool bytes)
    servers = [make_server(redis=local_redis.url, cluster_ttl=TTL, share_dram=False) for _ in range(2)]
    wait_until(lambda: len(members(local_redis.url)) == 2, what="2 members")
    chains = [chain(4) for _ in range(6)]
    with Client(local_redis.url, refresh=0.1) as kv:
        assert isinstance(kv, ClusterClient)
        for hashes, data in chains:
            kv.put("ns", hashes, data)
        pool = kv.shared_pool(len(chains) * 4 * BLOCK)  # offered to the clients made so far and to those made later
        views = pool.array[: len(chains) * 4 * BLOCK].reshape(len(chains) * 4, BLOCK)  # whole pages: maybe longer
        for i, (hashes, data) in enumerate(chains):
            wait_until(lambda: kv.lookup("ns", hashes) == 4, what="index published")
            kv.get("ns", hashes, out=list(views[4 * i : 4 * i + 4]))
            assert [bytes(v) for v in views[4 * i : 4 * i + 4]] == data
        pooled = [
            kv.directory.client(m).stats()["counters"].get("lane_shm_pool_get_bytes", 0) for m in kv.directory.live()
        ]
    holders = {holder_of(servers, "ns", hashes)[0].port for hashes, _ in chains}
    assert sum(pooled) == len(chains) * 4 * BLOCK  # every block written into the pool by its node
    assert sum(1 for n in pooled if n) == len(holders)  # by each node that held some
