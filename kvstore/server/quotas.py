"""Limits that keep one tenant (or one stuck client) from taking the node: bytes, streams, time.

- ``ByteQuotas``: bytes stored per quota bucket (a tenant, or the shared
  namespaces; see ``TenantRegistry.bucket_of``). ``admit(namespace, n)``
  answers before a block's slot is reserved: None, or a message saying whose
  quota is full. ``charge(namespace, n)`` counts a committed block at once, in
  O(1). Bytes leave the count when blocks leave the node (eviction, delete,
  corruption): the base figure is recomputed from the index's numpy columns
  (one vectorised pass, no per-block Python objects) only when a Put would
  otherwise be refused, at most every ``min_rescan_s``. The count is therefore
  never below the truth, so a quota is never exceeded by more than the blocks
  of Puts admitted concurrently (each at most the block size limit).
- ``StreamSlots``: concurrent streaming RPCs per tenant.
- ``DeadlineWatchdog``: every RPC ends by ``max_seconds`` after it started,
  whatever its client asked for: a client that stalls mid-stream is cut off
  with DEADLINE_EXCEEDED and its handler unwinds (freeing slots and leases).
- ``namespace_usage(store, ns)``: blocks and bytes of one namespace per tier,
  for Stats scoped to a namespace.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from kvstore.store import BlockStore
from kvstore.store.index import NO_LOC

log = logging.getLogger(__name__)


# -- usage from the index -------------------------------------------------------------------
def _columns(store: BlockStore, *names: str) -> list[np.ndarray]:
    """Current index columns cut to one length (a concurrent grow may swap them while we read)."""
    cols = [getattr(store.table, name) for name in names]
    n = min(len(c) for c in cols)
    return [c[:n] for c in cols]


def bytes_per_namespace(store: BlockStore) -> dict[str, int]:
    """Stored bytes of every namespace holding blocks (each block counted once, whatever its copies)."""
    live, ns, size = _columns(store, "live", "ns", "stored_len")
    totals = np.bincount(ns[live], weights=size[live].astype(np.float64))
    return {store.table.namespace_name(int(i)): int(totals[i]) for i in np.nonzero(totals)[0]}


@dataclass(frozen=True)
class TierUsage:
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int


@dataclass(frozen=True)
class NamespaceUsage:
    blocks: int
    bytes: int
    tiers: list[TierUsage]


def namespace_usage(store: BlockStore, namespace: str) -> NamespaceUsage:
    """Blocks and bytes of one namespace, in total and per tier (an O(index) vectorised pass)."""
    ns_id = store.table.namespace_id(namespace)
    live, ns, size, loc = _columns(store, "live", "ns", "stored_len", "loc")
    mine = live & (ns == ns_id) if ns_id is not None else np.zeros(len(live), dtype=bool)
    tiers = []
    for tier in store.tiers:
        here = mine & (loc[:, tier.rank] != NO_LOC)
        tiers.append(TierUsage(tier.name, tier.capacity_bytes, int(size[here].sum()), int(here.sum())))
    return NamespaceUsage(int(mine.sum()), int(size[mine].sum()), tiers)


# -- byte quotas -----------------------------------------------------------------------------
class ByteQuotas:
    def __init__(
        self,
        store: BlockStore,
        bucket_of: Callable[[str], str],
        quota_of: Callable[[str], int | None],
        min_rescan_s: float = 0.1,
    ):
        self.store, self.bucket_of, self.quota_of = store, bucket_of, quota_of
        self.min_rescan_s = min_rescan_s
        self._lock = threading.Lock()
        self._base: dict[str, int] = {}
        self._pending: dict[str, int] = {}
        self._scanned_at = -1e9
        self.rescans = 0

    def usage(self, bucket: str) -> int:
        """Bytes charged to `bucket` (never below the truth; exact right after a rescan)."""
        with self._lock:
            return self._base.get(bucket, 0) + self._pending.get(bucket, 0)

    def admit(self, namespace: str, nbytes: int) -> str | None:
        """None if a block of `nbytes` fits the quota of `namespace`'s bucket; else why not."""
        bucket = self.bucket_of(namespace)
        quota = self.quota_of(bucket)
        if not quota:
            return None
        used = self.usage(bucket)
        if used + nbytes > quota and time.monotonic() - self._scanned_at >= self.min_rescan_s:
            self.rescan()
            used = self.usage(bucket)
        if used + nbytes <= quota:
            return None
        whose = "the shared namespaces" if bucket.startswith("(") else f"tenant {bucket!r}"
        return (
            f"quota of {whose} is full: {used} of {quota} bytes stored and this block needs {nbytes} more; "
            f"delete blocks or ask the operator for a larger quota"
        )

    def charge(self, namespace: str, nbytes: int) -> None:
        """Count a block just committed in `namespace`."""
        bucket = self.bucket_of(namespace)
        with self._lock:
            self._pending[bucket] = self._pending.get(bucket, 0) + nbytes

    def rescan(self) -> None:
        """Recompute every bucket's bytes from the index (blocks evicted or deleted drop out here)."""
        with self._lock:
            snapshot = dict(self._pending)
            self._scanned_at = time.monotonic()
        base: dict[str, int] = {}
        for namespace, nbytes in bytes_per_namespace(self.store).items():
            bucket = self.bucket_of(namespace)
            base[bucket] = base.get(bucket, 0) + nbytes
        with self._lock:
            for bucket, n in snapshot.items():  # charges after the snapshot stay (maybe counted twice: safe side)
                left = self._pending.get(bucket, 0) - n
                if left > 0:
                    self._pending[bucket] = left
                else:
                    self._pending.pop(bucket, None)
            self._base = base
            self.rescans += 1


# -- concurrent streams --------------------------------------------------------------------
class StreamSlots:
    """Counts open streams per tenant; ``acquire`` fails instead of queueing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}

    def acquire(self, tenant: str, limit: int) -> bool:
        with self._lock:
            n = self._open.get(tenant, 0)
            if limit and n >= limit:
                return False
            self._open[tenant] = n + 1
            return True

    def release(self, tenant: str) -> None:
        with self._lock:
            n = self._open.get(tenant, 0) - 1
            if n > 0:
                self._open[tenant] = n
            else:
                self._open.pop(tenant, None)

    def open(self, tenant: str) -> int:
        with self._lock:
            return self._open.get(tenant, 0)


# -- deadlines -------------------------------------------------------------------------------
def expire(context: grpc.ServicerContext, message: str) -> None:
    """End a server-side call now with DEADLINE_EXCEEDED (CANCELLED where grpc offers no status)."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    if call is not None:
        try:
            from grpc._cython import cygrpc  # type: ignore[attr-defined]  # grpc-stubs leave out grpc._cython

            call.cancel(cygrpc.StatusCode.deadline_exceeded, message)
            return
        except Exception:  # an older or newer grpc without this call: fall back to the public verb
            log.debug("cancel with status unavailable; cancelling plainly", exc_info=True)
    context.cancel()  # type: ignore[no-untyped-call]  # grpc-stubs declare RpcContext.cancel unannotated


class DeadlineWatchdog:
    """One thread ends calls that outlive ``max_seconds``; ``watch``/``unwatch`` are O(1)."""

    def __init__(self, max_seconds: float, on_expire: Callable[[str], None] | None = None):
        self.max_seconds = max_seconds
        self.tick = min(0.25, max_seconds / 4)
        self.on_expire = on_expire
        self._lock = threading.Lock()
        self._calls: dict[int, tuple[float, Any, str]] = {}
        self._next = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.expired = 0

    def watch(self, context: grpc.ServicerContext, method: str) -> int:
        with self._lock:
            self._next += 1
            self._calls[self._next] = (time.monotonic() + self.max_seconds, context, method)
            return self._next

    def unwatch(self, token: int) -> None:
        with self._lock:
            self._calls.pop(token, None)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvstore-deadlines", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.tick):
            now = time.monotonic()
            with self._lock:
                due = [(k, v) for k, v in self._calls.items() if v[0] <= now]
                for k, _ in due:
                    del self._calls[k]
            for _, (_, context, method) in due:
                self.expired += 1
                log.info("%s ran past the server's %.0f s limit: ended", method, self.max_seconds)
                if self.on_expire is not None:  # counted first: a client that sees the error sees the count too
                    self.on_expire(method)
                expire(
                    context,
                    f"{method} ran longer than the server allows ({self.max_seconds:g} s, "
                    f"--max-rpc-seconds); split the request or send it faster",
                )
