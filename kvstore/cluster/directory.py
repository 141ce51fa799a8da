"""The cluster client's directory: live members, one gRPC client per member, nodes marked down.

Verbs:

- ``members() -> [NodeInfo]``: the live members from Redis, re-read when the cached
  list is older than ``refresh`` seconds. When Redis cannot be read the last list
  is kept (``redis_up`` turns False) and, before any list was ever read, the
  ``static`` addresses given to the client stand in (without index ids).
- ``live() -> [NodeInfo]``: members not marked down.
- ``recent() -> [NodeInfo]``: nodes listed within the last ``linger`` seconds that are
  not listed now (nor marked down). After Redis restarts empty, members register
  again one heartbeat at a time; until then their blocks are still reachable by
  asking them directly, so ``get`` falls back to these too.
- ``client(member) -> NodeClient``: the per-node client, created on first use and
  replaced when the member restarts (a new incarnation gets a fresh channel, so
  no gRPC reconnect backoff of the dead process carries over).
- ``redis_failed(err)``: Redis failed a read; ``redis_up`` is False until the next
  member list is read.
- ``mark_down(member, why)``: skip a node that just failed for ``down_for``
  seconds (its requests fall over to the next holder instead of timing out again).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvstore.cluster.connect import REDIS_ERRORS, RedisConnector
from kvstore.cluster.keys import KeyLayout
from kvstore.cluster.membership import NodeInfo, read_members
from kvstore.lanes.shared_pool import SharedPool
from kvstore.node_client import NodeClient

log = logging.getLogger("kvstore.cluster.client")


class Directory:
    def __init__(
        self,
        connector: RedisConnector,
        layout: KeyLayout,
        *,
        refresh: float = 1.0,
        down_for: float = 2.0,
        linger: float = 10.0,
        static: Sequence[str] = (),
        client_options: dict[str, Any] | None = None,
    ):
        self.connector, self.layout, self.refresh, self.down_for = connector, layout, refresh, down_for
        self.linger = linger
        self._seen: dict[str, tuple[NodeInfo, float]] = {}  # node id -> (info, last listed)
        self._static = [NodeInfo(id=addr, addr=addr, incarnation="static") for addr in static]
        self._options = dict(client_options or {})
        self._members: list[NodeInfo] | None = None
        self._read_at = -1e9
        self._clients: dict[str, tuple[str, NodeClient]] = {}  # node id -> (incarnation, client)
        self._down: dict[str, float] = {}  # node id -> until (monotonic)
        self._pools: list[SharedPool] = []  # offered to every node's client, those made later too
        self._lock = threading.Lock()
        self.redis_up = False

    def members(self) -> list[NodeInfo]:
        now = time.monotonic()
        if self._members is not None and now - self._read_at < self.refresh:
            return self._members
        with self._lock:
            if self._members is not None and now - self._read_at < self.refresh:
                return self._members
            try:
                members = read_members(self.connector.get(), self.layout)
            except REDIS_ERRORS as err:
                self.connector.failed(err)
                self.redis_failed(err)
                self._read_at = now  # do not retry on every call; the connector backs off too
                return self._members if self._members is not None else self._static
            self.connector.ok()
            self.redis_up = True
            self._members, self._read_at = members, now
            for m in members:
                self._seen[m.id] = (m, now)
            for node_id in [n for n, (_, seen) in self._seen.items() if now - seen > self.linger]:
                del self._seen[node_id]
            self._forget_gone()
            return members

    def redis_failed(self, err: object) -> None:
        """Redis could not be read: route without the index until the next successful refresh."""
        if self.redis_up:
            log.warning(
                "Redis unreachable (%s): asking the last known %d members directly",
                err,
                len(self._members or self._static),
            )
        self.redis_up = False

    def live(self) -> list[NodeInfo]:
        now = time.monotonic()
        return [m for m in self.members() if self._down.get(m.id, 0.0) <= now]

    def recent(self) -> list[NodeInfo]:
        listed = {m.id for m in self.members()}
        return [m for node_id, (m, _) in self._seen.items() if node_id not in listed and not self.is_down(node_id)]

    def is_down(self, node_id: str) -> bool:
        return self._down.get(node_id, 0.0) > time.monotonic()

    def mark_down(self, member: NodeInfo, why: object) -> None:
        log.info("store node %s (%s) failed: %s; skipping it for %.1fs", member.id, member.addr, why, self.down_for)
        self._down[member.id] = time.monotonic() + self.down_for

    def client(self, member: NodeInfo) -> NodeClient:
        with self._lock:
            held = self._clients.get(member.id)
            if held is not None and held[0] == member.incarnation:
                return held[1]
            client = NodeClient(member.addr, **self._options)
            for pool in self._pools:
                client.offer_pool(pool)
            self._clients[member.id] = (member.incarnation, client)
            self._down.pop(member.id, None)
        if held is not None:
            held[1].close()
        return client

    def add_pool(self, pool: SharedPool) -> None:
        """Offer ``pool`` to every node's client, now and as they are made (only a node on this host maps it)."""
        with self._lock:
            self._pools.append(pool)
            for _, client in self._clients.values():
                client.offer_pool(pool)

    def close(self) -> None:
        with self._lock:
            clients, self._clients = self._clients, {}
        for _, client in clients.values():
            client.close()

    def _forget_gone(self) -> None:
        """Lock held: close the clients of nodes no longer listed nor lingering."""
        for node_id in [n for n in self._clients if n not in self._seen]:
            _, client = self._clients.pop(node_id)
            self._down.pop(node_id, None)
            client.close()
