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
  free space, and of the memory available (the host's, or the room left under the process's memory cgroup
  limit): the file is reserved whole at start (``posix_fallocate``), where private memory is faulted in as it
  is used, and a container's 64 MiB /dev/shm leaves the arena private.

Measured (``python -m bench.nvme_get --kinds dram-shm --baseline REV``, docs/nvme_log.md, fifty-eighth session):
a 32 x 64 KiB DRAM-hit Get through the shm lane, read by the client from the arena with no request, ran 2.4-2.9x
as fast as a private arena's (asked of the store) in the same run, and 3.2-3.6x as fast as the code issue 19 was
filed against.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass

from kvstore import arena_index
from kvstore.config import ServeConfig
from kvstore.hugepages import filesystem_of, read_setting
from kvstore.sizes import format_size

SHARE_AT_MOST = 0.75  # of --shm-dir's free space and of available memory, for auto
SHARED_FILE_SYSTEMS = ("tmpfs", "hugetlbfs")


@dataclass(frozen=True)
class HostFacts:
    file_system: str | None  # --shm-dir's file system type (None: not a directory, or no mount names it)
    free_bytes: int  # --shm-dir's free space
    # MemAvailable, or less where this process's memory cgroup has less room under its limit (None: unknown)
    available_bytes: int | None
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
            available_bytes=_least(available_memory_bytes(), cgroup_memory_room()),
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
            f"as {format_size(host.available_bytes)} of memory is available (the host's, or its memory cgroup's "
            f"room) and the shared arena, reserved whole at start, takes {format_size(need)}"
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


NO_LIMIT = 1 << 60  # a cgroup v1 memory limit this large is no limit ("max" in v2)


def cgroup_memory_room(
    proc_cgroup: str | None = None, read: Callable[[str], str | None] = read_setting, root: str = "/sys/fs/cgroup"
) -> int | None:
    """Bytes this process's memory cgroup (v1 or v2) may still charge: its limit less its usage. None where it has
    no limit or none can be read. A container's limit is what a shared arena, reserved whole at start, must fit in
    beside everything else the process holds."""
    proc_cgroup = read("/proc/self/cgroup") if proc_cgroup is None else proc_cgroup
    files = None
    for line in (proc_cgroup or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):  # v1 (also where v2 is mounted beside it, without memory)
            files = ("/memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes")
            break
        if hierarchy == "0" and not controllers and files is None:
            files = ("", path, "memory.max", "memory.current")
    if files is None:
        return None
    mount, path, limit_file, usage_file = files
    for base in (f"{root}{mount}{path.rstrip('/')}", f"{root}{mount}"):  # a container sees its own cgroup as the root
        limit, usage = read(f"{base}/{limit_file}"), read(f"{base}/{usage_file}")
        if limit is None or usage is None:
            continue
        limit, usage = limit.strip(), usage.strip()
        if not (limit.isdigit() and usage.isdigit()) or int(limit) >= NO_LIMIT:  # "max" (v2): no limit
            return None
        return max(0, int(limit) - int(usage))
    return None


def _least(*values: int | None) -> int | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None
