"""Memory tiers (DRAM and HBM): one preallocated arena carved by a slab allocator.

The same class serves both tiers, parameterised by device (DESIGN 3): on ``cpu``
the arena is host memory (pinned through torch when a CUDA device exists, so
device copies can be asynchronous; pageable numpy memory otherwise, which the
kernel faults in as it is first written); on ``cuda`` it is one torch tensor in
device memory. No per-block allocation happens after start.

``ArenaTier(..., share_dir=DIR)`` (host memory, not pinned) puts the arena in a
file ``DIR/kvstore-dram-<pid>-<32 hex digits>`` (mode 0600, its pages reserved
up front, mapped shared) that same-host clients of this user map read-only, so a
Get can name a DRAM block where it lies instead of copying it
(``shared``: path, size, base address; ``close()`` removes the file). With
``share_index`` (the default) a second file, ``index``, names where each raw
block lies (``kvstore/arena_index.py``), for clients that find DRAM hits
without asking the store; the BlockStore keeps it current. ``index_disk_bytes``: the
table also names that many bytes of NVMe blocks (``serve --share-nvme``), and is sized
for them. Without ``share_dir``, ``index_dir=DIR`` with ``index_disk_bytes`` makes that table
alone, in DIR: it names only the blocks NVMe alone holds (``index_names_memory`` False), since
clients cannot map this arena; a DIR too small for it leaves the tier without one (logged).

``prefault=True`` (host memory): the arena's pages are made in the background from the start
(``kvstore/prefault.py``), so Puts into slots not used yet pay no page fault and zero-fill in their copy.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore import arena_index, shmfile
from kvstore.arena_index import ArenaIndex
from kvstore.devices import Copier
from kvstore.hugepages import MADV_REMOVE, files_get_huge_pages, huge_buffer, madvise
from kvstore.prefault import Prefaulter
from kvstore.tiers.base import DRAM, HBM, TIER_NAMES, BlockMeta, MemoryTier, TierFull, TierStats
from kvstore.tiers.slab import SlabAllocator

log = logging.getLogger(__name__)


def cuda_available() -> bool:
    """True only where torch imports and sees a CUDA device; torch is not imported otherwise."""
    import os

    if not (os.path.exists("/dev/nvidiactl") or os.environ.get("CUDA_VISIBLE_DEVICES")):
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _host_buffer(nbytes: int, pinned: bool) -> tuple[np.ndarray, Any]:
    if pinned:
        import torch

        tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return tensor.numpy(), tensor
    region = huge_buffer(nbytes)  # blocks are read into it from NVMe and written from it: huge pages ran 2-3x faster
    return region, region


SHARED_PREFIX = shmfile.DRAM_PREFIX


@dataclass(frozen=True)
class SharedArena:
    """Where a shared host arena is: its file, its size and its first byte in this process."""

    path: str
    size: int
    base: int
    index_path: str = ""  # the table of where its raw blocks lie (kvstore/arena_index.py), when there is one
    index_bytes: int = 0

    def offset_of(self, address: int, nbytes: int) -> int | None:
        """The arena offset of ``nbytes`` at ``address``, or None when they are not all inside the arena."""
        offset = address - self.base
        return offset if 0 <= offset and offset + nbytes <= self.size else None


def _remove_shared(path: str, base: int, nbytes: int) -> None:
    """Unlink a shared arena's file and punch its pages out of the mapping at ``base``: the file is reserved whole,
    so a mapping that outlives it would otherwise hold all of its memory."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    madvise(base, nbytes, MADV_REMOVE)


def _shared_buffer(nbytes: int, directory: str) -> tuple[np.ndarray, mmap.mmap, str]:
    path, region = shmfile.create(directory, SHARED_PREFIX, max(nbytes, 1))
    return np.frombuffer(region, dtype=np.uint8, count=nbytes), region, path


def _disk_index(directory: str, disk_bytes: int) -> ArenaIndex | None:
    """A table of the NVMe-only blocks of ``disk_bytes`` in ``directory``, or None (logged) when it has no room."""
    try:
        return ArenaIndex.create(directory, disk_bytes)
    except OSError as err:
        log.warning(
            "no index of the NVMe tier's blocks for shm clients in %s (%s): they ask the store for every Get; "
            "pass --shm-dir on a larger tmpfs",
            directory,
            err,
        )
        return None


class ArenaTier(MemoryTier):
    """A memory tier: ``device`` is "cpu" (DRAM) or "cuda[:N]" (HBM)."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        device: str = "cpu",
        page_size: int = 8 << 20,
        pinned: bool | None = None,
        share_dir: str | None = None,
        prefault: bool = False,
        share_index: bool = True,
        index_disk_bytes: int = 0,
        index_dir: str | None = None,
    ):
        self.device = device
        self.rank = HBM if device.startswith("cuda") else DRAM
        self.name = TIER_NAMES[self.rank]
        page_size = min(page_size, max(capacity_bytes, 4096) // 4096 * 4096)
        capacity = capacity_bytes // page_size * page_size  # whole pages: the slab allocator's
        self.shared: SharedArena | None = None
        self.index: ArenaIndex | None = None  # published by the BlockStore, read by clients (share_index)
        if self.rank == HBM:
            import torch

            self._tensor = torch.empty(capacity, dtype=torch.uint8, device=device)
            self._host: np.ndarray | None = None
            self.backend = f"torch:{device}"
        else:
            if share_dir is not None:
                self._host, self._keepalive, path = _shared_buffer(capacity, share_dir)
                self.small_pages = files_get_huge_pages(share_dir) is False
                if share_index and arena_index.supported():
                    try:
                        self.index = ArenaIndex.create(share_dir, capacity + index_disk_bytes)
                    except OSError:  # (no room for it): the arena's file goes too, and its memory with it
                        _remove_shared(path, int(self._host.ctypes.data), capacity)
                        raise
                index_path, index_bytes = (self.index.path, self.index.nbytes) if self.index is not None else ("", 0)
                self.shared = SharedArena(path, capacity, int(self._host.ctypes.data), index_path, index_bytes)
                self.backend = "shared"
            else:
                if pinned is None:
                    pinned = cuda_available()
                self._host, self._keepalive = _host_buffer(capacity, pinned)
                self.backend = "pinned" if pinned else "pageable"
                if index_dir is not None and index_disk_bytes and share_index and arena_index.supported():
                    self.index = _disk_index(index_dir, index_disk_bytes)
            self._view = self._host.data
        # after the memory: a size too large for the host fails at once, before a page table of that size is made
        # (--dram 64TiB took 20 s to say so)
        self.slabs = SlabAllocator(capacity_bytes, page_size)
        self.prefaulter: Prefaulter | None = None  # making the pages (prefault=True)
        if prefault and self._host is not None and self.backend != "pinned":  # pinned memory has its pages
            self.prefaulter = Prefaulter(int(self._host.ctypes.data), self.slabs.capacity)
        log.info(
            "%s arena: %d bytes (%s), %d pages of %d",
            self.name,
            self.slabs.capacity,
            self.backend,
            self.slabs.n_pages,
            self.slabs.page_size,
        )

    @property
    def capacity_bytes(self) -> int:
        return self.slabs.capacity

    @property
    def used_bytes(self) -> int:
        return self.slabs.used_bytes

    @property
    def max_block_bytes(self) -> int:
        return self.slabs.max_slot

    def fits(self, nbytes: int) -> bool:
        return nbytes <= min(self.slabs.max_slot, self.slabs.capacity)

    def allocate(self, nbytes: int) -> int | None:
        return self.slabs.allocate(nbytes)

    def view(self, loc: int, nbytes: int) -> Any:
        if self._host is None:
            return self._tensor[loc : loc + nbytes]
        return self._view[loc : loc + nbytes]

    def views(self, locs: Sequence[int], lengths: Sequence[int]) -> list[Any]:
        if self._host is None:
            tensor = self._tensor
            return [tensor[loc : loc + n] for loc, n in zip(locs, lengths)]
        view = self._view
        return [view[loc : loc + n] for loc, n in zip(locs, lengths)]

    def free(self, locs: Sequence[int]) -> None:
        for loc in locs:
            self.slabs.free(loc)

    def write(self, metas: Sequence[BlockMeta], sources: Sequence[Any]) -> list[int]:
        locs: list[int] = []
        for meta in metas:
            loc = self.slabs.allocate(meta.stored_length)
            if loc is None:
                self.free(locs)
                raise TierFull(f"{self.name} arena full")
            locs.append(loc)
        copier = Copier()
        try:
            for loc, meta, src in zip(locs, metas, sources):
                copier.copy(self.view(loc, meta.stored_length), src)
            copier.settle()
        except BaseException:
            self.free(locs)
            raise
        return locs

    def read(self, locs: Sequence[int], lengths: Sequence[int], dests: Sequence[Any]) -> None:
        copier = Copier()
        for loc, n, dest in zip(locs, lengths, dests):
            copier.copy(dest, self.view(loc, n))
        copier.settle()

    def stats(self) -> TierStats:
        return TierStats(self.name, self.capacity_bytes, self.used_bytes, backend=self.backend)

    @property
    def index_names_memory(self) -> bool:
        """Whether ``index`` names this arena's blocks (clients map it), else NVMe-only blocks alone."""
        return self.shared is not None

    def close(self) -> None:
        """Remove a shared arena's file and give its memory back: the file is reserved whole, so a mapping that
        outlived the store (a tier object still referenced in a process that embeds stores, as the tests do) held
        all of it (the suite ran out of memory so). A client that still maps it reads zeros, which its CRC32Cs
        refuse."""
        if self.prefaulter is not None:
            self.prefaulter.stop()
        if self.index is not None:
            self.index.close()
        if self.shared is not None:
            _remove_shared(self.shared.path, self.shared.base, self.shared.size)
