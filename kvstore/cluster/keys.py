"""The Redis key layout of cluster mode: every key name is built here and nowhere else.

Membership (one Redis Cluster slot, hash tag ``{m}``)::

    kv:{m}:nodes    ZSET    node id -> deadline in ms on the Redis clock (TIME);
                            live means deadline > now; a heartbeat pushes it ttl ahead
    kv:{m}:info     HASH    node id -> NodeInfo as JSON (address, incarnation, index id,
                            shards, weight, tiers, lanes)

Global index (hash tag ``{ns:s}``: the index keys of one namespace shard, of every
node, share a slot, so one lookup touches at most ``shards`` slots)::

    kv:{<ns>:<s>}:<index id>   HASH   16-byte block hash -> top tier rank of the copy on
                                      that node ("1" HBM, "2" DRAM, "3" NVMe)

``s = hash[0] % shards``. Each key belongs to one snapshot of one node's
blocks, named by its index id: a random 48-bit number drawn per snapshot and
advertised in the node's NodeInfo (random rather than a Redis counter, which an
empty restarted Redis would hand out again). Each key carries a PEXPIRE of the
membership TTL that its owner refreshes, so a node that stops heartbeating loses
its entries within the TTL without anyone cleaning up after it; readers only
read the index ids of live members, so a dead node's entries are invisible even
before they expire. Redis deletes a hash when its last field goes, which is how
removed blocks disappear.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SHARDS = 8


@dataclass(frozen=True)
class KeyLayout:
    prefix: str = "kv"

    @property
    def nodes(self) -> str:
        return f"{self.prefix}:{{m}}:nodes"

    @property
    def info(self) -> str:
        return f"{self.prefix}:{{m}}:info"

    def index(self, namespace: str, shard: int, index_id: int) -> bytes:
        return b"%s:{%s:%d}:%d" % (self.prefix.encode(), namespace.encode("utf-8", "surrogatepass"), shard, index_id)


def shard_of(key: bytes, shards: int) -> int:
    """Block hashes are uniform (BLAKE2b), so their first byte spreads blocks over shards."""
    return key[0] % shards
