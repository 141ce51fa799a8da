"""A shm Get's copies: each block into its range of the lane's region, or into the client's own memory.

- ``CopyOut``: one block on its way (destination, source, its descriptor, whether to take its CRC32C).
- ``copy_out(copies, direct, pool)``: run one message's copies, spread over the copy threads, and wait.
  Direct writes from host memory go in runs of up to ``WRITE_RUN_BYTES``, each run one process_vm_writev
  (after the CRC32C of each block, when asked), not one syscall and check per block. A block bound for
  several buffers (Segments) is written alone, by one vectored call per piece.
- ``copy_one(c, direct) -> crc | None`` and ``runnable(c)`` (a block that joins a run) for single blocks;
  ``host_bytes(buf, n)`` a block's bytes in host memory (an HBM slot's copied through the host).
- ``write_blocks(spans, sources, direct, pool, crc, shared) -> [crc32c]``: a direct Get's host-memory blocks
  written into the client's memory with no object per block: runs of plain destinations in one
  process_vm_writev each (a destination in several buffers by one vectored call of its own), spread over the
  copy threads; each block's CRC32C taken just before it moves (0 without ``crc``); destinations inside the
  client's ``shared`` pools copied through the store's mapping, their CRC32Cs in the same pass, in one compiled call.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.checksum import crc32c
from kvstore.lanes.copypool import CopyPool
from kvstore.lanes.direct import DirectPeer
from kvstore.lanes.segments import Spans, SpanTable
from kvstore.lanes.server.pools import MappedPools
from kvstore.memops import addresses_of, copy_crc, copy_into, crcs_at, host_view, run_rows
from kvstore.v1 import lanes_pb2 as lpb

WRITE_RUN_BYTES = 4 << 20  # direct Get writes: this much per process_vm_writev (and per copy thread's turn)
# direct Get writes of a message from this size on are spread over the copy threads: waking an idle pool
# thread costs 200-300 us on this VM after a pause (40 hot), so 32 x 64 KiB DRAM hits taken between other work
# ran 2.3 ms on one thread against 2.6 split in two (bench.nvme_get, 2026-12-02)
SPLIT_WRITE_BYTES = 4 << 20


@dataclass(slots=True)
class CopyOut:
    """One block of a Get on its way into the region."""

    dst: memoryview | None  # the region range (None: written to the client's memory at spans)
    src: Any  # the arena slot (host memory or an HBM tensor) or decoded bytes
    descriptor: lpb.BlockDescriptor
    crc: bool  # compute the CRC32C of the copied bytes into the descriptor
    spans: Spans = ()  # direct Get: where the block goes in the client's memory ((address, length), in order)


def copy_out(copies: Sequence[CopyOut], direct: DirectPeer | None, pool: CopyPool) -> None:
    """Run one message's copies into the region or the client's memory (spread over the copy threads) and
    wait for them. Direct writes from host memory go in runs of up to ``WRITE_RUN_BYTES``, each run one
    process_vm_writev (after the CRC32C of each block, when asked), not one syscall and check per block.
    A block bound for several buffers (Segments) is written alone, by one vectored call per piece."""
    runs: list[list[CopyOut]] = []
    total = sum(c.descriptor.length for c in copies)
    threads = pool.threads
    # one run per copy thread once the message is worth splitting: each run's CRC32Cs and process_vm_writev
    # go on in parallel (a process_vm_writev moves about 4.5 GB/s here, a CRC32C about 6)
    per_run = WRITE_RUN_BYTES if total < SPLIT_WRITE_BYTES else min(WRITE_RUN_BYTES, -(-total // threads))
    size = per_run
    for c in copies:
        if runnable(c):
            if size >= per_run:
                runs.append([])
                size = 0
            runs[-1].append(c)
            size += c.descriptor.length
        else:
            runs.append([c])
            size = per_run
    weights = [sum(c.descriptor.length for c in run) for run in runs]
    pool.run(lambda run: _copy_run(run, direct), runs, weights, SPLIT_WRITE_BYTES)


def _copy_into_pools(
    run: range, counts: np.ndarray, spans: Sequence[Spans], sources: Sequence[memoryview], sizes: Sequence[int],
    shared: MappedPools, crc: bool, crcs: list[int], left: np.ndarray, pooled: list[int] | None,
) -> None:  # fmt: skip
    """``write_blocks``' blocks of ``run`` bound for one buffer inside one of the client's ``shared`` pools: copied
    through the store's mapping, each with its CRC32C in the same pass, all in one compiled call
    (``memops.run_rows``); their ``crcs`` set and ``left`` cleared. Against a call a block (a pool lookup, two
    views and ``copy_crc``), 32 DRAM hits into a hugetlb pool in one store, switched Get by Get: 1.73 -> 1.61 ms
    at 64 KiB, 3.74 -> 2.91 at 512 KiB, 5.99 -> 5.72 at 2 MiB (forty-ninth session, docs/nvme_log.md)."""
    single = np.flatnonzero(counts == 1)
    if not len(single):
        return
    heads = _heads(spans, run, single).astype(np.int64)
    lengths = np.array([sizes[run[j]] for j in single.tolist()], dtype=np.int64)
    ours, held = shared.addresses(heads, lengths)
    inside = np.flatnonzero(ours)
    if not len(inside):
        return
    picked = single[inside].tolist()
    rows = np.empty((len(picked), 4), dtype=np.int64)  # (source, our address in the pool, bytes, block)
    rows[:, 0] = addresses_of([sources[run[j]] for j in picked])[:, 0]
    rows[:, 1], rows[:, 2], rows[:, 3] = ours[inside], lengths[inside], np.arange(len(picked))
    values = run_rows(rows, len(picked), crc)
    del held  # the copies are done: the pools' mappings may go
    for j, value in zip(picked, values):
        crcs[j], left[j] = (value if crc else 0), False
    if pooled is not None:
        pooled.extend(lengths[inside].tolist())


def _heads(spans: Sequence[Spans], run: range, picked: np.ndarray) -> np.ndarray:
    """The address of the one buffer of each block ``run[j]``, ``j`` in ``picked`` (uint64)."""
    if isinstance(spans, SpanTable):
        heads: np.ndarray = spans.table[spans.starts[run.start + picked], 0]
        return heads
    return np.array([spans[run[j]][0][0] for j in picked.tolist()], dtype=np.uint64)


def _copy_run(run: list[CopyOut], direct: DirectPeer | None) -> None:
    if len(run) == 1 and not runnable(run[0]):
        crc = copy_one(run[0], direct)
        if crc is not None:
            run[0].descriptor.crc32c = crc
        return
    assert direct is not None
    pairs = []
    for c in run:
        src = host_view(c.src)
        assert src is not None
        src = src[: c.descriptor.length]
        if c.crc:
            c.descriptor.crc32c = crc32c(src)
        pairs.append((c.spans[0][0], src))
    direct.write_many(pairs)


def copy_one(c: CopyOut, direct: DirectPeer | None) -> int | None:
    if c.spans:
        assert direct is not None
        src = host_bytes(c.src, c.descriptor.length)
        if len(c.spans) == 1:
            crc = direct.write_from(c.spans[0][0], src, c.crc)
        else:  # a destination in several buffers: one pass, many iovecs
            crc = direct.write_spans(c.spans, src, c.crc)
        return crc if c.crc else None
    assert c.dst is not None
    if not c.crc:
        copy_into(c.dst, c.src)
        return None
    host = host_view(c.src)
    if host is not None:
        return copy_crc(c.dst, host)
    copy_into(c.dst, c.src)  # an HBM slot: copy, then read the landed bytes
    return crc32c(c.dst)


def host_bytes(buf: Any, n: int) -> memoryview:
    """The first ``n`` bytes of a slot or read buffer in host memory (an HBM slot's go through the host)."""
    view = host_view(buf)
    if view is None:
        view = memoryview(bytearray(n))
        copy_into(view, buf)
    return view[:n]


def runnable(c: CopyOut) -> bool:
    """A direct Get block that joins a ``write_many`` run: one destination buffer, the source in host memory."""
    return len(c.spans) == 1 and host_view(c.src) is not None


def write_blocks(
    spans: Sequence[Spans],
    sources: Sequence[memoryview],
    direct: DirectPeer,
    pool: CopyPool | None,
    crc: bool,
    shared: MappedPools | None = None,
    pooled: list[int] | None = None,
) -> list[int]:
    """Write ``sources[k]`` at ``spans[k]`` in the client's memory for every k; each block's CRC32C (0 without
    ``crc``), in order. From ``SPLIT_WRITE_BYTES`` on the blocks are cut into one contiguous run per copy
    thread; each run takes its blocks' CRC32Cs in one call and writes its single-buffer blocks with one
    process_vm_writev per ``IOV_BATCH`` of them, its blocks across several buffers with one per ``IOV_BATCH`` of
    their spans (they had a vectored call each, with a Python step and a ctypes object per span).
    Measured here (``bench.vllm_load``, 109 blocks of 30 x 48 KiB): 85 ms with every write on one thread and
    the CRC32Cs on the other, 69 ms split this way; without CRC32Cs 76 ms on one thread, 54 ms on two (the
    writes cost about 2.5x the CRC32Cs and run faster side by side at that size); 32 x 64 KiB DRAM hits
    came out even either way back to back, and faster on one thread between other work (``SPLIT_WRITE_BYTES``).
    A single-buffer block bound for one of the client's ``shared`` pools is copied through the store's mapping
    of it with its CRC32C in the same pass (32 x 64 KiB in 0.42 ms where the CRC32Cs and process_vm_writev took
    0.77 here), a run's such blocks in one compiled call (``_copy_into_pools``), their bytes appended to
    ``pooled``. Without ``pool`` (a caller already on a worker thread) every block goes on the calling thread."""
    sizes = [len(s) for s in sources]
    total = sum(sizes)
    parts = pool.threads if pool is not None and total >= SPLIT_WRITE_BYTES else 1
    per_part = -(-total // parts)
    runs: list[range] = []
    start = size = 0
    for k, n in enumerate(sizes):
        size += n
        if size >= per_part and len(runs) < parts - 1:
            runs.append(range(start, k + 1))
            start, size = k + 1, 0
    if start < len(sizes) or not runs:  # no empty run: it would cost a thread handoff for nothing
        runs.append(range(start, len(sizes)))

    def write_run(run: range) -> list[int]:
        # each source's address once, then every block's CRC32C in one compiled call (not one per block: see
        # memops.crcs_of), then the writes: blocks in one buffer a syscall per IOV_BATCH of them, from the same
        # table; blocks across several buffers (a vLLM block's pages) a syscall per IOV_BATCH of their spans
        if isinstance(spans, SpanTable):  # its rows as they are (a view a block), no tuple per span
            counts = spans.counts()[run.start : run.stop]
        else:
            counts = np.array([len(spans[k]) for k in run], dtype=np.int64)
        crcs = [0] * len(run)
        left = np.ones(len(run), dtype=bool)  # not copied into a shared pool
        if shared:
            _copy_into_pools(run, counts, spans, sources, sizes, shared, crc, crcs, left, pooled)
        rest = np.flatnonzero(left)
        single = np.flatnonzero(left & (counts == 1))
        local = addresses_of([sources[run[j]] for j in rest.tolist()]) if len(rest) and (crc or len(single)) else None
        if local is not None and crc:
            for j, value in zip(rest.tolist(), crcs_at(local)):
                crcs[j] = value
        if local is not None and len(single):
            direct.write_table(local[np.searchsorted(rest, single)], _heads(spans, run, single))
        scattered: list[tuple[Spans | np.ndarray, Any]]
        if isinstance(spans, SpanTable):
            scattered = [(spans.rows(k), sources[k]) for k, n in zip(run, counts.tolist()) if n != 1]
        else:
            scattered = [(spans[k], sources[k]) for k, n in zip(run, counts.tolist()) if n != 1]
        if scattered:
            direct.write_scattered(scattered)
        return crcs

    if len(runs) == 1 or pool is None:
        return write_run(runs[0])
    done = pool.side_by_side([functools.partial(write_run, run) for run in runs])
    return [value for part in done for value in part]
