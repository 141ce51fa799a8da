"""Where the DRAM arena lives: a file of ``--shm-dir`` that shm clients map read-only (``--share-dram``), or
private memory.

``decide(cfg, host)`` is the rule, ``HostFacts.read(directory)`` what it looks at on this host. ``--share-dram
true`` and ``false`` are obeyed; ``auto`` (the default) shares the arena only where nothing is given up for it:

- no ``--tenants`` file (tenants' blocks would become readable by each other's local processes; any client
  of a store without tenants may read any block anyway);
- an shm lane with its direct channel (``--lanes`` names shm, ``--shm-direct``, ``process_vm_readv``): the
  clients that find DRAM hits in the shared index report them on it;
- no CUDA device (there the private arena is pinned host memory, which the HBM tier and the cuda_ipc lane
  copy through);
- ``--shm-dir`` is a tmpfs (or hugetlbfs) where the arena and its index take at most ``SHARE_AT_MOST`` of the
  free space, and of the host's available memory: the file is reserved whole at start (``posix_fallocate``),
  where private memory is faulted in as it is used, and a container's 64 MiB /dev/shm leaves the arena
  private.

Measured (``python -m bench.nvme_get --kinds dram-shm``, and the fifty-eighth session's A/B in
``docs/nvme_log.md``): a 32 x 64 KiB DRAM-hit Get through the shm lane is read by the client from the arena
with no request, 2.9x as fast as the code issue 19 was filed against, where a private arena gave 1.2-1.3x.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from kvstore import arena_index
from kvstore.config import ServeConfig
from kvstore.hugepages import filesystem_of
from kvstore.sizes import format_size

SHARE_AT_MOST = 0.75  # of --shm-dir's free space and of available memory, for auto
SHARED_FILE_SYSTEMS = ("tmpfs", "hugetlbfs")


@dataclass(frozen=True)
class HostFacts:
    file_system: str | None  # --shm-dir's file system type (None: not a directory, or no mount names it)
    free_bytes: int  # --shm-dir's free space
    available_bytes: int | None  # MemAvailable (None: unknown)
    cuda: bool  # a CUDA device is visible
    cross_memory: bool  # process_vm_readv / process_vm_writev are there (the shm lane's direct channel)

    @classmethod
    def read(cls, directory: str) -> HostFacts:
        from kvstore.lanes import cma
        from kvstore.tiers.arena import cuda_available

        is_dir = os.path.isdir(directory)
        return cls(
            file_system=filesystem_of(directory) if is_dir else None,
            free_bytes=shutil.disk_usage(directory).free if is_dir else 0,
            available_bytes=available_memory_bytes(),
            cuda=cuda_available(),
            cross_memory=cma.available(),
        )


@dataclass(frozen=True)
class DramSharing:
    directory: str | None  # the arena's directory; None: private memory
    reason: str  # why, in words (logged at start)
    asked: bool  # --share-dram true: a failure to make the file fails the start (auto falls back to private)


def shared_bytes(cfg: ServeConfig, index_disk_bytes: int) -> int:
    """The bytes a shared arena reserves in ``--shm-dir``: the arena and, with ``--dram-index``, its index."""
    index = arena_index.table_bytes(arena_index.buckets_for(cfg.dram + index_disk_bytes)) if cfg.dram_index else 0
    return cfg.dram + index


def decide(cfg: ServeConfig, host: HostFacts, index_disk_bytes: int = 0) -> DramSharing:
    """Whether the DRAM arena is shared, and why (the module's rule)."""
    from kvstore.lanes.server.wiring import lane_kinds

    mode = cfg.share_dram_mode
    if mode == "true":
        return DramSharing(cfg.shm_dir, "--share-dram true", asked=True)
    if mode == "false":
        return DramSharing(None, "--share-dram false", asked=False)

    def private(why: str) -> DramSharing:
        return DramSharing(None, f"--share-dram auto: private, {why}", asked=False)

    if cfg.tenants:
        return private("as a --tenants file is given (tenants' blocks stay hidden from each other's processes)")
    if "shm" not in lane_kinds(cfg.lanes) or not cfg.shm_direct or not host.cross_memory:
        return private("as there is no shm lane with a direct channel (--lanes, --shm-direct, process_vm_readv)")
    if host.cuda:
        return private("as a CUDA device is here (the private arena is pinned host memory)")
    if host.file_system not in SHARED_FILE_SYSTEMS:
        return private(f"as --shm-dir {cfg.shm_dir} is not a tmpfs ({host.file_system or 'no such directory'})")
    need = shared_bytes(cfg, index_disk_bytes)
    if need > host.free_bytes * SHARE_AT_MOST:
        return private(
            f"as --shm-dir {cfg.shm_dir} has {format_size(host.free_bytes)} free and the arena with its index "
            f"takes {format_size(need)} (at most {SHARE_AT_MOST:.0%} of it is used; pass --shm-dir on a larger tmpfs)"
        )
    if host.available_bytes is not None and need > host.available_bytes * SHARE_AT_MOST:
        return private(
            f"as the host has {format_size(host.available_bytes)} of memory available and the shared arena, "
            f"reserved whole at start, takes {format_size(need)}"
        )
    return DramSharing(
        cfg.shm_dir,
        f"--share-dram auto: shared in {cfg.shm_dir} (no --tenants file; {format_size(need)} reserved): "
        "shm clients of this user read DRAM hits from it themselves",
        asked=False,
    )


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        return None
    return None
