"""The NVMe tier: a log-structured segment store (DESIGN 3, docs/nvme.md).

Module map, one job each:

- ``format``: the record layout on disk, CRC32C, location encoding.
- ``io``: I/O backends (POSIX O_DIRECT, kvikio CuFile) behind one interface.
- ``faults``: a counting / fault-injecting backend wrapper (the test seam).
- ``segments``: segment files and per-record accounting.
- ``writer``: the write-combining buffer (large aligned writes, double buffered).
- ``reader``: coalesced read planning and per-record verification.
- ``pipeline``: a Get's pieces over threads, reads in flight while verified ones are handed on.
- ``sidecar``: segment summaries and the free-list checkpoint.
- ``recovery``: rebuilding state from the data directory at open.
- ``log``: appends, frees, pins, forwards, retirement.
- ``compaction``: moving live records out of mostly-dead segments.
- ``tier``: ``NvmeTier``, the tier verbs.
"""

from kvstore.tiers.nvme.compaction import DROPPED, CompactionReport, RelocateHook
from kvstore.tiers.nvme.io import IoBackend, KvikioBackend, PosixBackend, select_backend
from kvstore.tiers.nvme.tier import NvmeTier, ReclaimInfo

__all__ = [
    "NvmeTier",
    "ReclaimInfo",
    "CompactionReport",
    "RelocateHook",
    "DROPPED",
    "IoBackend",
    "PosixBackend",
    "KvikioBackend",
    "select_backend",
]
