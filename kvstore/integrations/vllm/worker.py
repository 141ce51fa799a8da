"""Worker side of the connector: runs in each vLLM worker process and moves the KV bytes a ``StepPlan`` names.

Verbs and promises:

- ``register(kv_caches)`` (vLLM's ``register_kv_caches``): views the cache as one store block per vLLM block
  (``cache_blocks.CacheBlocks``).
- ``load(plan)`` (``start_load_kv``, before the forward pass, synchronous): each load run is fetched with
  Gets of ``load_chunk`` blocks (0: about ``LOAD_CHUNK_BYTES`` a Get for a host cache, 16 for a device one).
  A host cache (vLLM on the CPU) is the Get's destination itself: each block is a ``Segments`` of its
  per-layer pages, which the lane fills in place, ``load_streams`` Gets at a time (one client each). A device
  cache is filled through ``load_streams + 1`` staging buffers (``staging``: pinned host memory by default),
  ``load_streams`` Gets at a time, each buffer scattered as its Get returns (one copy call per run of
  consecutive blocks) while the later Gets run; a Get into a buffer waits for the copies still reading it (a
  CUDA event), not for the whole device. A chunk that fails (store unreachable, a block missing, a CRC32C
  mismatch, the store lost mid-load) fails the rest of its run: those block ids are zeroed and reported by
  ``take_load_errors`` (``get_block_ids_with_load_errors``), so vLLM recomputes them; the blocks before stay
  loaded. Nothing wrong is ever left for the forward pass to read.
- ``save(plan)`` (``wait_for_save``, after the forward pass): queues the step's save runs for the saver
  thread and returns at once. The saver Puts each chunk of blocks, read in place from a host cache (or
  gathered into its own staging buffer from a device cache); the store answers ``already_present`` for
  blocks another engine stored meanwhile. The blocks stay vLLM's until their request is reported by
  ``finished_sending``.
- ``begin_step()``/``end_step(plan)`` (vLLM binding the step's plan; ``wait_for_save``) and ``take_report()``
  (``build_connector_worker_meta``): the step's ``StepReport``: each load run's outcome and the seconds of
  the forward pass between the loads and the saves, for the scheduler side's load planner.
- ``preempting(plan)`` (``handle_preemptions``): waits for the saves of preempted requests, whose blocks
  vLLM is about to reuse.
- ``finished_sending(finished_req_ids) -> set`` (``get_finished``): requests that had saves, have finished,
  and whose saves are all done (stored, refused or failed: a save is best effort).
- ``close()`` (``shutdown``): drains the saver (bounded), closes the clients.

Copies per block between the store's memory and the KV cache, per path: ``COPIES`` (host caches); staged, one
more on a host cache (tests) and two on a device one (the DMA into a contiguous device buffer, then the copy into
the cache's strided pages: torch's way to land a strided destination).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvstore import memops_jit
from kvstore.hugepages import advise_huge_ranges
from kvstore.integrations.vllm.cache_blocks import CacheBlocks
from kvstore.integrations.vllm.plan import BlockRun, LoadReport, StepPlan, StepReport
from kvstore.integrations.vllm.settings import STAGINGS, ClientSlot
from kvstore.integrations.vllm.stats import StatsFile

log = logging.getLogger(__name__)

# Copies of each block's bytes between the store's arena and a host KV cache, per lane: the lanes read and
# write the cache's per-layer pages in place (Segments).
COPIES = {
    "load:shm": 1,  # arena -> cache (the server writes our pages: process_vm_writev, one vector per block)
    "load:tcp": 2,  # arena -> socket (server), socket -> cache (recvmsg_into the pages)
    "load:grpc": 3,  # arena -> message, protobuf's own copy, message -> cache
    "save:shm": 1,  # cache -> arena (the server reads our pages: process_vm_readv)
    "save:tcp": 2,  # cache -> socket (sendmsg of the pages), socket -> arena (server)
    "save:grpc": 3,
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


# Blocks per load Get when not set: about LOAD_CHUNK_BYTES of a host cache per Get. 16 blocks a Get (23.6 MB of
# SmolLM2's 1.47 MB blocks) against 64 (94 MB), bench.vllm_load in turn, 109 blocks: shared DRAM 20-22 against
# 13-16 ms, NVMe 90-116 against 62-69 ms, the TCP lane 52-57 against 44-56 (62 blocks: 12-13 / 8-12, 59-60 / 37-39,
# 30-31 / 16-22); the store-copied shm Get even. 128 a Get was no better than 64. A device cache goes through
# load_streams + 1 staging buffers of the chunk each, so it keeps STAGED_LOAD_CHUNK.
LOAD_CHUNK_BYTES = 90 << 20  # 64 of those blocks
MAX_LOAD_CHUNK = 512
STAGED_LOAD_CHUNK = 16
# Where a device cache's blocks wait (``staging``, settings.STAGINGS): "host" (pinned host buffers: a Get fills them
# over the shm or tcp lane, DRAM-index and NVMe reads land in them, one DMA per run of consecutive blocks takes them
# to the device), "device" (device buffers: a Get moves them device to device over the cuda_ipc lane where the store
# offers it, else through a pinned buffer of its own). On an H200 host, host staging with two streams loaded 62
# blocks from DRAM in 10.1 ms (store-copied) and 5.6 ms (--share-dram) against 12.1 and 25.6 over cuda_ipc
# (docs/vllm.md, "A CUDA KV cache"), so "auto" is "host".


def auto_load_chunk(block_bytes: int, host: bool) -> int:
    """Blocks per load Get for a cache of ``block_bytes`` blocks (``load_chunk`` 0)."""
    if not host:
        return STAGED_LOAD_CHUNK
    return max(1, min(MAX_LOAD_CHUNK, LOAD_CHUNK_BYTES // max(block_bytes, 1)))


class WorkerSide:
    def __init__(
        self,
        client_factory: Callable[[], Any],
        *,
        dtype: str,
        load_chunk: int = 0,
        load_streams: int = 2,
        verify_loads: bool = True,
        save_chunk: int = 16,
        saves: bool = True,
        stats: StatsFile | None = None,
        rank: int = 0,
        stores_saves: bool = True,
        staging: str = "auto",
        huge_pages: bool = True,
    ):
        if staging not in STAGINGS:
            raise ValueError(f"staging must be one of {', '.join(STAGINGS)}, not {staging!r}")
        self.dtype, self.verify_loads, self.staging, self.huge_pages = dtype, verify_loads, staging, huge_pages
        self.rank = rank  # this worker's rank: its runs move that rank's blocks (``BlockRun.for_rank``)
        # False where a lower rank stores the same bytes (MLA's TP ranks): saves are only reported done
        self.stores_saves = stores_saves
        if load_chunk < 0:
            raise ValueError("load_chunk must be >= 0 (0: chosen from the block size at register)")
        self.load_chunk, self.save_chunk = load_chunk, save_chunk
        self.counters = WorkerCounters()
        self._stats = stats
        self._stats_lock = threading.Lock()
        self.blocks: CacheBlocks | None = None
        if load_streams < 1:
            raise ValueError("load_streams must be >= 1")
        self.load_streams = load_streams
        # one client per stream: a host cache's chunks are fetched by up to load_streams Gets at once (the
        # store copies one while the next is requested and this side checks the last one's CRC32C)
        self._slots: queue.SimpleQueue[ClientSlot] = queue.SimpleQueue()
        self._all_slots = [ClientSlot(client_factory) for _ in range(load_streams)]
        for slot in self._all_slots:
            self._slots.put(slot)
        self._fetcher = ThreadPoolExecutor(load_streams, thread_name_prefix="kvstore-load")
        self._load_errors: set[int] = set()
        self.staged = False  # set at register: blocks go through staging buffers (a device cache, or asked)
        self._load_staging: list[torch.Tensor] = []
        self._load_rows: list[list[Any]] = []  # the Gets' destinations: rows of each staging buffer
        self._staging_free: list[torch.cuda.Event | None] = []  # per buffer: host -> device copies still reading
        self._saver = _Saver(self, save_chunk, client_factory) if saves else None
        self._save_reqs: set[str] = set()
        self._finished: set[str] = set()
        self._step_start = 0.0
        self._step_load_s = 0.0
        self._report = StepReport()
        self._connector: threading.Thread | None = None  # opens the load streams' lanes (register)
        # the lane of the last load or save that completed: a client whose lane is still being opened (the
        # connector thread's) reads "grpc" until it is, so asking a client before any call can mislead
        self._used_lane = ""
        self._closing = False
        self._huge_advice: threading.Thread | None = None  # the huge-page advice under a host cache (register)
        self._huge_stop = threading.Event()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        memops_jit.ready()  # starts compiling the copy and CRC32C kernels now, in the background, not at a load
        self._connector = threading.Thread(target=self._connect_streams, name="kvstore-connect", daemon=True)
        self._connector.start()
        self.blocks = CacheBlocks.from_caches(kv_caches)
        self.counters.cross_layer_view = self.blocks.cross_layer_view
        self.counters.block_bytes = self.blocks.block_bytes
        self.staged = not self.blocks.host or self.staging != "auto"
        if self.huge_pages and not self.staged:
            self._advise_huge_pages()
        if not self.load_chunk:
            self.load_chunk = auto_load_chunk(self.blocks.block_bytes, not self.staged)
        if self.staged:
            # touched now: the first load would otherwise pay for faulting in tens of MB of fresh pages
            # one buffer more than Gets in flight: the one being scattered while the others are filled
            self._load_staging = [self.new_staging(self.load_chunk) for _ in range(self.load_streams + 1)]
            self._staging_free = [None] * len(self._load_staging)
            self._load_rows = [_rows(s) for s in self._load_staging]
        log.info(
            "kvstore connector: %d layers, %d blocks of %d bytes (%s)",
            self.blocks.layers,
            self.blocks.num_blocks,
            self.blocks.block_bytes,
            f"through {self.staging_place} staging buffers" if self.staged else "moved in place, one segment per layer",
        )

    def _advise_huge_pages(self) -> None:
        """Ask the kernel for huge pages under a host cache, on a thread of its own (``MADV_COLLAPSE`` copies the
        cache's faulted-in pages at about 0.5 GB/s here: seconds for a large cache). torch allocates it in 4 KiB
        pages where transparent huge pages are ``madvise`` only, and the store's ``process_vm_writev`` into such
        pages ran 1.3-1.5x slower (docs/vllm.md, "Huge pages under a CPU cache")."""
        assert self.blocks is not None
        ranges = self.blocks.host_ranges()

        def advise() -> None:
            start = time.perf_counter()
            took, refused = advise_huge_ranges(ranges, self._huge_stop)
            log.info(
                "kvstore connector: huge pages taken for %d MiB of the cache, refused for %d MiB (%.1f s)",
                took >> 20,
                refused >> 20,
                time.perf_counter() - start,
            )

        self._huge_advice = threading.Thread(target=advise, name="kvstore-huge-pages", daemon=True)
        self._huge_advice.start()

    def huge_pages_settled(self, timeout: float | None = None) -> bool:
        """Wait for the huge-page advice that ``register`` started (True: none running)."""
        if self._huge_advice is not None:
            self._huge_advice.join(timeout)
        return self._huge_advice is None or not self._huge_advice.is_alive()

    @property
    def staging_place(self) -> str:
        """Where a staged block waits between the store and the cache: "host" (pinned) or "device"."""
        assert self.blocks is not None
        return "device" if self.staging == "device" and not self.blocks.host else "host"

    def new_staging(self, n: int) -> torch.Tensor:
        assert self.blocks is not None
        return self.blocks.new_staging(n, on_host=self.staging_place == "host").zero_()

    def _connect_streams(self) -> None:
        """Open and warm every load stream's client and lane now (``warm_up``), off the engine's thread: the first
        load paid for them (turn 1 of ``make run`` loaded 37 blocks in 150-180 ms, later turns 38-40 in 37-42)."""
        for _ in self._all_slots:
            if self._closing:
                return
            slot = self._slots.get()  # not while a load holds it
            try:
                slot.call(_connect)
            except Exception as err:  # the store may not be up yet: the first load connects, as before
                log.info("kvstore connector: no store lane opened ahead of the first load (%s)", err)
            finally:
                self._slots.put(slot)

    # -- loads -------------------------------------------------------------------------------------------
    def load(self, plan: StepPlan) -> None:
        if not plan.loads or self.blocks is None:
            return
        for run in (r.for_rank(self.rank) for r in plan.loads):
            start = time.perf_counter()
            loaded, calls = self._load_run(run)
            seconds = time.perf_counter() - start
            self._step_load_s += seconds
            self.counters.load_seconds += seconds
            self._report.loads.append(LoadReport(run.req_id, len(run), loaded, seconds, calls, self._used_lane))
        self._publish()

    def begin_step(self) -> None:
        self._step_start, self._step_load_s = time.perf_counter(), 0.0

    def end_step(self, plan: StepPlan) -> None:
        if self._step_start and plan.spans:
            forward = time.perf_counter() - self._step_start - self._step_load_s
            self._report.spans, self._report.forward_s = plan.spans, max(forward, 0.0)
        self._step_start = 0.0

    def take_report(self) -> StepReport | None:
        report, self._report = self._report, StepReport()
        return report if report.loads or report.spans else None

    def _note_lane(self, client: Any) -> None:
        try:
            if client is not None:  # the lane the call took (a device staging buffer's Get: cuda_ipc), else the pool's
                self._used_lane = str(getattr(client, "last_lane", "") or client.lane_kind)
        except Exception:
            pass

    def _fetch(self, run: BlockRun, lo: int, hi: int, out: list[Any], free: torch.cuda.Event | None = None) -> int:
        """Get blocks [lo, hi) of a run into ``out`` (once ``free`` has passed: the copies still reading it); the
        number of leading blocks that arrived."""
        if free is not None:
            free.synchronize()
        slot = self._slots.get()
        try:
            got = slot.call(
                lambda c: c.get(
                    run.namespace, list(run.hashes[lo:hi]), out=out, allow_missing=True, verify=self.verify_loads
                )
            )
            self._note_lane(slot.client)
        finally:
            self._slots.put(slot)
        for i, block in enumerate(got):
            if block is None:
                return i
        return hi - lo

    def _load_run(self, run: BlockRun) -> tuple[int, int]:
        """Blocks loaded intact (the leading ones) and the Gets it took."""
        assert self.blocks is not None
        self.counters.load_runs += 1
        chunks = [(lo, min(lo + self.load_chunk, len(run))) for lo in range(0, len(run), self.load_chunk)]
        loaded = self._load_staged(run, chunks) if self.staged else self._load_in_place(run, chunks)
        self.counters.load_blocks += loaded
        self.counters.load_bytes += loaded * self.blocks.block_bytes
        if loaded < len(run):
            failed = run.block_ids[loaded:]
            self.blocks.zero(failed)  # a failed Get may have written part of them
            self._load_errors.update(failed)
            self.counters.load_failures += 1
            self.counters.load_failed_blocks += len(failed)
        calls = min(len(chunks), loaded // self.load_chunk + 1) if self.staged else len(chunks)
        return loaded, calls

    def _load_in_place(self, run: BlockRun, chunks: list[tuple[int, int]]) -> int:
        """Gets straight into the cache's pages, ``load_streams`` at a time; the number of leading blocks
        loaded intact. Every Get has returned before this does: none writes into the cache afterwards."""
        assert self.blocks is not None
        futures = [
            self._fetcher.submit(self._fetch, run, lo, hi, list(self.blocks.segments(run.block_ids[lo:hi])))
            for lo, hi in chunks
        ]
        loaded: int | None = None
        for (lo, hi), future in zip(chunks, futures):
            try:
                arrived = future.result()
            except Exception as err:  # unreachable, CRC mismatch, lost mid-load: recompute from here
                if loaded is None:
                    log.warning("kvstore load of %s failed at block %d: %s", run.req_id, lo, err)
                    loaded = lo
                continue
            if loaded is None and arrived < hi - lo:
                log.warning("kvstore load of %s: block %d is no longer in the store", run.req_id, lo + arrived)
                loaded = lo + arrived
        return len(run) if loaded is None else loaded

    def _load_staged(self, run: BlockRun, chunks: list[tuple[int, int]]) -> int:
        """Gets into ``load_streams + 1`` staging buffers in turn, up to ``load_streams`` at once, each buffer
        scattered into the cache as its Get returns while the later Gets run."""
        assert self.blocks is not None
        buffers = len(self._load_staging)

        def fetch(k: int) -> Future[int]:
            lo, hi = chunks[k]
            free = self._staging_free[k % buffers]  # the copies out of this buffer that its last scatter issued
            return self._fetcher.submit(self._fetch, run, lo, hi, self._load_rows[k % buffers][: hi - lo], free)

        pending = deque(fetch(k) for k in range(min(buffers - 1, len(chunks))))
        loaded = len(run)
        for k, (lo, hi) in enumerate(chunks):
            try:
                arrived = pending.popleft().result()
            except Exception as err:
                log.warning("kvstore load of %s failed at block %d: %s", run.req_id, lo, err)
                loaded = lo
                break
            if arrived == hi - lo and k + buffers - 1 < len(chunks):
                pending.append(fetch(k + buffers - 1))  # into the buffer scattered last round
            staged = self._load_staging[k % buffers]
            self._staging_free[k % buffers] = self.blocks.scatter(run.block_ids[lo : lo + arrived], staged)
            if arrived < hi - lo:
                log.warning("kvstore load of %s: block %d is no longer in the store", run.req_id, lo + arrived)
                loaded = lo + arrived
                break
        for future in pending:  # never leave a Get writing into a staging buffer the next run reuses
            try:
                future.result()
            except Exception:
                pass
        return loaded

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves -------------------------------------------------------------------------------------------
    def save(self, plan: StepPlan) -> None:
        if self._saver is None or not plan.saves or self.blocks is None:
            return
        for run in plan.saves:
            self._save_reqs.add(run.req_id)
            if self.stores_saves:
                self._saver.submit(run.for_rank(self.rank))
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
        self._closing = True
        self._huge_stop.set()  # the advice ends within one chunk's call
        self.huge_pages_settled(timeout)
        if self._connector is not None:  # a client it is still opening would outlive the slots' close
            self._connector.join(timeout)
        if self._saver is not None:
            self._saver.close(timeout)
        self._fetcher.shutdown(wait=True)
        for slot in self._all_slots:
            slot.close()
        self._publish()

    def _publish(self) -> None:
        c = self.counters
        c.lane = self._used_lane or c.lane
        if c.lane and self.blocks is not None:
            # staged: one copy into or out of the staging buffer on a host cache; on a device one the DMA and the
            # device-side copy between a contiguous buffer and the cache's strided pages
            extra = 0 if not self.staged else 1 if self.blocks.host else 2
            c.copies_per_block_load = COPIES.get(f"load:{c.lane}", -extra) + extra
            c.copies_per_block_save = COPIES.get(f"save:{c.lane}", -extra) + extra
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
        self._rows: list[Any] = []
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
        if self._staging is None and self._worker.staged:
            self._staging = self._worker.new_staging(self._chunk)
            self._rows = _rows(self._staging)
        c.save_runs += 1
        for lo in range(0, len(run), self._chunk):
            hi = min(lo + self._chunk, len(run))
            payloads: list[Any]
            if self._staging is None:  # a host cache: the Put reads the pages in place
                payloads = list(blocks.segments(run.block_ids[lo:hi]))
            else:
                blocks.gather(run.block_ids[lo:hi], self._staging)
                payloads = self._rows[: hi - lo]
            parent = run.hashes[lo - 1] if lo else (run.parent or None)
            results = self.slot.call(
                lambda c: c.put(
                    run.namespace, list(run.hashes[lo:hi]), payloads, parent=parent, dtype=self._worker.dtype
                )
            )
            self._worker._note_lane(self.slot.client)
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


def _rows(staging: torch.Tensor) -> list[Any]:
    """A staging buffer's rows as the buffers a Get fills or a Put reads: numpy views of host memory (the
    client's fastest path), the tensors themselves on a device."""
    if staging.device.type == "cpu":
        flat = staging.numpy()
        return [flat[i] for i in range(flat.shape[0])]
    return [staging[i] for i in range(staging.shape[0])]


def _connect(client: Any) -> None:
    # after register: the engine has started, numba may load; a cluster client compiles the kernels, and opens
    # each node's lane as it first uses it
    client.warm_up()
