"""Shared-memory files of a store: created 0600 under an unguessable name, their pages reserved, mapped shared.

``create(directory, prefix, size) -> (path, mapping)``: a file ``<directory>/<prefix><pid>-<32 hex digits>``
opened with O_CREAT|O_EXCL|O_NOFOLLOW (mode 0600: only this uid can open it), ``posix_fallocate``d (a full
tmpfs fails here with the OSError, never later as SIGBUS) and mapped read-write, MAP_SHARED, advised for huge
pages (a tmpfs mounted ``huge=advise`` or more grants them; /dev/shm as a rule does not); nothing is left behind when
it fails. Used by the shm lanes' regions (``kvstore/lanes/shm_region.py``) and the shared DRAM
arena (``kvstore/tiers/arena.py``); the pid in the name lets a later start sweep files of a killed store.
"""

from __future__ import annotations

import mmap
import os
import secrets

from kvstore.hugepages import advise_mapping

LANE_PREFIX = "kvstore-lane-"  # a shm lane's region, mapped by the store and one client
DRAM_PREFIX = "kvstore-dram-"  # a store's shared DRAM arena, mapped read-only by its clients


def create(directory: str, prefix: str, size: int) -> tuple[str, mmap.mmap]:
    path = os.path.join(directory, f"{prefix}{os.getpid()}-{secrets.token_hex(16)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.posix_fallocate(fd, 0, size)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        advise_mapping(mapping)  # huge pages where the tmpfs allows them (mounted huge=advise or more)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return path, mapping
