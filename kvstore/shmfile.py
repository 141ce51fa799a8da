"""Shared-memory files of a store: created 0600 under an unguessable name, their pages reserved, mapped shared.

``create(directory, prefix, size) -> (path, mapping)``: a file ``<directory>/<name_of(prefix)>``
opened with O_CREAT|O_EXCL|O_NOFOLLOW (mode 0600: only this uid can open it), ``posix_fallocate``d (a full
tmpfs fails here with the OSError, never later as SIGBUS) and mapped read-write, MAP_SHARED, advised for huge
pages (a tmpfs mounted ``huge=advise`` or more grants them; /dev/shm as a rule does not); nothing is left behind when
it fails. Used by the shm lanes' regions (``kvstore/lanes/shm_region.py``) and the shared DRAM
arena (``kvstore/tiers/arena.py``).

``name_of(prefix, suffix="")``: ``<prefix><pid>-<8 hex digits of this process><24 random>``. The pid and the
process's mark let a later start sweep what a killed store left (``maker_is_gone``): no process runs with its pid,
or this process has the pid and another mark. A container's store is pid 1 at every restart, so the pid alone
took a killed predecessor's 1 GiB arena for this process's own and kept it.

``create_growing(directory, prefix, size, reserved) -> (path, mapping, fd)``: the same file of ``size`` bytes with
only its first ``reserved`` reserved; the caller keeps ``fd`` to ``posix_fallocate`` more before it lets anyone
write there, and closes it. A lane's region is reserved as it is used: most Gets and Puts of a direct lane never
touch it, and reserving 256 MiB took 65 ms of every lane's opening.
"""

from __future__ import annotations

import mmap
import os
import secrets

from kvstore.hugepages import advise_mapping

LANE_PREFIX = "kvstore-lane-"  # a shm lane's region, mapped by the store and one client
DRAM_PREFIX = "kvstore-dram-"  # a store's shared DRAM arena, mapped read-only by its clients
DIRECT_PREFIX = "kvstore-direct-"  # a store's handshake socket of direct shm lanes (``kvstore/lanes/direct.py``)
MARK_HEX = 8  # hex digits of a process's mark in its files' names

_mark = secrets.token_hex(MARK_HEX // 2)


def _new_mark() -> None:
    global _mark
    _mark = secrets.token_hex(MARK_HEX // 2)


os.register_at_fork(after_in_child=_new_mark)


def name_of(prefix: str, suffix: str = "", random_hex: int = 24) -> str:
    """A file name no other file has: this process's pid and mark, then ``random_hex`` random hex digits."""
    return f"{prefix}{os.getpid()}-{_mark}{secrets.token_hex(random_hex // 2)}{suffix}"


def maker_is_gone(name: str, prefix: str) -> bool | None:
    """Whether the process that made ``name`` (``name_of(prefix, ...)``) is gone: no process has its pid, or this
    one has it under another mark (a restarted container's pid 1). None when the name is not such a name, or the
    process may not be asked (another user's pid)."""
    if not name.startswith(prefix):
        return None
    pid_text, dash, rest = name[len(prefix) :].partition("-")
    if not pid_text.isdigit() or not dash:
        return None
    pid = int(pid_text)
    if pid == os.getpid():
        return not rest.startswith(_mark)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return None
    return False


def create(directory: str, prefix: str, size: int) -> tuple[str, mmap.mmap]:
    path, mapping, _ = _create(directory, prefix, size, size, keep_fd=False)
    return path, mapping


def create_growing(directory: str, prefix: str, size: int, reserved: int) -> tuple[str, mmap.mmap, int]:
    return _create(directory, prefix, size, min(reserved, size), keep_fd=True)


def _create(directory: str, prefix: str, size: int, reserved: int, keep_fd: bool) -> tuple[str, mmap.mmap, int]:
    path = os.path.join(directory, name_of(prefix))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        if reserved > 0:
            os.posix_fallocate(fd, 0, reserved)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        advise_mapping(mapping)  # huge pages where the tmpfs allows them (mounted huge=advise or more)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    if not keep_fd:
        os.close(fd)
        fd = -1
    return path, mapping, fd
