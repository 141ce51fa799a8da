"""Cluster mode on a real 3-master Redis Cluster (redis-cli --cluster create on loopback ports)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from redis.cluster import RedisCluster

from kvstore.client import Client
from kvstore.cluster.keys import KeyLayout
from kvstore.cluster.localredis import LocalRedisCluster, RedisNotAvailable
from kvstore.cluster.membership import read_members

TTL = 2.0


def wait_until(pred: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[LocalRedisCluster]:
    try:
        cluster = LocalRedisCluster(masters=3).start()
    except RedisNotAvailable as err:
        pytest.skip(f"cannot start a 3-master Redis Cluster: {err}")
    yield cluster
    cluster.close()


def chain(n: int) -> tuple[list[bytes], list[bytes]]:
    return [os.urandom(16) for _ in range(n)], [os.urandom(32 << 10) for _ in range(n)]


def members(url: str) -> dict[str, int]:
    rc = RedisCluster.from_url(url)
    try:
        return {m.id: m.index for m in read_members(rc, KeyLayout())}
    except Exception:  # noqa: BLE001 (a cluster mid-failover reads as "no members yet")
        return {}
    finally:
        rc.close()


def index_keys_per_master(cluster: LocalRedisCluster) -> list[list[bytes]]:
    import redis

    out = []
    for node in cluster.nodes:
        r = redis.Redis(port=node.port)
        out.append(list(r.scan_iter(b"kv:{ns:*")))
        r.close()
    return out


def test_prefixes_across_nodes_and_a_killed_node(make_server, spawn_server, redis_cluster):
    servers = [
        make_server(redis=redis_cluster.url, cluster_ttl=TTL, dram=64 << 20),  # INFO cluster
        make_server(redis=redis_cluster.seeds_url, cluster_ttl=TTL, dram=64 << 20),
    ]  # redis+cluster://
    proc = spawn_server(
        "--redis", redis_cluster.url, "--cluster-ttl", str(TTL), "--node-id", "doomed", "--dram", "64MiB"
    )
    wait_until(lambda: len(members(redis_cluster.url)) == 3, what="3 members")
    chains: list[tuple[list[bytes], list[bytes]]] = []
    with Client(redis_cluster.url, refresh=0.1) as a, Client(redis_cluster.seeds_url, refresh=0.1) as b:
        while len(chains) < 12 or all(any(s.store.lookup("ns", h)[0] for s in servers) for h, _ in chains):
            hashes, data = chain(5)  # until rendezvous has placed a prefix on the subprocess node too
            assert all(r.ok for r in a.put("ns", hashes, data))
            chains.append((hashes, data))
            assert len(chains) < 200
        wait_until(lambda: all(b.lookup("ns", h) == 5 for h, _ in chains), what="all indexed")
        for hashes, data in chains:
            assert [bytes(x) for x in b.get("ns", hashes)] == data
        assert b.stats()["redis_mode"] == "cluster"
        assert sum(1 for keys in index_keys_per_master(redis_cluster) if keys) >= 2, "index spread over masters"
        on_doomed = [h for h, _ in chains if not any(s.store.lookup("ns", h)[0] for s in servers)]
        dead_index = b"%d" % members(redis_cluster.url)["doomed"]
        proc.kill9()
        for hashes, data in chains:
            got = b.get("ns", hashes, allow_missing=True)
            expected = [None] * 5 if hashes in on_doomed else data
            assert [None if x is None else bytes(x) for x in got] == expected
        wait_until(lambda: "doomed" not in members(redis_cluster.url), timeout=TTL + 2, what="membership expiry")
        wait_until(
            lambda: (
                not any(k.endswith(b":" + dead_index) for keys in index_keys_per_master(redis_cluster) for k in keys)
            ),
            timeout=TTL + 2,
            what="the dead node's index keys to expire",
        )
        for hashes in on_doomed:
            assert a.lookup("ns", hashes) == 0
    for s in servers:
        assert s.metrics.counters()["redis_up"] == 1


def test_a_redis_master_down_and_back(make_server, redis_cluster):
    servers = [make_server(redis=redis_cluster.url, cluster_ttl=TTL) for _ in range(2)]
    wait_until(lambda: len(members(redis_cluster.url)) == 2, what="2 members")
    chains = [chain(3) for _ in range(6)]
    with Client(redis_cluster.url, refresh=0.1, redis_timeout=0.5) as kv:
        for hashes, data in chains:
            kv.put("ns", hashes, data)
        wait_until(lambda: all(kv.lookup("ns", h) == 3 for h, _ in chains), what="all indexed")
        rc = RedisCluster.from_url(redis_cluster.url)
        port = rc.get_node_from_key(KeyLayout().nodes).port
        rc.close()
        master = next(n for n in redis_cluster.nodes if n.port == port)
        master.stop()  # the master of the membership slot
        wait_until(lambda: all(s.metrics.counters().get("redis_up") == 0 for s in servers), what="redis_up 0")
        for hashes, data in chains:  # degraded: nodes asked directly, nothing fails
            assert kv.lookup("ns", hashes) == 3
            assert [bytes(x) for x in kv.get("ns", hashes)] == data
        more, more_data = chain(3)
        assert all(r.ok for r in kv.put("ns", more, more_data))
        assert kv.stats()["redis_up"] is False
        master.start()  # rejoins with its nodes.conf, empty
        wait_until(lambda: len(members(redis_cluster.url)) == 2, timeout=15, what="re-registration")
        wait_until(
            lambda: all(
                s.metrics.counters().get("redis_up") == 1 and s.cluster.publisher.pending == 0 for s in servers
            ),
            timeout=10,
            what="resync",
        )
        wait_until(
            lambda: all(kv.lookup("ns", h) == 3 for h, _ in chains + [(more, more_data)]),
            timeout=5,
            what="index complete again",
        )
        assert kv.stats()["redis_up"] is True
