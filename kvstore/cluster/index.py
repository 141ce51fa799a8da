"""The global index in Redis: which live node holds which block, and in which tier.

Layout (see ``kvstore.cluster.keys``): per node snapshot and namespace shard, one
hash ``kv:{<ns>:<s>}:<index id>`` of 16-byte block hash -> top tier rank.

Verbs:

- ``holders(client, layout, ns, hashes, members) -> [{node id: rank}]``: for each
  hash, the live members whose index lists it. One pipeline of at most
  ``members x shards`` HMGETs: one round trip (with Redis Cluster, one per master,
  sent in parallel by redis-py's cluster pipeline).
- ``write(pipe, layout, index_id, shards, states, ttl_ms) -> {key: (added, removed)}``:
  queue HSET/HDEL/PEXPIRE for (ns, hash, rank) states, rank 0 meaning "gone";
  used by the publisher for incremental batches and full resyncs.

Readers treat the index as a hint: it lags the nodes by the publisher's flush
interval (tens of ms), so a holder may have just evicted a block (a Get there
misses and the client tries the next holder) or a block may not be listed yet.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvstore.cluster.connect import RedisClient
from kvstore.cluster.keys import KeyLayout, shard_of
from kvstore.cluster.membership import NodeInfo


def holders(
    client: RedisClient, layout: KeyLayout, namespace: str, hashes: Sequence[bytes], members: Sequence[NodeInfo]
) -> list[dict[str, int]]:
    out: list[dict[str, int]] = [{} for _ in hashes]
    indexed = [m for m in members if m.index]
    if not hashes or not indexed:
        return out
    pipe = client.pipeline(transaction=False)
    plan: list[tuple[str, list[int]]] = []
    by_shards: dict[int, dict[int, list[int]]] = {}
    for m in indexed:
        groups = by_shards.get(m.shards)
        if groups is None:
            groups = by_shards[m.shards] = {}
            for i, h in enumerate(hashes):
                groups.setdefault(shard_of(h, m.shards), []).append(i)
        for shard, idxs in groups.items():
            pipe.hmget(layout.index(namespace, shard, m.index), [hashes[i] for i in idxs])
            plan.append((m.id, idxs))
    for (node, idxs), values in zip(plan, pipe.execute()):
        for i, value in zip(idxs, values):
            if value is not None:
                out[i][node] = int(value)
    return out


def write(
    pipe: Any, layout: KeyLayout, index_id: int, shards: int, states: Iterable[tuple[str, bytes, int]], ttl_ms: int
) -> list[tuple[bytes, int]]:
    """Queue the commands; returns (key, sign) per queued HSET (+1) / HDEL (-1) in order, so the
    caller can read how many fields each added or removed from the pipeline's replies."""
    sets: dict[bytes, dict[bytes, bytes]] = {}
    dels: dict[bytes, list[bytes]] = {}
    for ns, key, rank in states:
        name = layout.index(ns, shard_of(key, shards), index_id)
        if rank:
            sets.setdefault(name, {})[key] = b"%d" % rank
        else:
            dels.setdefault(name, []).append(key)
    queued: list[tuple[bytes, int]] = []
    for name, mapping in sets.items():
        pipe.hset(name, mapping=mapping)
        pipe.pexpire(name, ttl_ms)
        queued += [(name, 1), (name, 0)]
    for name, fields in dels.items():
        pipe.hdel(name, *fields)
        queued.append((name, -1))
    return queued
