"""Anonymous memory for O_DIRECT reads and writes, backed by transparent huge pages where the kernel grants them.

Why, measured: one O_DIRECT ``preadv`` of 64 MiB on this VM (2026-12-05, ``/tmp/s29/thp.py``, 30 reads each in
turn) took 57.4 ms into 4 KiB pages (1.17 GB/s) and 23.2 ms into huge pages (2.89 GB/s); of 2 MiB, 3.14 against
0.80 ms. ``dd iflag=direct`` read 0.65 GB/s that hour: its buffer's pages, not the disk. A 4 KiB-page buffer is
fast or slow for as long as it lives (docs/nvme_log.md), which earlier sessions saw as a "disk state" swinging 0.4-3
GB/s within an hour; huge pages were fast every time. (Likely part of why: a disk request carries one segment per
physically contiguous run of its memory, ``max_segments`` 254 on this virtio disk, and a huge page is one 2 MiB
run.)

- ``huge_buffer(nbytes, whole_pages=False) -> np.ndarray``: zeroed, page-aligned uint8 memory of ``nbytes``,
  advised ``MADV_HUGEPAGE``. From 2 MiB on (or always, with ``whole_pages``: a 1.25 MiB scratch then takes a
  whole huge page) its first byte is 2 MiB aligned, so every whole 2 MiB of it can be a huge page: the mapping is
  up to 2 MiB longer than asked, and that part is never touched (address space, not memory).
- ``advise_huge(address, nbytes) -> bool``: the same advice for memory mapped by someone else (a KV cache torch
  allocated), then ``MADV_COLLAPSE`` (Linux 6.1+) to turn what is already faulted in into huge pages now (asked
  again, up to ``COLLAPSE_TRIES`` in all, while the kernel finds the range busy); False where neither took.
- ``advise_huge_ranges(ranges, stop) -> (took, refused)``: ``advise_huge`` over ranges a chunk at a time, for a
  thread of its own (a collapse copies about 0.5 GB/s here), stopping between chunks when ``stop`` is set.
- ``advise_mapping(mapping)``: the advice for a whole ``mmap`` of ours (a pooled batch, a tmpfs file's mapping).
- ``anonymous_huge_pages() -> bool | None``: whether the kernel grants private memory huge pages at all (False where
  ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``[never]``).
- ``madvise(address, nbytes, advice) -> int``: libc's call (0, or -1 with ``ctypes.get_errno()``), for any advice.

Where transparent huge pages are off (``/sys/kernel/mm/transparent_hugepage/enabled`` "never") or the advice is
not known, the memory is plain pages and nothing fails. The shared DRAM arena and the shm lanes' regions are tmpfs
files: huge pages there follow tmpfs's own ``huge=`` mount option and ``shmem_enabled``, not this advice.
``files_get_huge_pages(directory) -> bool | None`` says which (None: unknown), from the directory's mount
(``huge_pages_of_mount``, a pure function of ``/proc/self/mountinfo``'s text and ``shmem_enabled``'s): /dev/shm
as a rule gives 4 KiB pages, and an O_DIRECT read from NVMe into them (a promotion into the shared arena) ran at
half the speed here (docs/nvme_log.md, thirty-second session).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Sequence

import numpy as np

PAGE = mmap.PAGESIZE
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)  # linux/mman.h
MADV_COLLAPSE = 25  # Linux 6.1+; Python's mmap module does not export it
MADV_REMOVE = getattr(mmap, "MADV_REMOVE", 9)  # frees a shared mapping's backing pages (tmpfs: a hole punched)
# MADV_COLLAPSE answers EAGAIN for a range it found busy (a page locked or in flight) and leaves it 4 KiB; a CI run
# had 14 of a cache's 15 huge pages collapse once, so a busy range is asked again (already huge pages are skipped)
COLLAPSE_TRIES = 3
COLLAPSE_CHUNK = 64 << 20  # advise_huge_ranges: a stop is seen within one such call (about 0.13 s here)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def madvise(address: int, nbytes: int, advice: int) -> int:
    result: int = _libc.madvise(address, nbytes, advice)
    return result


def advise_mapping(mapping: mmap.mmap) -> None:
    with contextlib.suppress(OSError, ValueError):  # advice: a refusal changes nothing
        mapping.madvise(MADV_HUGEPAGE)


def huge_buffer(nbytes: int, whole_pages: bool = False) -> np.ndarray:
    nbytes = max(nbytes, 0)
    aligned = whole_pages or nbytes >= HUGE_PAGE
    length = max(-(-nbytes // PAGE) * PAGE, PAGE)
    region = mmap.mmap(-1, length + (HUGE_PAGE - PAGE if aligned else 0), mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    start = -base % HUGE_PAGE if aligned else 0
    if whole_pages:
        length = -(-length // HUGE_PAGE) * HUGE_PAGE
    madvise(base + start, min(length, len(region) - start), MADV_HUGEPAGE)  # advice: a refusal changes nothing
    return np.frombuffer(region, dtype=np.uint8)[start : start + nbytes]


def advise_huge(address: int, nbytes: int) -> bool:
    """Huge pages for the whole 2 MiB pieces of memory mapped elsewhere (anonymous, private)."""
    first = -(-address // HUGE_PAGE) * HUGE_PAGE
    n = (address + nbytes - first) // HUGE_PAGE * HUGE_PAGE
    if n <= 0:
        return False
    advised = madvise(first, n, MADV_HUGEPAGE) == 0
    collapsed = False
    for _ in range(COLLAPSE_TRIES):
        collapsed = madvise(first, n, MADV_COLLAPSE) == 0
        if collapsed or ctypes.get_errno() != errno.EAGAIN:
            break
    return collapsed or advised


def advise_huge_ranges(
    ranges: Sequence[tuple[int, int]], stop: threading.Event | None = None, chunk: int = COLLAPSE_CHUNK
) -> tuple[int, int]:
    """``advise_huge`` over each (address, nbytes), ``chunk`` bytes a call (whole huge pages), until ``stop`` is
    set; (bytes that took the advice, bytes that did not). ``MADV_COLLAPSE`` copies what is already faulted in
    (about 2 s a GiB here), so callers run this off any thread that serves."""
    took = refused = 0
    for address, nbytes in ranges:
        first = -(-address // HUGE_PAGE) * HUGE_PAGE
        end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
        for at in range(first, end, chunk):
            if stop is not None and stop.is_set():
                return took, refused
            n = min(chunk, end - at)
            if advise_huge(at, n):
                took += n
            else:
                refused += n
    return took, refused


SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
HUGE_TMPFS = ("always", "within_size", "advise")  # a tmpfs mounted huge= one of these grants what we advise


def _unescape(field: str) -> str:
    """A mountinfo path: spaces, tabs, newlines and backslashes are written as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def mount_of(mountinfo: str, path: str) -> tuple[str, list[str]] | None:
    """The file system type and super options of the mount of ``mountinfo`` that holds ``path`` (absolute,
    symlinks resolved): the deepest, and of equal points the last (on top); None when no mount holds it."""
    best: tuple[str, str, list[str]] | None = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = _unescape(fields[4])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            tail = line.split(" - ", 1)[1].split()  # fstype, source, super options
            best = (point, tail[0] if tail else "", tail[2].split(",") if len(tail) > 2 else [])
    return None if best is None else (best[1], best[2])


def huge_pages_of_mount(mountinfo: str, path: str, shmem_enabled: str = "") -> bool | None:
    """Whether files under ``path`` (absolute, symlinks resolved) are mapped with huge pages: hugetlbfs always, a
    tmpfs mounted ``huge=always|within_size|advise`` (the arena and regions advise theirs), any tmpfs when
    ``shmem_enabled`` is ``[force]`` and none when it is ``[deny]``; another file system never. None: no mount of
    ``mountinfo`` holds ``path``."""
    mount = mount_of(mountinfo, path)
    if mount is None:
        return None
    fstype, options = mount
    if fstype == "hugetlbfs":
        return True
    if fstype != "tmpfs":
        return False
    if "[deny]" in shmem_enabled:
        return False
    if "[force]" in shmem_enabled:
        return True
    return any(option.startswith("huge=") and option[5:] in HUGE_TMPFS for option in options)


def read_setting(path: str) -> str | None:
    """The text of a kernel setting's file (``SHMEM_ENABLED``, ``THP_ENABLED``, ...); None where it cannot be read."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def files_get_huge_pages(directory: str) -> bool | None:
    """``huge_pages_of_mount`` for this host's mounts; None where they cannot be read (not Linux)."""
    mountinfo = read_setting("/proc/self/mountinfo")
    if mountinfo is None:
        return None
    return huge_pages_of_mount(mountinfo, os.path.realpath(directory), read_setting(SHMEM_ENABLED) or "")


def filesystem_of(directory: str) -> str | None:
    """The file system type of the mount holding ``directory`` (tmpfs, ext4, ...); None where it cannot be read."""
    mountinfo = read_setting("/proc/self/mountinfo")
    mount = None if mountinfo is None else mount_of(mountinfo, os.path.realpath(directory))
    return None if mount is None else mount[0]


def anonymous_huge_pages(enabled: str | None = None) -> bool | None:
    """Whether private memory can get transparent huge pages (``enabled`` is not ``[never]``): what
    ``huge_buffer`` and ``advise_huge`` ask for. ``enabled`` is that file's text (default: read it); None where
    it cannot be read (no THP in this kernel, not Linux)."""
    if enabled is None:
        enabled = read_setting(THP_ENABLED)
    return None if enabled is None else "[never]" not in enabled
