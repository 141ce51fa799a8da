"""Worker side of the connector: runs in each vLLM worker process and moves the KV bytes a ``StepPlan`` names.

Verbs and promises:

- ``register(kv_caches)`` (vLLM's ``register_kv_caches``): views the cache as one store block per vLLM block
  (``cache_blocks.CacheBlocks``).
- ``load(plan)`` (``start_load_kv``, before the forward pass, synchronous): each load run is fetched with
  Gets of ``load_chunk`` blocks into a staging buffer and scattered into the KV cache; the next chunk's Get
  runs on a helper thread while the current one is scattered. A chunk that fails (store unreachable, a
  block missing, a CRC32C mismatch, the store lost mid-load) fails the rest of its run: those block ids are
  zeroed and reported by ``take_load_errors`` (``get_block_ids_with_load_errors``), so vLLM recomputes
  them; the blocks before stay loaded. Nothing wrong is ever left for the forward pass to read.
- ``save(plan)`` (``wait_for_save``, after the forward pass): queues the step's save runs for the saver
  thread and returns at once. The saver gathers each chunk of blocks into its own staging buffer and Puts it
  (the store answers ``already_present`` for blocks another engine stored meanwhile). The blocks stay vLLM's
  until their request is reported by ``finished_sending``.
- ``preempting(plan)`` (``handle_preemptions``): waits for the saves of preempted requests, whose blocks
  vLLM is about to reuse.
- ``finished_sending(finished_req_ids) -> set`` (``get_finished``): requests that had saves, have finished,
  and whose saves are all done (stored, refused or failed: a save is best effort).
- ``close()`` (``shutdown``): drains the saver (bounded), closes the clients.

Copies per block (between the store's memory and the KV cache): see ``COPIES`` and docs in the report of
issue 16; the staging buffer adds one on every path because the lanes take one contiguous buffer per block.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.integrations.vllm.cache_blocks import CacheBlocks
from kvstore.integrations.vllm.plan import BlockRun, StepPlan
from kvstore.integrations.vllm.settings import ClientSlot
from kvstore.integrations.vllm.stats import StatsFile

log = logging.getLogger(__name__)

# Copies of each block's bytes between the store's arena and vLLM's KV cache, per path (this connector,
# single-buffer lanes). A lane taking a block as a list of per-layer buffers would save the staging copy.
COPIES = {
    "load:shm": 2,  # store -> staging (the server writes our buffer: process_vm_writev), staging -> cache
    "load:tcp": 3,  # arena -> socket (server), socket -> staging (recv_into), staging -> cache
    "load:grpc": 4,  # arena -> message, message -> staging, staging -> cache, plus protobuf's own copy
    "save:shm": 2,  # cache -> staging, staging -> arena (the server reads our memory: process_vm_readv)
    "save:tcp": 3,  # cache -> staging, staging -> socket (sendmsg), socket -> arena (server)
    "save:grpc": 4,
}


@dataclass
class WorkerCounters:
    load_runs: int = 0
    load_blocks: int = 0
    load_bytes: int = 0
    load_failed_blocks: int = 0
    load_failures: int = 0
    load_seconds: float = 0.0
    save_runs: int = 0
    save_blocks_sent: int = 0
    save_blocks_stored: int = 0
    save_blocks_present: int = 0
    save_blocks_rejected: int = 0
    save_failures: int = 0
    save_bytes: int = 0
    save_seconds: float = 0.0
    saves_in_flight: int = 0
    lane: str = ""
    copies_per_block_load: int = 0
    copies_per_block_save: int = 0
    cross_layer_view: bool = False
    block_bytes: int = 0


class WorkerSide:
    def __init__(
        self,
        client_factory: Callable[[], Any],
        *,
        dtype: str,
        load_chunk: int = 16,
        save_chunk: int = 16,
        saves: bool = True,
        stats: StatsFile | None = None,
    ):
        self.dtype = dtype
        self.load_chunk, self.save_chunk = load_chunk, save_chunk
        self.counters = WorkerCounters()
        self._stats = stats
        self._stats_lock = threading.Lock()
        self.blocks: CacheBlocks | None = None
        self._load_client = ClientSlot(client_factory)
        self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="kvstore-load")
        self._load_errors: set[int] = set()
        self._load_staging: list[torch.Tensor] = []
        self._saver = _Saver(self, save_chunk, client_factory) if saves else None
        self._save_reqs: set[str] = set()
        self._finished: set[str] = set()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.blocks = CacheBlocks.from_caches(kv_caches)
        self.counters.cross_layer_view = self.blocks.cross_layer_view
        self.counters.block_bytes = self.blocks.block_bytes
        # touched now: the first load would otherwise pay for faulting in tens of MB of fresh pages
        self._load_staging = [self.blocks.new_staging(self.load_chunk).zero_() for _ in range(2)]
        log.info(
            "kvstore connector: %d layers, %d blocks of %d bytes (%s)",
            self.blocks.layers,
            self.blocks.num_blocks,
            self.blocks.block_bytes,
            "one strided view per block" if self.blocks.cross_layer_view else "one copy per layer",
        )

    # -- loads -------------------------------------------------------------------------------------------
    def load(self, plan: StepPlan) -> None:
        if not plan.loads or self.blocks is None:
            return
        start = time.perf_counter()
        for run in plan.loads:
            self._load_run(run)
        self.counters.load_seconds += time.perf_counter() - start
        self._publish()

    def _fetch(self, run: BlockRun, lo: int, hi: int, staging: torch.Tensor) -> int:
        """Get blocks [lo, hi) of a run into staging rows; the number of leading blocks that arrived."""
        out = [staging[i] for i in range(hi - lo)]
        got = self._load_client.call(
            lambda c: c.get(run.namespace, list(run.hashes[lo:hi]), out=out, allow_missing=True)
        )
        for i, block in enumerate(got):
            if block is None:
                return i
        return hi - lo

    def _load_run(self, run: BlockRun) -> None:
        assert self.blocks is not None
        self.counters.load_runs += 1
        chunks = [(lo, min(lo + self.load_chunk, len(run))) for lo in range(0, len(run), self.load_chunk)]
        pending: Future[int] | None = self._fetcher.submit(self._fetch, run, *chunks[0], self._load_staging[0])
        failed_from: int | None = None
        for k, (lo, hi) in enumerate(chunks):
            assert pending is not None
            try:
                arrived = pending.result()
            except Exception as err:  # unreachable, CRC mismatch, lost mid-load: recompute from here
                log.warning("kvstore load of %s failed at block %d: %s", run.req_id, lo, err)
                failed_from, pending = lo, None
                break
            pending = None
            if arrived == hi - lo and k + 1 < len(chunks):
                pending = self._fetcher.submit(self._fetch, run, *chunks[k + 1], self._load_staging[(k + 1) % 2])
            self.blocks.scatter(run.block_ids[lo : lo + arrived], self._load_staging[k % 2])
            self.counters.load_blocks += arrived
            self.counters.load_bytes += arrived * self.blocks.block_bytes
            if arrived < hi - lo:
                log.warning("kvstore load of %s: block %d is no longer in the store", run.req_id, lo + arrived)
                failed_from = lo + arrived
                break
        if pending is not None:  # never leave a Get writing into a staging buffer the next run reuses
            try:
                pending.result()
            except Exception:
                pass
        if failed_from is not None:
            failed = run.block_ids[failed_from:]
            self.blocks.zero(failed)
            self._load_errors.update(failed)
            self.counters.load_failures += 1
            self.counters.load_failed_blocks += len(failed)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves -------------------------------------------------------------------------------------------
    def save(self, plan: StepPlan) -> None:
        if self._saver is None or not plan.saves or self.blocks is None:
            return
        for run in plan.saves:
            self._save_reqs.add(run.req_id)
            self._saver.submit(run)
        self._publish()  # saves_in_flight > 0 before the step's output reaches anyone waiting on it

    def preempting(self, plan: StepPlan) -> None:
        if self._saver is not None and plan.preempted & self._save_reqs:
            self._saver.wait_for(plan.preempted)

    def finished_sending(self, finished_req_ids: set[str]) -> set[str] | None:
        self._finished.update(r for r in finished_req_ids if r in self._save_reqs)
        if not self._finished or self._saver is None:
            return None
        done = {r for r in self._finished if not self._saver.outstanding(r)}
        self._finished -= done
        self._save_reqs -= done
        return done or None

    def close(self, timeout: float = 30.0) -> None:
        if self._saver is not None:
            self._saver.close(timeout)
        self._fetcher.shutdown(wait=True)
        self._load_client.close()
        self._publish()

    def _publish(self) -> None:
        c = self.counters
        client = self._load_client.client or (self._saver.slot.client if self._saver is not None else None)
        if client is not None and not c.lane:
            try:
                c.lane = str(client.lane_kind)
            except Exception:
                c.lane = "?"
        if c.lane:
            c.copies_per_block_load = COPIES.get(f"load:{c.lane}", 0)
            c.copies_per_block_save = COPIES.get(f"save:{c.lane}", 0)
        if self._saver is not None:
            c.saves_in_flight = self._saver.in_flight()
        if self._stats is not None:
            with self._stats_lock:
                self._stats.write(c)


class _Saver:
    """One thread that gathers and Puts save runs in order; counts what is outstanding per request."""

    def __init__(self, worker: WorkerSide, chunk: int, client_factory: Callable[[], Any]):
        self._worker, self._chunk = worker, chunk
        self._queue: queue.Queue[BlockRun | None] = queue.Queue()
        self._outstanding: defaultdict[str, int] = defaultdict(int)
        self._cond = threading.Condition()
        self.slot = ClientSlot(client_factory)
        self._staging: torch.Tensor | None = None
        self._thread = threading.Thread(target=self._loop, name="kvstore-save", daemon=True)
        self._thread.start()

    def submit(self, run: BlockRun) -> None:
        with self._cond:
            self._outstanding[run.req_id] += 1
        self._queue.put(run)

    def outstanding(self, req_id: str) -> int:
        with self._cond:
            return self._outstanding.get(req_id, 0)

    def in_flight(self) -> int:
        with self._cond:
            return sum(self._outstanding.values())

    def wait_for(self, req_ids: frozenset[str], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(self._outstanding.get(r, 0) for r in req_ids):
                left = deadline - time.monotonic()
                if left <= 0:
                    log.error("kvstore saves of preempted requests still running after %.0f s", timeout)
                    return
                self._cond.wait(left)

    def close(self, timeout: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
        self.slot.close()

    def _loop(self) -> None:
        while True:
            run = self._queue.get()
            if run is None:
                return
            try:
                self._save(run)
            except Exception as err:  # a save is best effort: a failed one is a future miss, never an error
                self._worker.counters.save_failures += 1
                log.warning("kvstore save of %s failed: %s", run.req_id, err)
            finally:
                with self._cond:
                    self._outstanding[run.req_id] -= 1
                    if self._outstanding[run.req_id] <= 0:
                        del self._outstanding[run.req_id]
                    self._cond.notify_all()
                self._worker._publish()

    def _save(self, run: BlockRun) -> None:
        blocks = self._worker.blocks
        assert blocks is not None
        c = self._worker.counters
        start = time.perf_counter()
        if self._staging is None:
            self._staging = blocks.new_staging(self._chunk).zero_()
        c.save_runs += 1
        for lo in range(0, len(run), self._chunk):
            hi = min(lo + self._chunk, len(run))
            blocks.gather(run.block_ids[lo:hi], self._staging)
            parent = run.hashes[lo - 1] if lo else (run.parent or None)
            payloads = [self._staging[i] for i in range(hi - lo)]
            results = self.slot.call(
                lambda c: c.put(
                    run.namespace, list(run.hashes[lo:hi]), payloads, parent=parent, dtype=self._worker.dtype
                )
            )
            c.save_blocks_sent += hi - lo
            c.save_bytes += (hi - lo) * blocks.block_bytes
            for r in results:
                if r.status == "stored":
                    c.save_blocks_stored += 1
                elif r.status == "already_present":
                    c.save_blocks_present += 1
                else:
                    c.save_blocks_rejected += 1
            if any(not r.ok for r in results):
                break  # a refused block ends its chain: the blocks after it could never be found
        c.save_seconds += time.perf_counter() - start
