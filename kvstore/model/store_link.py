"""The bridge between a worker's paged KV pool and the store.

Verbs:
- ``prompt_hashes(tokens)``: the chained hashes of the prompt's full blocks.
- ``fetch_prefix(pool, seq_id, hashes, max_blocks) -> Fetched``: Lookup, then
  Get the leading cached blocks **straight into freshly allocated pool blocks**
  (the client writes the received chunks into the pool's memory: one copy per
  block on this side). Any store failure (unreachable, a block vanished, a
  checksum mismatch) frees what was fetched and returns zero blocks: the caller
  recomputes, and ``recompute_fallbacks`` counts it. Wrong KV is never used.
- ``planner`` (``kvstore.loadplan.Planner``), ``policy`` ("decide", "load" or
  "recompute") and ``loader`` (a thread for loads that overlap compute) serve
  ``kvstore.model.planned.prefill_planned``, which both workers use: how many
  cached blocks to load is decided per request from measured costs.
- ``BlockUploader``: puts full blocks from the pool on a background thread
  while the model computes the next chunk (chunked prefill overlaps transfer).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.client import Client, KVStoreError
from kvstore.hashing import block_hashes
from kvstore.lanes.shared_pool import huge_pages_likely
from kvstore.loadplan import Planner
from kvstore.model.llama import LlamaModel
from kvstore.model.paged import PagedKVPool

log = logging.getLogger(__name__)

SHARED_POOL_CHOICES = ("auto", "always", "never")


@dataclass
class Fetched:
    blocks: int = 0
    bytes: int = 0
    lookup_s: float = 0.0
    transfer_s: float = 0.0
    load_s: float = 0.0
    failed: str = ""


@dataclass
class LinkCounters:
    recompute_fallbacks: int = 0
    fetched_blocks: int = 0
    stored_blocks: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    errors: list[str] = field(default_factory=list)


class StoreLink:
    def __init__(
        self,
        model: LlamaModel,
        target: str | None,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        planner: Planner | None = None,
        policy: str = "decide",
        lane: str = "auto",
        shared_pool: str = "auto",
    ):
        """``shared_pool``: whether ``pool_memory`` shares the worker's KV pool with a store on this host:
        "auto" (when it would be in huge pages), "always" or "never"."""
        if shared_pool not in SHARED_POOL_CHOICES:
            raise ValueError(f"shared_pool must be one of {SHARED_POOL_CHOICES}, not {shared_pool!r}")
        self.shared_pool = shared_pool
        self.model = model
        self.fingerprint = model.config.fingerprint()
        self.block_size = model.config.block_size
        self.client = Client(target, token=token, timeout=timeout, retries=1, lane=lane) if target else None
        self.counters = LinkCounters()
        self._lock = threading.Lock()
        self.planner = planner or Planner()
        self.policy = policy
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="kv-load")
        self._requests = 0

    def prompt_hashes(self, tokens: Sequence[int], namespace: str) -> list[bytes]:
        return block_hashes(tokens, self.block_size, namespace, self.fingerprint)

    def fetch_prefix(
        self, pool: PagedKVPool, seq_id: object, namespace: str, hashes: Sequence[bytes], max_blocks: int
    ) -> Fetched:
        out = Fetched()
        if self.client is None or not hashes or max_blocks <= 0:
            return out
        t0 = time.perf_counter()
        try:
            n = min(self.client.lookup(namespace, hashes), max_blocks)
        except KVStoreError as err:
            return self._fallback(out, f"lookup: {err}")
        out.lookup_s = time.perf_counter() - t0
        if n == 0:
            return out
        ids = pool.manager.extend_full(seq_id, n)
        views = [pool.block_bytes_view(b).numpy() for b in ids]
        t1 = time.perf_counter()
        try:
            self.client.get(namespace, hashes[:n], out=views)
        except (KVStoreError, ValueError) as err:
            pool.free_sequence(seq_id)
            pool.add_sequence(seq_id)
            return self._fallback(out, f"get: {err}")
        out.transfer_s = time.perf_counter() - t1  # received chunks land in the pool: transfer includes the load
        pool.add_hashes(seq_id, hashes[:n])
        out.blocks, out.bytes = n, n * pool.block_nbytes
        with self._lock:
            self.counters.fetched_blocks += n
            self.counters.bytes_in += out.bytes
        return out

    def _fallback(self, out: Fetched, why: str) -> Fetched:
        log.warning("store unavailable for this request, recomputing: %s", why)
        self.record_fallback(why)
        out.failed = why
        return out

    def record_fallback(self, why: str) -> None:
        """A request recomputes (all or part of) what the store holds, because of ``why``."""
        with self._lock:
            self.counters.recompute_fallbacks += 1
            self.counters.errors = (self.counters.errors + [why])[-20:]

    def seed_planner(self, every: int = 64) -> None:
        """Every ``every`` requests (the first included), give the planner priors from the server's Stats
        (its NVMe read speed) and the client's codec controller (the link bandwidth it measured)."""
        self._requests += 1
        if self.client is None or (self._requests - 1) % every:
            return
        try:
            counters = self.client.stats().get("counters", {})
        except KVStoreError:
            return
        codec_stats = getattr(self.client, "codec_stats", None)  # a cluster client has no one codec controller
        self.planner.seed(counters, codec_stats() if codec_stats else {}, self.lane_kind())

    def connect(self) -> str:
        """Open the data lane now and warm it (``warm_up``), so that a worker's first requests do not pay for it:
        its negotiation, shared region and handshake (50-110 ms here before a first Get of 64 x 720 KiB,
        forty-seventh session), then the kernels and the NVMe reader's threads (``bench.first_gets``, 49 x 720 KiB
        from NVMe: the first Get 2.40x a warm one's time on the ``--share-nvme`` lane and 4.50x on TCP after the
        lane alone, 1.03x and 1.09x warmed; fifty-second session); the lane's kind, "cluster" for a cluster client
        (its kernels warmed, one lane per node opened as used), "" with no store or none reachable (the worker
        starts anyway, and recomputes)."""
        if self.client is None:
            return ""
        try:
            kind: str = self.client.warm_up()
        except KVStoreError as err:
            log.warning("store unreachable at start-up (%s): its lane opens with the first request", err)
            return ""
        return kind

    def pool_memory(self, nbytes: int) -> np.ndarray | None:
        """Host memory for the worker's paged KV pool that the store can read Gets straight into: a
        ``SharedPool`` (the client's ``shared_pool``) when the store is on this host (the shm lane opened; a
        cluster client offers it to every node, and the one on this host maps it) and, with
        ``shared_pool="auto"``, the pool would be in huge pages; else None (the pool takes memory of its own, in
        transparent huge pages). In a shared pool a Get's DRAM hits take a memcpy through the store's
        mapping in place of ``process_vm_writev``, and its NVMe hits read by the store land in place (huge pages)
        or take that memcpy too (docs/nvme.md, "Gets into a shared pool"). Not in 4 KiB pages by default: the
        worker's own O_DIRECT reads of the store's NVMe files (``--share-nvme``) land in its pool too, and ran
        slower into 4 KiB pages."""
        if self.client is None or self.shared_pool == "never":
            return None
        if self.shared_pool == "auto" and not huge_pages_likely(nbytes):
            log.info("KV pool not shared with the store: it would be in 4 KiB pages (see --shared-pool)")
            return None
        if self.connect() not in ("shm", "cluster"):  # a cluster client offers it to every node: the local one maps it
            return None
        pool = self.client.shared_pool(nbytes, "kvstore-kv-pool")
        log.info(
            "KV pool shared with the store: %d MiB, %s pages", nbytes >> 20, "huge" if pool.huge_pages else "4 KiB"
        )
        memory: np.ndarray = pool.array
        return memory

    def lane_kind(self) -> str:
        """The client's data lane ("shm", "tcp", ...; "cluster" for a cluster client, which has one per node)."""
        return getattr(self.client, "lane_kind", "cluster")

    def count_fetched(self, blocks: int, nbytes: int) -> None:
        with self._lock:
            self.counters.fetched_blocks += blocks
            self.counters.bytes_in += nbytes

    def close(self) -> None:
        self.loader.shutdown(wait=True)
        if self.client is not None:
            self.client.close()


class BlockUploader:
    """Puts pool blocks on a background thread, in order; ``finish()`` waits and reports."""

    def __init__(self, link: StoreLink, pool: PagedKVPool, namespace: str):
        self.link, self.pool, self.namespace = link, pool, namespace
        # (hashes, payloads: pool block views, parent); None: stop
        self._queue: queue.Queue[tuple[list[bytes], list[Any], bytes | None] | None] = queue.Queue()
        self.stored = 0
        self.bytes = 0
        self.error = ""
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-uploader")
        self._thread.start()

    def submit(self, hashes: Sequence[bytes], payloads: Sequence[object], parent: bytes | None) -> None:
        """Payloads must stay unchanged until finish(): pass pool block views of a live sequence."""
        if hashes:
            self._queue.put((list(hashes), list(payloads), parent))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            hashes, payloads, parent = item
            client = self.link.client
            if client is None or self.error:
                continue
            try:
                results = client.put(
                    self.namespace, hashes, payloads, parent=parent, dtype=self.link.model.config.dtype
                )
                self.stored += sum(r.status == "stored" for r in results)
                self.bytes += sum(p.numel() if hasattr(p, "numel") else len(p) for p in payloads)
            except KVStoreError as err:
                self.error = str(err)
                log.warning("put failed, later blocks of this prompt are not stored: %s", err)

    def finish(self) -> float:
        """Wait for every submitted put; returns the seconds spent waiting."""
        t0 = time.perf_counter()
        self._queue.put(None)
        self._thread.join()
        with self.link._lock:
            self.link.counters.stored_blocks += self.stored
            self.link.counters.bytes_out += self.bytes
        return time.perf_counter() - t0
