"""The index publisher: mirrors which blocks this node holds into the global index in Redis.

Verbs:

- ``IndexPublisher(store, connector, membership, ttl=...)`` subscribes to the store's
  copy events; ``start()`` runs the publisher thread; ``stop(unlink=True)`` flushes,
  stops and (graceful shutdown) deletes this node's index keys.
- ``request_resync()``: rebuild the node's whole index (after lost events or lost keys).

Data flow: the store calls ``_on_event`` with its lock held, so that only appends
(namespace, hash) to a bounded deque. Every ``flush_interval`` seconds, or sooner
when ``batch`` events are waiting, the thread drains the deque into a coalescing
set (a block added, demoted and evicted within one interval is written once),
reads each block's current top tier from the store (``StoreView``) and writes one
pipeline of HSET/HDEL/PEXPIRE per ``batch`` blocks. Every ``ttl / 3`` seconds it
refreshes the PEXPIRE of all its keys; a node that dies stops doing that and its
entries expire within ``ttl``.

A full resync writes a snapshot of the node under a fresh random index id, flushes the events that arrived meanwhile into it, advertises the
id in the node's membership (readers switch over at once) and unlinks the old
keys. It runs at start, when the bounded deque or the coalescing set overflowed
(the oldest events were dropped: ``cluster_index_dropped_events``), when a refresh
finds a key that should exist gone, and when membership reports it was lost.

Failure semantics: on a Redis error the batch stays pending, the thread backs off
(50 ms doubling to 2 s) and counts ``cluster_index_publish_failures``; the data path
never waits. Gauges: ``cluster_index_pending``, ``cluster_index_id``,
``cluster_index_keys``; counters ``cluster_index_published``, ``cluster_index_resyncs``.
"""

from __future__ import annotations

import collections
import itertools
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvstore.cluster import index
from kvstore.cluster.connect import REDIS_ERRORS, RedisClient, RedisConnector
from kvstore.cluster.keys import DEFAULT_SHARDS, KeyLayout
from kvstore.cluster.membership import Membership
from kvstore.cluster.storeview import StoreView
from kvstore.store import BlockStore

log = logging.getLogger("kvstore.cluster.publisher")


@dataclass(frozen=True)
class PublisherOptions:
    shards: int = DEFAULT_SHARDS
    flush_interval: float = 0.02  # seconds between flushes
    batch: int = 4096  # blocks per pipeline; this many waiting events wake the thread early
    max_pending: int = 200_000  # bound of the event deque and of the coalescing set
    snapshot_chunk: int = 16384  # blocks per pipeline during a resync


class IndexPublisher:
    def __init__(
        self,
        store: BlockStore,
        connector: RedisConnector,
        membership: Membership,
        *,
        ttl: float,
        layout: KeyLayout = KeyLayout(),
        metrics: Any = None,
        options: PublisherOptions = PublisherOptions(),
    ):
        self.view = StoreView(store)
        self.connector, self.membership, self.layout, self.metrics = connector, membership, layout, metrics
        self.ttl, self.opt = ttl, options
        self.index_id = 0
        self._owned: dict[bytes, int] = {}  # index key -> fields this node wrote there
        self._events: collections.deque[tuple[str, bytes]] = collections.deque()
        self._dirty: dict[tuple[str, bytes], None] = {}
        self._resync_needed = True
        self._resyncing = False  # a resync is under way: pending until its snapshot is advertised
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_refresh = 0.0
        self._last_refresh_ok = time.monotonic()
        self.published = 0
        store.subscribe(self._on_event)

    # -- verbs --------------------------------------------------------------------------------
    def start(self) -> IndexPublisher:
        self._thread = threading.Thread(target=self._loop, name="kvstore-index-publisher", daemon=True)
        self._thread.start()
        return self

    def request_resync(self) -> None:
        self._resync_needed = True
        self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._events) + len(self._dirty) + (1 if self._resync_needed or self._resyncing else 0)

    def stop(self, unlink: bool = True) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if not unlink or not self._owned:
            return
        try:
            pipe = self.connector.get().pipeline(transaction=False)
            for name in self._owned:
                pipe.unlink(name)
            pipe.execute()
        except REDIS_ERRORS as err:
            log.warning("could not delete this node's index keys (%s); they expire in %.0fs", err, self.ttl)

    # -- store events (store lock held: append only) ---------------------------------------------
    def _on_event(self, event: str, namespace: str, key: bytes, rank: int) -> None:
        if self._stop.is_set():
            return  # stopped (the store has no unsubscribe): nothing would drain the queue
        q = self._events
        if len(q) >= self.opt.max_pending:
            q.popleft()
            self._resync_needed = True
            if self.metrics is not None:
                self.metrics.add("cluster_index_dropped_events")
        q.append((namespace, key))
        if len(q) >= self.opt.batch:
            self._wake.set()

    # -- the thread --------------------------------------------------------------------------------
    def _loop(self) -> None:
        backoff = 0.05
        while True:
            stopping = self._stop.is_set()
            try:
                client = self.connector.get()
                if self._resync_needed:
                    self._resync(client)
                self._drain()
                self._flush(client)
                if time.monotonic() >= self._next_refresh:
                    self._refresh(client)
                self.connector.ok()
                backoff = 0.05
                wait = self.opt.flush_interval
            except REDIS_ERRORS as err:
                self.connector.failed(err)
                self._drain()
                if self.metrics is not None:
                    self.metrics.add("cluster_index_publish_failures")
                log.debug("index publish failed: %s", err)
                wait, backoff = backoff, min(backoff * 2, 2.0)
            self._gauges()
            if stopping:
                return
            self._wake.wait(wait)
            self._wake.clear()

    def _drain(self) -> None:
        q, dirty = self._events, self._dirty
        while q:
            try:
                dirty[q.popleft()] = None
            except IndexError:
                break
        if len(dirty) > self.opt.max_pending:
            if self.metrics is not None:
                self.metrics.add("cluster_index_dropped_events", len(dirty))
            dirty.clear()
            self._resync_needed = True

    def _flush(self, client: RedisClient) -> None:
        while self._dirty:
            items = list(itertools.islice(self._dirty, self.opt.batch))
            ranks = self.view.top_ranks(items)
            self._write(client, self.index_id, self._owned, [(ns, k, r) for (ns, k), r in zip(items, ranks)])
            for item in items:
                del self._dirty[item]

    def _write(
        self, client: RedisClient, index_id: int, owned: dict[bytes, int], states: list[tuple[str, bytes, int]]
    ) -> None:
        pipe = client.pipeline(transaction=False)
        queued = index.write(pipe, self.layout, index_id, self.opt.shards, states, int(self.ttl * 1000))
        for (name, sign), reply in zip(queued, pipe.execute()):
            if sign:
                count = owned.get(name, 0) + sign * int(reply)
                owned[name] = max(count, 0)
        self.published += len(states)
        if self.metrics is not None:
            self.metrics.add("cluster_index_published", len(states))

    def _refresh(self, client: RedisClient) -> None:
        now = time.monotonic()
        if self._owned and now - self._last_refresh_ok >= self.ttl * 0.9:
            log.warning(
                "index keys were not refreshed for %.1fs: they may have expired; resyncing", now - self._last_refresh_ok
            )
            self.request_resync()
        names = list(self._owned)
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.pexpire(name, int(self.ttl * 1000))
        for name, alive in zip(names, pipe.execute()):
            if not alive:
                if self._owned.pop(name, 0) > 0:
                    log.warning("index key %r vanished from Redis: resyncing", name)
                    self.request_resync()
        self._last_refresh_ok = now
        self._next_refresh = now + self.ttl / 3

    def _resync(self, client: RedisClient) -> None:
        self._resyncing = True  # before the flag below clears, so `pending` never reads 0 mid-resync
        self._resync_needed = False
        try:
            self._events.clear()  # everything reported so far is covered by the snapshot below
            self._dirty.clear()
            new_id = secrets.randbits(48) | 1  # unique without a counter that an empty Redis would restart
            owned: dict[bytes, int] = {}
            blocks = 0
            for chunk in self.view.snapshot(self.opt.snapshot_chunk):
                self._write(client, new_id, owned, chunk)
                blocks += len(chunk)
                self._drain()
            old_id, old_owned = self.index_id, self._owned
            self.index_id, self._owned = new_id, owned
            self._flush(client)
            self.membership.update(index=new_id)
        except BaseException:
            self._resync_needed = True
            raise
        finally:
            self._resyncing = False  # advertised (or failed, and needed again)
        self._last_refresh_ok = time.monotonic()
        self._next_refresh = self._last_refresh_ok + self.ttl / 3
        if self.metrics is not None:
            self.metrics.add("cluster_index_resyncs")
        log.info("index resynced: %d blocks under index id %d (was %d)", blocks, new_id, old_id)
        if old_owned:
            pipe = client.pipeline(transaction=False)
            for name in old_owned:
                pipe.unlink(name)
            pipe.execute(raise_on_error=False)

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.set("cluster_index_pending", float(self.pending))
            self.metrics.set("cluster_index_id", float(self.index_id))
            self.metrics.set("cluster_index_keys", float(len(self._owned)))
