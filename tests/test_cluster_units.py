"""Cluster mode parts on their own: rendezvous placement, key layout, URLs, membership TTL, the publisher."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import redis
from redis.crc import key_slot

from kvstore.checksum import crc32c
from kvstore.client import Client
from kvstore.cluster import index, routing
from kvstore.cluster.client import ClusterClient
from kvstore.cluster.connect import RedisConnector, is_redis_url
from kvstore.cluster.keys import KeyLayout
from kvstore.cluster.localredis import LocalRedis, RedisNotAvailable
from kvstore.cluster.membership import Membership, NodeInfo, read_members
from kvstore.cluster.publisher import IndexPublisher, PublisherOptions
from kvstore.config import ServeConfig
from kvstore.server.app import build_store
from kvstore.store import BlockStore
from kvstore.tiers.base import BlockMeta


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
def local_redis() -> Iterator[LocalRedis]:
    try:
        server = LocalRedis().start()
    except RedisNotAvailable as err:
        pytest.skip(f"cannot start redis-server: {err}")
    yield server
    server.close()


# -- placement ----------------------------------------------------------------------------------------
def test_rendezvous_balances_and_moves_only_the_leaving_nodes_keys():
    nodes = [NodeInfo(id=f"10.0.0.{i}:7070", addr="", incarnation="x") for i in range(3)]
    keys = [os.urandom(16) for _ in range(3000)]
    owner = {k: routing.rank(k, nodes)[0].id for k in keys}
    shares = Counter(owner.values())
    assert all(800 < n < 1200 for n in shares.values()), shares
    survivors = nodes[1:]
    for k in keys:
        new = routing.rank(k, survivors)[0].id
        if owner[k] != nodes[0].id:
            assert new == owner[k], "a key moved although its node stayed"
    heavy = [NodeInfo(id="a", addr="", incarnation="x", weight=2.0), NodeInfo(id="b", addr="", incarnation="x")]
    share_a = sum(routing.rank(k, heavy)[0].id == "a" for k in keys) / len(keys)
    assert 0.6 < share_a < 0.73, share_a  # weight 2 of 3


def test_key_layout_keeps_pipelined_keys_in_one_slot():
    layout = KeyLayout()
    assert len({key_slot(k.encode()) for k in (layout.nodes, layout.info)}) == 1
    for ns in ("tenant-a", "a}b", "ns:{x}"):
        for shard in range(8):
            slots = {key_slot(layout.index(ns, shard, idx)) for idx in (1, 2, 999)}
            assert len(slots) == 1, (ns, shard)  # every node's key of one shard: one slot
    spread = {key_slot(layout.index("tenant-a", s, 1)) for s in range(8)}
    assert len(spread) == 8  # shards of one namespace spread over the cluster


def test_urls_and_client_dispatch():
    assert is_redis_url("redis://h:1") and is_redis_url("redis+cluster://a:1,b:2") and not is_redis_url("h:7070")
    conn = RedisConnector("redis://:secret@127.0.0.1:1/0")
    assert "secret" not in conn.safe_url and conn.safe_url.endswith("127.0.0.1:1/0")
    with pytest.raises(ValueError):
        RedisConnector("http://127.0.0.1:1")
    kv = Client("redis://127.0.0.1:1", refresh=0.1)  # lazy: no Redis needed to construct
    assert isinstance(kv, ClusterClient)
    assert kv.lookup("ns", [os.urandom(16)]) == 0  # no Redis, no nodes: a miss, not an error
    assert kv.put("ns", [b"k" * 16], [b"x"])[0].status == "rejected"
    assert kv.get("ns", [b"k" * 16], allow_missing=True) == [None]
    kv.close()
    single = Client("127.0.0.1:1")
    assert type(single) is Client
    single.close()


# -- membership ---------------------------------------------------------------------------------------
def test_membership_ttl_deregistration_and_lost_registration(local_redis):
    conn = RedisConnector(local_redis.url)
    lost: list[bool] = []
    a = Membership(
        conn, NodeInfo(id="a", addr="127.0.0.1:1", incarnation="i1"), ttl=1.5, on_lost=lambda: lost.append(True)
    )
    b = Membership(conn, NodeInfo(id="b", addr="127.0.0.1:2", incarnation="i2"), ttl=30)
    b.beat()
    r = conn.get()
    read_members(r, KeyLayout())  # its script loaded, so that a's beat is fresh when it is read
    a.beat()
    assert [m.id for m in read_members(r, KeyLayout())] == ["a", "b"]
    time.sleep(1.6)  # a stops heartbeating: gone after its TTL
    assert [m.id for m in read_members(r, KeyLayout())] == ["b"]
    a.beat()  # back after its entry expired: its index may be gone too
    assert lost == [True]
    r.flushall()  # Redis restarted empty
    a.beat()
    assert lost == [True, True]
    b.stop(deregister=True)
    assert [m.id for m in read_members(r, KeyLayout())] == ["a"]
    conn.close()


# -- publisher ----------------------------------------------------------------------------------------
def _put(store: BlockStore, ns: str, key: bytes, data: bytes, parent: bytes = b"") -> None:
    ticket = store.begin_put(ns, BlockMeta(ns, key, parent, 0, "uint8", len(data), len(data), crc32c(data)))
    if ticket is not None:
        ticket.buffer[: len(data)] = data
        store.commit_put(ticket)


def _indexed(url: str, ns: str, keys: list[bytes]) -> list[int]:
    r = redis.Redis.from_url(url)
    try:
        found = index.holders(r, KeyLayout(), ns, keys, read_members(r, KeyLayout()))
    finally:
        r.close()
    return [max(h.values()) if h else 0 for h in found]


def test_publisher_mirrors_puts_demotions_and_deletes(local_redis, tmp_path):
    store = build_store(
        ServeConfig(dram=8 << 20, nvme_dir=str(tmp_path / "nvme"), nvme=64 << 20, nvme_segment=8 << 20, metrics_port=0)
    )
    member = Membership(RedisConnector(local_redis.url), NodeInfo(id="n", addr="x:1", incarnation="i"), ttl=5)
    pub = IndexPublisher(
        store, RedisConnector(local_redis.url), member, ttl=5, options=PublisherOptions(flush_interval=0.005)
    )
    member.start()
    pub.start()
    try:
        keys = [os.urandom(16) for _ in range(40)]
        for i, key in enumerate(keys):  # 20 MiB into an 8 MiB DRAM tier: the oldest are demoted to NVMe
            _put(store, "ns", key, os.urandom(512 << 10), parent=keys[i - 1] if i else b"")
        truth = pub.view.top_ranks([("ns", k) for k in keys])
        assert set(truth) == {2, 3}
        wait_until(lambda: _indexed(local_redis.url, "ns", keys) == truth, what="index == store")
        store.delete("ns", keys[:5])
        wait_until(lambda: _indexed(local_redis.url, "ns", keys)[:5] == [0] * 5, what="deletes published")
        assert _indexed(local_redis.url, "ns", keys)[5:] == truth[5:]
    finally:
        pub.stop()
        member.stop()
        store.close(flush=False)
    r = redis.Redis.from_url(local_redis.url)
    assert r.keys(b"kv:{ns:*") == [], "graceful stop deletes the node's index keys"
    r.close()


def test_publisher_overflow_and_outage_end_in_a_full_resync(local_redis):
    store = build_store(ServeConfig(dram=64 << 20, metrics_port=0))
    member = Membership(RedisConnector(local_redis.url), NodeInfo(id="n", addr="x:1", incarnation="i"), ttl=5)
    pub = IndexPublisher(
        store,
        RedisConnector(local_redis.url),
        member,
        ttl=5,
        options=PublisherOptions(flush_interval=0.005, max_pending=16),
    )
    member.start()
    pub.start()
    try:
        wait_until(lambda: pub.index_id > 0, what="first snapshot")
        first = pub.index_id
        local_redis.stop()
        keys = [os.urandom(16) for _ in range(100)]  # 100 events into a 16-event queue while Redis is down
        for key in keys:
            _put(store, "ns", key, b"x" * 4096)
        wait_until(lambda: pub._resync_needed, what="overflow noticed")
        local_redis.start()
        wait_until(
            lambda: pub.index_id > 0 and pub.index_id != first and pub.pending == 0,
            timeout=10,
            what="resync after Redis came back",
        )
        assert _indexed(local_redis.url, "ns", keys) == [2] * 100  # pending is not 0 until it is advertised
    finally:
        pub.stop()
        member.stop()
        store.close(flush=False)


def test_pending_stays_up_until_a_resync_is_advertised(local_redis):
    """A resync's snapshot is in Redis before the membership advertises its index id: until then readers
    cannot see it, so ``pending`` (and the cluster_index_pending gauge) must not read 0."""
    store = build_store(ServeConfig(dram=64 << 20, metrics_port=0))
    member = Membership(RedisConnector(local_redis.url), NodeInfo(id="n", addr="x:1", incarnation="i"), ttl=5)
    pub = IndexPublisher(
        store, RedisConnector(local_redis.url), member, ttl=5, options=PublisherOptions(flush_interval=0.005)
    )
    in_update, release = threading.Event(), threading.Event()
    advertise = member.update

    def slow_update(**fields):
        in_update.set()
        release.wait(10)
        advertise(**fields)

    member.update = slow_update
    for _ in range(10):
        _put(store, "ns", os.urandom(16), b"x" * 4096)
    pub.start()
    try:
        assert in_update.wait(10)
        assert pub.index_id > 0 and pub.pending > 0
        release.set()
        wait_until(lambda: pub.pending == 0, what="resync advertised")
        assert [m.index for m in read_members(redis.Redis.from_url(local_redis.url), KeyLayout())] == [pub.index_id]
    finally:
        release.set()
        pub.stop()
        store.close(flush=False)


def test_redis_memory_per_indexed_block_is_small(local_redis):
    store = build_store(ServeConfig(dram=256 << 20, metrics_port=0))
    r = redis.Redis.from_url(local_redis.url)
    before = r.info("memory")["used_memory"]
    member = Membership(RedisConnector(local_redis.url), NodeInfo(id="n", addr="x:1", incarnation="i"), ttl=5)
    pub = IndexPublisher(
        store, RedisConnector(local_redis.url), member, ttl=5, options=PublisherOptions(flush_interval=0.005)
    )
    n = 20000
    for _ in range(n):
        _put(store, "ns", os.urandom(16), b"x" * 4096)
    member.start()
    pub.start()
    try:
        wait_until(lambda: pub.index_id > 0 and pub.pending == 0, timeout=30, what="snapshot of 20000 blocks")
        per_block = (r.info("memory")["used_memory"] - before) / n
        assert per_block < 120, f"{per_block:.0f} bytes of Redis memory per indexed block"
    finally:
        pub.stop()
        member.stop()
        store.close(flush=False)
        r.close()
