"""Cross-memory attach: the store copies blocks straight between its arena and a same-host client's memory.

Linux's ``process_vm_readv`` copies from another process's address space
into ours in the kernel, at about memcpy speed (16-18 GB/s here against 19
for memcpy). The kernel allows it only where ptrace would be allowed: same
user, and under Yama's ``ptrace_scope`` 1 only if the client named us with
``prctl(PR_SET_PTRACER, store_pid)``. What this module gives:

- ``read_into(pid, dst, address) -> crc``: copy ``len(dst)`` bytes at
  ``address`` in process ``pid`` into the writable host buffer ``dst``, in
  pieces, each CRC32C'd right after it lands (still in cache). Raises
  ``DirectReadError`` (with the errno) on a short or failed read.
- ``write_from(pid, address, src) -> crc``: the other way (``process_vm_writev``),
  the CRC32C of ``src`` computed piece by piece as it goes; ``write_many(pid,
  pairs)``: many blocks in one call (no CRC); ``write_table(pid, local,
  remote)`` the same from an (address, length) table of ours.
- ``read_spans_into(pid, dst, spans)`` / ``write_spans_from(pid, spans, src)``:
  the same for a block in several pieces of the other process's memory
  (``Segments``): each call moves one piece of ``dst``/``src`` from or to
  as many (address, length) spans as it covers (at most IOV_MAX iovecs per
  call, ``segments.pieces``), so the local side stays one pass with the CRC
  fused in, whatever the segments' sizes.
- ``allow_reader(pid) -> bool`` (client): let process ``pid`` read our memory;
  where Yama is loaded a process names one such reader at a time, so a second
  store is refused (that lane then copies through its region as before);
  without Yama every store of the same user may.
- ``peer_pid(sock)``: the pid the kernel vouches for on a connected unix
  socket (SO_PEERCRED): the one fact a client cannot forge.
- ``take_fd(pidfd, fd) -> fd``: a copy of file descriptor ``fd`` of the
  process ``pidfd`` pins (``pidfd_getfd``, Linux 5.6+; the same permission
  as ``process_vm_writev``): how a client's shared pool reaches the store.
- ``available()``: Linux with the syscall present.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.checksum import crc32c
from kvstore.lanes.segments import IOV_MAX, Spans, pieces
from kvstore.memops import address_of as address_of  # re-exported: the addresses its calls take
from kvstore.memops import addresses_of

PIECE = 512 << 10
IOV_BATCH = 1024  # Linux's IOV_MAX: the most blocks one process_vm_writev moves
PR_SET_PTRACER = 0x59616D61


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class DirectReadError(OSError):
    pass


_libc: Any = None
_allowed: int | None = None  # the store Yama lets read us
_no_yama = False  # PR_SET_PTRACER said EINVAL: no Yama, any same-user store may read us
_allowed_lock = threading.Lock()


def _lib() -> Any:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        for fn in (lib.process_vm_readv, lib.process_vm_writev):
            fn.argtypes = [
                ctypes.c_int,
                ctypes.POINTER(_IoVec),
                ctypes.c_ulong,
                ctypes.POINTER(_IoVec),
                ctypes.c_ulong,
                ctypes.c_ulong,
            ]
            fn.restype = ctypes.c_ssize_t
        lib.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        lib.prctl.restype = ctypes.c_int
        _libc = lib
    return _libc


def available() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        return hasattr(_lib(), "process_vm_readv")
    except OSError:
        return False


def read_into(pid: int, dst: memoryview, address: int) -> int:
    """Copy ``len(dst)`` bytes from ``address`` in process ``pid`` into ``dst``; the CRC32C of what landed."""
    return _transfer(_lib().process_vm_readv, "read", pid, dst, ((address, len(dst)),), crc=True)


def write_from(pid: int, address: int, src: memoryview, crc: bool = True) -> int:
    """Copy ``src`` to ``address`` in process ``pid``; the CRC32C of ``src`` (each piece read while in cache),
    or 0 without ``crc``."""
    return _transfer(_lib().process_vm_writev, "wrote", pid, src, ((address, len(src)),), crc)


def write_many(pid: int, pairs: list[tuple[int, Any]]) -> None:
    """Copy each ``(address, src)`` of ``pairs`` to ``address`` in process ``pid``: one process_vm_writev per
    ``IOV_BATCH`` blocks instead of one per block (a Get of many small blocks pays a syscall, not 32)."""
    _move_many(_lib().process_vm_writev, "wrote", pid, pairs)


def write_table(pid: int, local: np.ndarray, remote: np.ndarray) -> int:
    """``write_many`` of an (address, length) int64 table of our memory (``memops.addresses_of``): row ``k``
    copied to ``remote[k]`` in process ``pid`` (no tuple and no address lookup a block); the bytes written."""
    return _move_table(_lib().process_vm_writev, "wrote", pid, local, remote)


def write_scattered(pid: int, blocks: Sequence[tuple[Spans | np.ndarray, Any]]) -> None:
    """Copy each ``(spans, src)`` of ``blocks`` across its (address, length) ``spans`` in process ``pid`` (they
    add up to ``len(src)``): one process_vm_writev per run of blocks with at most ``IOV_BATCH`` spans, the
    iovecs made as arrays (a vLLM block's 30 pages took a Python step and a ctypes object each, then one call
    per block). ``spans`` may be a uint64 array of (address, length) rows (``segments.SpanTable.rows``), joined
    as arrays. A block of more spans than that is written alone, in pieces (``write_spans_from``)."""
    syscall, start = _lib().process_vm_writev, 0
    while start < len(blocks):
        spans, src = blocks[start]
        if len(spans) > IOV_BATCH:
            if isinstance(spans, np.ndarray):
                spans = tuple(map(tuple, spans.tolist()))
            write_spans_from(pid, spans, src, crc=False)
            start += 1
            continue
        stop, count = start, 0
        while stop < len(blocks) and count + len(blocks[stop][0]) <= IOV_BATCH:
            count += len(blocks[stop][0])
            stop += 1
        batch = blocks[start:stop]
        local = addresses_of([src for _, src in batch]).astype(np.uint64)
        if isinstance(batch[0][0], np.ndarray):
            remote = np.concatenate([np.asarray(spans, dtype=np.uint64) for spans, _ in batch])
        else:
            remote = np.array([span for spans, _ in batch for span in spans], dtype=np.uint64).reshape(-1, 2)
        total = int(local[:, 1].sum())
        if int(remote[:, 1].sum()) != total:
            raise ValueError(f"{len(remote)} spans of {int(remote[:, 1].sum())} bytes for {total} local bytes")
        got = syscall(pid, _iovecs(local), len(local), _iovecs(remote), len(remote), 0)
        if got != total:
            first = int(remote[0, 0])
            raise _short(got, f"wrote {max(got, 0)} of {total} bytes of {len(batch)} blocks in {len(remote)} spans "
                         f"(first at {first:#x})", pid)  # fmt: skip
        start = stop


def _short(got: int, what: str, pid: int) -> DirectReadError:
    """A process_vm_readv/writev that moved less than asked (``got`` < 0: failed, with errno)."""
    err = ctypes.get_errno() if got < 0 else 0
    return DirectReadError(err, f"{what} in process {pid}{': ' + os.strerror(err) if err else ''}")


def _iovecs(table: np.ndarray) -> Any:
    """A C-contiguous (address, length) uint64 table as the ``struct iovec *`` it is laid out as."""
    return table.ctypes.data_as(ctypes.POINTER(_IoVec))


def read_many(pid: int, pairs: list[tuple[int, Any]]) -> None:
    """Fill each ``(address, dst)`` of ``pairs`` from ``address`` in process ``pid`` (``len(dst)`` bytes): one
    process_vm_readv per ``IOV_BATCH`` blocks, as ``write_many``."""
    _move_many(_lib().process_vm_readv, "read", pid, pairs)


def _move_many(syscall: Any, verb: str, pid: int, pairs: list[tuple[int, Any]]) -> None:
    remote = np.fromiter((address for address, _ in pairs), dtype=np.uint64, count=len(pairs))
    _move_table(syscall, verb, pid, addresses_of([local for _, local in pairs]), remote)


def _move_table(syscall: Any, verb: str, pid: int, local: np.ndarray, remote: np.ndarray) -> int:
    """Row ``k`` of our (address, length) table to or from ``remote[k]`` in process ``pid``, one vectored call per
    ``IOV_BATCH`` rows with the iovecs made as arrays; the bytes moved."""
    moved = 0
    for start in range(0, len(local), IOV_BATCH):
        mine = np.ascontiguousarray(local[start : start + IOV_BATCH], dtype=np.uint64)
        theirs = np.empty_like(mine)
        theirs[:, 0], theirs[:, 1] = remote[start : start + IOV_BATCH], mine[:, 1]
        total = int(mine[:, 1].sum())
        got = syscall(pid, _iovecs(mine), len(mine), _iovecs(theirs), len(theirs), 0)
        if got != total:
            first = int(theirs[0, 0])
            raise _short(got, f"{verb} {max(got, 0)} of {total} bytes of {len(mine)} blocks (first at {first:#x})", pid)
        moved += total
    return moved


def read_spans_into(pid: int, dst: memoryview, spans: Spans) -> int:
    """Fill ``dst`` from the (address, length) ``spans`` of process ``pid``, in order (their lengths add up to
    ``len(dst)``); the CRC32C of what landed."""
    return _transfer(_lib().process_vm_readv, "read", pid, dst, spans, crc=True)


def write_spans_from(pid: int, spans: Spans, src: memoryview, crc: bool = True) -> int:
    """Copy ``src`` across the (address, length) ``spans`` of process ``pid``, in order (their lengths add up
    to ``len(src)``); the CRC32C of ``src``, or 0 without ``crc``."""
    return _transfer(_lib().process_vm_writev, "wrote", pid, src, spans, crc)


def _transfer(syscall: Any, verb: str, pid: int, local_buf: memoryview, spans: Spans, crc: bool) -> int:
    """Move ``local_buf`` to or from the remote ``spans`` in ``pid``, one ``PIECE`` of the local buffer per
    call (with as many remote iovecs as that piece covers, at most IOV_MAX), each piece CRC32C'd (when asked)
    right after it moved, while it is in cache."""
    local = np.frombuffer(local_buf, dtype=np.uint8)
    base, n, value = int(local.ctypes.data), len(local), 0
    if sum(length for _, length in spans) != n:
        raise ValueError(f"{len(spans)} spans of {sum(length for _, length in spans)} bytes for {n} local bytes")
    start = 0
    for run in pieces([length for _, length in spans], PIECE, IOV_MAX):
        size = sum(k for _, _, k in run)
        liov = _IoVec(base + start, size)
        remote: Any
        if len(run) == 1:
            index, offset, _ = run[0]
            riov: Any = _IoVec(spans[index][0] + offset, size)
            remote, count = ctypes.byref(riov), 1
        else:
            remote = (_IoVec * len(run))(*[_IoVec(spans[index][0] + offset, k) for index, offset, k in run])
            count = len(run)
        got = syscall(pid, ctypes.byref(liov), 1, remote, count, 0)
        if got != size:
            at = spans[run[0][0]][0] + run[0][1]
            raise _short(got, f"{verb} {max(got, 0)} of {size} bytes at {at:#x} ({count} spans)", pid)
        if crc:
            value = crc32c(local[start : start + size], value)
        start += size
    return value


def allow_reader(pid: int) -> bool:
    """Let ``pid`` read this process's memory; False if Yama holds another store's pid for it already.

    Yama's PR_SET_PTRACER names one process at a time, so where Yama is loaded a client is direct with one
    store. Without Yama (prctl says EINVAL) same-user reads need no permission and nothing limits the count:
    a client of several local stores is direct with each (it was refused the second, so that lane copied
    through its region)."""
    global _allowed, _no_yama
    with _allowed_lock:
        if _no_yama:
            return True
        if _allowed not in (None, pid):
            return False
        if _lib().prctl(PR_SET_PTRACER, pid, 0, 0, 0) != 0:
            if ctypes.get_errno() != errno.EINVAL:
                return False
            _no_yama = True
            return True
        _allowed = pid
        return True


def forget_reader() -> None:
    """Withdraw the permission ``allow_reader`` gave, so another store may be allowed (a test process that
    moves on to a new store; a store still reading this process's memory then fails its reads)."""
    global _allowed
    with _allowed_lock:
        if _allowed is not None:
            _lib().prctl(PR_SET_PTRACER, 0, 0, 0, 0)
            _allowed = None


def peer_pid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, _uid, _gid = struct.unpack("3i", creds)
    return int(pid)


PIDFD_GETFD = 438  # the same number on every architecture (the unified syscall table)


def take_fd(pidfd: int, fd: int) -> int:
    """Our own descriptor of the open file behind ``fd`` in the process ``pidfd`` pins (close-on-exec)."""
    got = _lib().syscall(PIDFD_GETFD, pidfd, fd, 0)
    if got < 0:
        err = ctypes.get_errno()
        raise DirectReadError(err, f"pidfd_getfd of fd {fd}: {os.strerror(err)}")
    return int(got)
