"""Membership: which store nodes are alive, where they listen, and which index snapshot is theirs.

Verbs:

- ``Membership(connector, info, ttl).start()``: a background thread registers the node
  and heartbeats every ``ttl / 3`` seconds. A heartbeat is one Lua call that reads the
  Redis clock (so host clocks never matter), pushes this node's deadline ``ttl`` ahead
  in ``kv:{m}:nodes``, rewrites its NodeInfo in ``kv:{m}:info`` and prunes members
  whose deadline passed. A node that stops heartbeating is not listed after ``ttl``
  seconds.
- ``update(**fields)``: change the advertised NodeInfo (e.g. a new index id after a
  resync) and heartbeat now.
- ``stop(deregister=True)``: graceful shutdown removes the node at once.
- ``read_members(client, layout) -> [NodeInfo]``: the live members, one Lua call
  (clients and benchmarks use it).

Failure semantics: while Redis is unreachable the thread retries with backoff
(never longer than the heartbeat interval), sets the ``redis_up`` gauge to 0 and
counts ``cluster_heartbeat_failures``; the node keeps serving. When a heartbeat
succeeds after the node's entry (and so its index keys) may have been lost (Redis
restarted empty, or the outage outlasted the TTL), ``on_lost`` is called so the
index publisher resyncs.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvstore.cluster.connect import REDIS_ERRORS, RedisClient, RedisConnector
from kvstore.cluster.keys import DEFAULT_SHARDS, KeyLayout

log = logging.getLogger("kvstore.cluster.membership")

_BEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #dead > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  redis.call('HDEL', KEYS[2], unpack(dead))
end
local added = redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
return added
"""

_MEMBERS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
if #ids == 0 then return {} end
return redis.call('HMGET', KEYS[2], unpack(ids))
"""

_LEAVE = """
local cur = redis.call('HGET', KEYS[2], ARGV[1])
if cur and cjson.decode(cur)['incarnation'] == ARGV[2] then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
  return 1
end
return 0
"""


@dataclass(frozen=True)
class NodeInfo:
    id: str
    addr: str  # HOST:PORT clients dial
    incarnation: str  # new on every process start
    index: int = 0  # id of the node's current index snapshot (0: none yet)
    shards: int = DEFAULT_SHARDS  # index shards per namespace
    weight: float = 1.0  # rendezvous weight (capacity in bytes)
    tiers: list[dict[str, Any]] = field(default_factory=list)
    lanes: list[str] = field(default_factory=list)
    started: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeInfo:
        raw = json.loads(text)
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def read_members(client: RedisClient, layout: KeyLayout) -> list[NodeInfo]:
    replies = client.register_script(_MEMBERS)(keys=[layout.nodes, layout.info])
    return sorted((NodeInfo.from_json(r) for r in replies if r), key=lambda m: m.id)


class Membership:
    def __init__(
        self,
        connector: RedisConnector,
        info: NodeInfo,
        *,
        ttl: float,
        layout: KeyLayout = KeyLayout(),
        metrics: Any = None,
        on_lost: Callable[[], None] | None = None,
    ):
        self.connector, self.layout, self.ttl = connector, layout, ttl
        self.metrics, self.on_lost = metrics, on_lost
        self._info = info
        self._lock = threading.Lock()  # one heartbeat at a time (thread and update())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._registered = False
        self._last_ok = 0.0
        self.up = False

    @property
    def info(self) -> NodeInfo:
        return self._info

    @property
    def interval(self) -> float:
        return self.ttl / 3

    # -- verbs ----------------------------------------------------------------------------
    def start(self) -> Membership:
        self._thread = threading.Thread(target=self._loop, name="kvstore-membership", daemon=True)
        self._thread.start()
        return self

    def update(self, **fields: Any) -> None:
        """Advertise new NodeInfo fields; heartbeats now (raises on a Redis error)."""
        self._info = replace(self._info, **fields)
        self.beat()

    def beat(self) -> None:
        with self._lock:
            try:
                client = self.connector.get()
                added = client.register_script(_BEAT)(
                    keys=[self.layout.nodes, self.layout.info],
                    args=[self._info.id, int(self.ttl * 1000), self._info.to_json()],
                )
            except REDIS_ERRORS as err:
                self.connector.failed(err)
                self._set_up(False)
                if self.metrics is not None:
                    self.metrics.add("cluster_heartbeat_failures")
                raise
            now = time.monotonic()
            lost = self._registered and (bool(added) or now - self._last_ok >= self.ttl * 0.9)
            self.connector.ok()
            self._registered, self._last_ok = True, now
            self._set_up(True)
        if lost:
            log.warning(
                "membership of %s was lost (Redis restarted or unreachable for the TTL): resyncing", self._info.id
            )
            if self.on_lost is not None:
                self.on_lost()

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if not deregister:
            return
        try:
            client = self.connector.get()
            client.register_script(_LEAVE)(
                keys=[self.layout.nodes, self.layout.info], args=[self._info.id, self._info.incarnation]
            )
        except REDIS_ERRORS as err:
            log.warning("could not deregister %s (%s); it drops out after %.0fs", self._info.id, err, self.ttl)

    # -- internals ------------------------------------------------------------------------
    def _set_up(self, up: bool) -> None:
        if up != self.up:
            log.info("Redis %s", "reachable" if up else f"unreachable ({self.connector.last_error})")
        self.up = up
        if self.metrics is not None:
            self.metrics.set("redis_up", 1.0 if up else 0.0)

    def _loop(self) -> None:
        wait, backoff = 0.0, 0.05
        while not self._stop.wait(wait):
            try:
                self.beat()
                wait, backoff = self.interval, 0.05
            except REDIS_ERRORS:
                wait, backoff = min(backoff, self.interval), min(backoff * 2, self.interval)
