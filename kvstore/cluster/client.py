"""ClusterClient: the kvstore client verbs over a cluster of store nodes found through Redis.

    from kvstore.client import Client
    with Client("redis://127.0.0.1:6379") as kv:     # a ClusterClient (kvstore.client dispatches)
        n = kv.lookup("ns", hashes)
        kv.put("ns", hashes, payloads)
        blocks = kv.get("ns", hashes)

Verbs (same names and results as ``kvstore.client.Client``):

- ``lookup(ns, hashes) -> int`` / ``lookup_tiers``: the longest prefix of ``hashes``
  whose every block some live node holds, from one pipelined query of the global
  index (``kvstore.cluster.index``); the tier is the best copy's.
- ``put(ns, hashes, payloads, *, parent=None, dtype=None, chained=True, root=None)``:
  the whole batch goes to one node: with ``parent``, the node this client put the
  parent on (an extension put right after its prefix, before the index lists it)
  or else the parent's best live holder in the index; otherwise the rendezvous
  winner for the prefix root (``root``, default ``hashes[0]``). So a prefix's blocks
  stay together, and each node's leaf-first eviction sees whole chains. A node
  that fails is skipped for the next in rendezvous order (then nodes listed until
  a moment ago, see ``get``); when none takes the batch every block comes back
  rejected with UNAVAILABLE (no exception).
- ``get(ns, hashes, *, out=None, allow_missing=False, verify=True)``: each block from
  a node the index names (best tier first), nodes fetched in parallel; blocks a
  node misses or that fail with the node are retried on their next holder, then
  on every other live node in rendezvous order of ``hashes[0]`` (the index lags
  puts by the publishers' flush interval), then on nodes listed until a moment
  ago (``linger``). A block unavailable everywhere raises ``KVStoreError(NOT_FOUND)``
  like the single-node client, or is None with ``allow_missing``; so a miss costs
  one Get per node, a hit on an indexed block one Get per holding node.
- ``delete(ns, hashes) -> int``: sent to every live (and lingering) node; the number of
  copies removed.
- ``stats() -> dict``: per-node stats, members, tiers summed over nodes, and whether
  Redis is reachable.
- ``shared_pool(nbytes) -> SharedPool``: memory offered to every node's client; the node
  on this host writes Gets into it itself (``NodeClient.shared_pool``).

Options: ``nodes`` (addresses to ask while no member list was ever read),
``refresh`` (seconds a member list is reused), ``down_for`` (seconds a failed node
is skipped), ``linger`` (see get), ``redis_timeout``, ``prefix`` (of every Redis
key), ``parallel`` (node requests in flight); the rest (``token``, ``tls_*``,
``timeout``, ``lane``, ...) go to each per-node ``NodeClient``.

Failure semantics: a store node failing mid-request never surfaces as an error
(fallback to other holders, else a miss). Errors that are the caller's own
(INVALID_ARGUMENT, UNAUTHENTICATED, PERMISSION_DENIED) are raised as from
``Client``. When Redis is unreachable the client routes with the last member
list it read (or the ``nodes`` addresses given) and asks the nodes directly:
lookup queries every live node (the longest prefix wins, continued on others),
get asks the nodes in rendezvous order. ``stats()["redis_up"]`` shows it.
Per-node clients are built with ``retries=0`` unless given: falling over to
another holder replaces retrying the same one.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from kvstore import memops_jit, payload_runs
from kvstore.background_compile import warm_up_logged
from kvstore.cluster import index, routing
from kvstore.cluster.connect import REDIS_ERRORS, RedisConnector
from kvstore.cluster.directory import Directory
from kvstore.cluster.keys import KeyLayout
from kvstore.cluster.membership import NodeInfo
from kvstore.errors import KVStoreError
from kvstore.lanes.shared_pool import SharedPool
from kvstore.wire import CHUNK_BYTES, TIER_NAMES, PutResult

log = logging.getLogger("kvstore.cluster.client")
T = TypeVar("T")

# The node (not the request) failed: try another holder and skip this node for a while.
NODE_FAILURES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
    }
)
# This node could not serve this request: try another holder, the node stays in use.
NODE_MISSES = frozenset({grpc.StatusCode.DATA_LOSS, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND})
PLACED_MEMORY = 4096  # recent puts remembered for placing their extensions


class ClusterClient:
    def __init__(
        self,
        target: str,
        *,
        nodes: Sequence[str] = (),
        refresh: float = 1.0,
        down_for: float = 2.0,
        linger: float = 10.0,
        redis_timeout: float = 1.0,
        prefix: str = "kv",
        parallel: int = 8,
        timeout: float = 60.0,
        chunk_bytes: int = CHUNK_BYTES,
        **client_options: Any,
    ):
        self.connector = RedisConnector(target, timeout=redis_timeout)
        self.layout = KeyLayout(prefix)
        client_options.setdefault("retries", 0)
        self.directory = Directory(
            self.connector,
            self.layout,
            refresh=refresh,
            down_for=down_for,
            linger=linger,
            static=nodes,
            client_options={"timeout": timeout, "chunk_bytes": chunk_bytes, **client_options},
        )
        self.target, self.timeout = target, timeout
        self._pool = ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="kvstore-cluster")
        self._placed: OrderedDict[tuple[str, bytes], str] = OrderedDict()
        self._placed_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------
    def shared_pool(self, nbytes: int, name: str = "kvstore-pool") -> SharedPool:
        """``NodeClient.shared_pool`` for a cluster: host memory offered to every node's client; a node on this
        host maps it and writes Gets whose ``out`` buffers lie in it itself, the others see plain memory."""
        pool = SharedPool(nbytes, name)
        self.directory.add_pool(pool)
        return pool

    def warm_up(self) -> str:
        """What ``NodeClient.warm_up`` does for a cluster, as far as it can before a node is chosen: the copy and
        CRC32C kernels and the NVMe reader's compiled runs, compiled (or loaded from numba's cache) on this thread.
        Each node's lane still opens, and its reader starts, at its first use. Imports numba where installed
        (see ``NodeClient.warm_up``); a kernel that fails to compile is logged, not raised. Returns "cluster"."""
        warm_up_logged(memops_jit.warm_up, "the copy and CRC32C kernels")
        warm_up_logged(payload_runs.COMPILED.warm_up, "the NVMe reader's compiled runs")
        return "cluster"

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.directory.close()
        self.connector.close()

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- lookup ------------------------------------------------------------------------------
    def lookup(self, namespace: str, hashes: Sequence[bytes]) -> int:
        return self.lookup_tiers(namespace, hashes)[0]

    def lookup_tiers(self, namespace: str, hashes: Sequence[bytes]) -> tuple[int, list[str]]:
        found = self._holders(namespace, hashes)
        if found is None:
            return self._lookup_direct(namespace, list(hashes))
        tiers: list[str] = []
        for held in found:
            ranks = [rank for node, rank in held.items() if not self.directory.is_down(node)]
            if not ranks:
                break
            tiers.append(TIER_NAMES.get(min(ranks), "?"))
        return len(tiers), tiers

    def _lookup_direct(self, namespace: str, hashes: list[bytes]) -> tuple[int, list[str]]:
        """Redis is down: ask every live node; the longest prefix wins and the rest is asked again."""
        done, tiers = 0, []
        live = self.directory.live() + self.directory.recent()
        while done < len(hashes) and live:
            rest = hashes[done:]
            replies = self._each(live, lambda m: self.directory.client(m).lookup_tiers(namespace, rest))
            best = max((r for r in replies.values() if r is not None), key=lambda r: r[0], default=(0, []))
            if best[0] == 0:
                break
            done += best[0]
            tiers += best[1]
        return done, tiers

    def _holders(self, namespace: str, hashes: Sequence[bytes]) -> list[dict[str, int]] | None:
        """Index holders per hash among live members, or None when Redis (the index) is unavailable."""
        members = self.directory.members()
        if not self.directory.redis_up or not self.connector.available:
            return None
        try:
            found = index.holders(self.connector.get(), self.layout, namespace, hashes, members)
        except REDIS_ERRORS as err:
            self.connector.failed(err)
            self.directory.redis_failed(err)
            return None
        self.connector.ok()
        return found

    # -- put -----------------------------------------------------------------------------------
    def put(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        payloads: Sequence[Any],
        *,
        parent: bytes | None = None,
        dtype: str | None = None,
        chained: bool = True,
        root: bytes | None = None,
        codec: str | None = None,
        lossy_ok: bool = False,
    ) -> list[PutResult]:
        """As ``Client.put`` on the node that should hold the prefix (``codec``/``lossy_ok`` as there)."""
        if len(hashes) != len(payloads):
            raise ValueError(f"{len(hashes)} hashes but {len(payloads)} payloads")
        if not hashes:
            return []
        why = "no live store nodes"
        for member in self._placement(namespace, hashes, parent, root):
            try:
                results = self.directory.client(member).put(
                    namespace,
                    hashes,
                    payloads,
                    parent=parent,
                    dtype=dtype,
                    chained=chained,
                    codec=codec,
                    lossy_ok=lossy_ok,
                )
                self._remember(namespace, hashes[-1], member.id)
                return results
            except KVStoreError as err:
                if err.code not in NODE_FAILURES:
                    raise
                self.directory.mark_down(member, err)
                why = f"{member.id}: {err}"
            except (OSError, grpc.RpcError) as err:
                self.directory.mark_down(member, err)
                why = f"{member.id}: {err}"
        return [
            PutResult(h, "rejected", grpc.StatusCode.UNAVAILABLE, f"no store node took the block ({why})")
            for h in hashes
        ]

    def _placement(
        self, namespace: str, hashes: Sequence[bytes], parent: bytes | None, root: bytes | None
    ) -> list[NodeInfo]:
        live = self.directory.live()
        order = routing.rank(root or hashes[0], live) + routing.rank(root or hashes[0], self.directory.recent())
        if parent is None or root is not None:
            return order
        with self._placed_lock:
            mine = self._placed.get((namespace, parent))  # this client put the parent a moment ago
        if mine is not None:
            return [m for m in order if m.id == mine] + [m for m in order if m.id != mine]
        held = self._holders(namespace, [parent])
        if not held or not held[0]:
            return order
        near = sorted((m for m in live if m.id in held[0]), key=lambda m: held[0][m.id])
        return near + [m for m in order if m.id not in held[0]]

    def _remember(self, namespace: str, last: bytes, node_id: str) -> None:
        """Where this client's last puts ended, so an extension put right after (before the index lists
        its parent) still lands beside its prefix; bounded, oldest forgotten first."""
        with self._placed_lock:
            self._placed[(namespace, last)] = node_id
            self._placed.move_to_end((namespace, last))
            while len(self._placed) > PLACED_MEMORY:
                self._placed.popitem(last=False)

    # -- get -------------------------------------------------------------------------------------
    def get(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        *,
        out: Sequence[Any] | None = None,
        allow_missing: bool = False,
        verify: bool = True,
        codec: str | None = None,
        lossy_ok: bool = False,
    ) -> list[Any]:
        """As ``Client.get``, each block from a node holding it (``codec``/``lossy_ok`` as there)."""
        if out is not None and len(out) != len(hashes):
            raise ValueError(f"{len(hashes)} hashes but {len(out)} output buffers")
        if not hashes:
            return []
        results: list[Any] = [None] * len(hashes)
        live, recent = self.directory.live(), self.directory.recent()
        by_id = {m.id: m for m in live + recent}
        candidates = self._candidates(namespace, hashes, live, recent)
        step = [0] * len(hashes)
        pending = set(range(len(hashes)))
        while pending:
            groups: dict[str, list[int]] = {}
            for i in sorted(pending):
                cands = candidates[i]
                while step[i] < len(cands) and self.directory.is_down(cands[step[i]]):
                    step[i] += 1
                if step[i] == len(cands):
                    pending.discard(i)
                else:
                    groups.setdefault(cands[step[i]], []).append(i)
            if not groups:
                break

            def fetch(node: str) -> list[Any]:
                idxs = groups[node]
                bufs = [out[i] for i in idxs] if out is not None else None
                return self.directory.client(by_id[node]).get(
                    namespace,
                    [hashes[i] for i in idxs],
                    out=bufs,
                    allow_missing=True,
                    verify=verify,
                    codec=codec,
                    lossy_ok=lossy_ok,
                )

            replies = self._each(list(groups), fetch, member_of=by_id.__getitem__)
            for node, idxs in groups.items():
                got = replies.get(node)
                for j, i in enumerate(idxs):
                    if got is not None and got[j] is not None:
                        results[i] = got[j]
                        pending.discard(i)
                    else:
                        step[i] += 1
        missing = [i for i, r in enumerate(results) if r is None]
        if missing and not allow_missing:
            i = missing[0]
            raise KVStoreError(
                grpc.StatusCode.NOT_FOUND,
                f"block {i} ({hashes[i].hex()}) is not held by any reachable store node "
                f"({len(missing)} of {len(hashes)} blocks unavailable)",
            )
        return results

    def _candidates(
        self, namespace: str, hashes: Sequence[bytes], live: list[NodeInfo], recent: list[NodeInfo]
    ) -> list[list[str]]:
        """Per block, node ids to try in order: the index's holders (best tier, then rendezvous order), then
        every other live node in rendezvous order of ``hashes[0]`` (the index lags puts), then nodes listed
        until a moment ago (Redis restarted and they have not registered again yet). With Redis down the
        holders are unknown and the list starts with the rendezvous order."""
        order = [m.id for m in routing.rank(hashes[0], live)] + [m.id for m in routing.rank(hashes[0], recent)]
        found = self._holders(namespace, hashes)
        if found is None:
            return [order for _ in hashes]
        pos = {node: k for k, node in enumerate(order)}
        out = []
        for held in found:
            first = sorted((n for n in held if n in pos), key=lambda n: (held[n], pos[n]))
            out.append(first + [n for n in order if n not in held])
        return out

    # -- delete / stats ----------------------------------------------------------------------------
    def delete(self, namespace: str, hashes: Sequence[bytes]) -> int:
        nodes = self.directory.live() + self.directory.recent()
        replies = self._each(nodes, lambda m: self.directory.client(m).delete(namespace, hashes))
        return sum(n for n in replies.values() if n is not None)

    def stats(self, namespace: str = "") -> dict[str, Any]:
        members = self.directory.members()
        replies = self._each(members, lambda m: self.directory.client(m).stats(namespace))
        nodes: dict[str, Any] = {}
        tiers: dict[str, dict[str, Any]] = {}
        for m in members:
            s = replies.get(m.id)
            nodes[m.id] = s if s is not None else {"error": "unreachable", "addr": m.addr}
            for t in (s or {}).get("tiers", []):  # per tier name: numbers summed, flags or-ed, text from one node
                agg = tiers.setdefault(t["name"], {})
                for k, v in t.items():
                    if isinstance(v, bool):
                        agg[k] = agg.get(k, False) or v
                    elif isinstance(v, (int, float)):
                        agg[k] = agg.get(k, 0) + v
                    else:
                        agg.setdefault(k, v)
        ok = [s for s in replies.values() if s is not None]
        return {
            "node_id": f"cluster via {self.connector.safe_url}",
            "redis_up": self.directory.redis_up,
            "redis_mode": self.connector.mode or "unknown",
            "members": [dataclasses.asdict(m) for m in members],
            "nodes": nodes,
            "blocks": sum(int(s.get("blocks", 0)) for s in ok),
            "lookups": sum(int(s.get("lookups", 0)) for s in ok),
            "lookup_hits": sum(int(s.get("lookup_hits", 0)) for s in ok),
            "lookup_misses": sum(int(s.get("lookup_misses", 0)) for s in ok),
            "lookup_hashes": sum(int(s.get("lookup_hashes", 0)) for s in ok),
            "tiers": list(tiers.values()),
        }

    # -- fan-out ---------------------------------------------------------------------------------------
    def _each(
        self, items: Sequence[Any], call: Callable[[Any], T], member_of: Callable[[Any], NodeInfo] | None = None
    ) -> dict[str, T | None]:
        """``call(item)`` for every item in parallel; a node's failure yields None (and marks it down)."""
        member_of = member_of or (lambda m: m)

        def guarded(item: Any) -> T | None:
            member = member_of(item)
            try:
                return call(item)
            except KVStoreError as err:
                if err.code in NODE_FAILURES:
                    self.directory.mark_down(member, err)
                elif err.code not in NODE_MISSES:
                    raise
                else:
                    log.info("store node %s: %s", member.id, err)
            except (OSError, grpc.RpcError) as err:
                self.directory.mark_down(member, err)
            return None

        ids = [member_of(item).id for item in items]
        if len(items) == 1:
            return {ids[0]: guarded(items[0])}
        futures = [self._pool.submit(guarded, item) for item in items]
        return {node: f.result() for node, f in zip(ids, futures)}
