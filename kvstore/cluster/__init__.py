"""Cluster mode: store nodes that find each other, and each other's blocks, through Redis.

One file per job (the layout is the map):

- ``keys.py``        the Redis key layout (membership, index snapshot ids, index hashes)
- ``connect.py``     one Redis or a Redis Cluster from a URL; lazy connect, backoff
- ``membership.py``  node registration and TTL heartbeats; the live member list
- ``storeview.py``   what the local BlockStore holds (read without its lock)
- ``publisher.py``   mirrors the node's blocks into the global index, batched
- ``index.py``       the index's read (holders per hash) and write commands
- ``node.py``        the node side, started by ``StoreServer`` with ``--redis``
- ``routing.py``     rendezvous placement of prefixes on nodes
- ``directory.py``   the client's cached members, per-node clients, down marks
- ``client.py``      ``ClusterClient``: lookup/put/get/delete/stats across nodes
- ``localredis.py``  throwaway redis-server / 3-master Redis Cluster (tests, bench)

Failure semantics in one place:

- A store node dies: it drops out of membership within ``--cluster-ttl`` and so
  do its index entries (they expire; readers ignore non-members at once).
  Clients skip it as soon as one request to it fails; its blocks become misses.
  Restarted with its NVMe directory, it registers again and publishes the blocks
  it recovered.
- Redis is unreachable: nodes keep serving their blocks (``redis_up`` 0 in
  Stats counters, publish failures counted, events queued up to a bound, then a
  full resync when Redis is back); clients route with the last member list they
  read and ask nodes directly. No request fails because Redis is down.

``--redis redis://HOST:PORT`` works with one Redis server and with a Redis
Cluster seed (detected with ``INFO cluster``); ``redis+cluster://H:P,H:P`` names
a cluster explicitly by several seeds.

The package imports none of its modules: the node side (``node.py``, under ``kvstore serve``) and the client
side (``client.py``, under ``kvstore.client.Client``) load only what they use. Import
``kvstore.cluster.client.ClusterClient`` and ``kvstore.cluster.node.ClusterNode`` by module.
"""
