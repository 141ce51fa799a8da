"""Compiled copy and CRC32C loops (numba; x86-64 with SSE4.2 and PCLMULQDQ): a block's bytes read once.

On this project's 2-core AMD EPYC VM (2026-12-01) the `crc32c` package runs at 5.8 GB/s a core, the CRC32
instruction's throughput (three interleaved streams gain nothing here), and glibc's memmove of a 48 KiB page
at 4.4 GB/s. A vLLM block is 30 such pages: copying 62 blocks (91 MB) out of the store's mapped DRAM into
their pages took 16.6 ms on two threads, and their CRC32Cs 16 ms more, over bytes already read once. The
kernels here copy each 64 bytes and fold them into the CRC32C (carry-less multiplication: PCLMULQDQ, 9-10
GB/s a core over 1 MiB) while they are in registers, with non-temporal stores into aligned memory past
``STREAM_BYTES``: the same 62 blocks copied and checked in 9-12 ms on two threads, what a torch copy alone
takes (10-11 ms). How the folding works: ``kvstore/memops_kernels.py``; tests/test_memops_jit.py checks every
length, alignment and starting value against the `crc32c` package.

- ``AVAILABLE``: numba is installed (``kvstore[fast]``; ``KVSTORE_NO_JIT`` turns it off) and the CPU has SSE4.2
  and PCLMULQDQ. The kernels themselves live in ``kvstore.memops_kernels``, imported when first wanted.
- ``crc_at(address, n, crc) -> crc``: the CRC32C of ``n`` bytes at an address, continuing from ``crc``.
- ``copy_crc_at(src, dst, n, crc) -> crc``: copy ``n`` bytes and return their CRC32C, one pass.
- ``crc_of(array, crc)``, ``copy_crc_of(dst, src, crc)``: the same over uint8 arrays (numba takes an array's
  address in 0.3 us; Python's ``.ctypes.data`` costs 3.4).
- ``copy_to_spans(src, spans, check) -> crc``: contiguous bytes at ``src`` across ``spans`` (an int64
  array of (address, length) rows), with their chained CRC32C when ``check`` (else 0).
- ``gather_spans(dst, spans, check) -> crc``: the reverse, spans into contiguous bytes at ``dst``.
- ``copy_rows(rows, blocks, check) -> crcs``: a batch in one call, each row (src, dst, n, block) of an int64
  array copying n bytes (dst 0: reading them only) with their CRC32C chained onto block ``block``'s (uint64
  array of ``blocks``; zeros without ``check``). Two threads of one process, each taking the CRC32C of 16
  blocks of 64 KiB a call at a time, ran at 9.6 GB/s a thread; calling the kernel once per block, at 3.5 or
  7.5 (it varied from run to run), where two processes calling per block reached 7.9 each: the threads'
  shared GIL, let go and taken again around every call, is the likely cost.
- ``library_crc_faster() -> bool``: the `crc32c` package's CRC32C (CRC32 instructions) beats the folding loop
  on this CPU by ``LIBRARY_MARGIN``, measured once over 256 KiB in cache when the kernels are ready (True
  before). This VM's host changes: on 2026-12-01 the package ran at 5.8 GB/s and the loop at 9-10; on 2026-12-04
  the package at 15.6 and the loop at 7.7; on 2026-12-05 (Zen 4) the package at 25-28 in cache but 15 over 64
  MiB, the wide loop (``memops_kernels.WIDE``) at 24-29 in cache and 19-26 out of it: the margin keeps a tie in cache
  with the loop, which wins on bytes that are not there (a disk's or another process's). Checks that only read
  (no copy) follow it (``checksum.crc32c``, ``memops.run_rows``); a copy with its CRC32C stays one pass through
  the loop.
- ``ready() -> bool``: the kernels are compiled. The first call starts compiling them (or loading them from
  numba's on-disk cache: 2.5-4 s cold here, 0.6 s cached) on a background thread and says False until done,
  so callers keep the `crc32c` package's path meanwhile and no request waits for a compiler.
- ``warm_up()``: compile (or load) now, on the calling thread.

Addresses must be valid for the lengths given: the kernels read and write raw memory, unchecked.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import threading
from types import ModuleType
from typing import Any

import numpy as np

from kvstore.background_compile import BackgroundCompile

STREAM_BYTES = 1 << 20  # copies this large, to a 16-byte aligned destination, bypass the cache
LIBRARY_MARGIN = 1.25  # the package is preferred when it runs this much faster than the loop, in cache


def _cpu_has_folding() -> bool:
    """x86-64 with SSE4.2 (CRC32) and PCLMULQDQ, read from /proc/cpuinfo (asking llvmlite would import it)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {"sse4_2", "pclmulqdq"} <= flags
    except OSError:
        pass
    return False


AVAILABLE = (
    not os.environ.get("KVSTORE_NO_JIT") and importlib.util.find_spec("numba") is not None and _cpu_has_folding()
)
_kernels_module: ModuleType | None = None
_load_lock = threading.Lock()


def _kernels() -> Any:
    global _kernels_module
    if _kernels_module is None:
        if not AVAILABLE:
            raise RuntimeError("the compiled kernels need numba and a CPU with SSE4.2 and PCLMULQDQ")
        with _load_lock:
            if _kernels_module is None:
                from kvstore import memops_kernels

                _kernels_module = memops_kernels
    return _kernels_module


def crc_at(address: int, n: int, crc: int = 0) -> int:
    """CRC32C of the n bytes at ``address``, continuing from ``crc``."""
    return int(_kernels().copy_crc(address, 0, n, crc, _kernels().READ))


def copy_crc_at(src: int, dst: int, n: int, crc: int = 0) -> int:
    """Copy n bytes from ``src`` to ``dst`` (not overlapping); their CRC32C, continuing from ``crc``. Copies
    of ``STREAM_BYTES`` or more to a 16-byte aligned ``dst`` bypass the cache (non-temporal stores)."""
    k = _kernels()
    mode = k.STREAM if n >= STREAM_BYTES and dst & 15 == 0 else k.STORE
    return int(k.copy_crc(src, dst, n, crc, mode))


def crc_of(data: np.ndarray, crc: int = 0) -> int:
    """CRC32C of a contiguous uint8 array (for buffers whose address Python cannot take cheaply)."""
    return int(_kernels().crc_of(data, crc))


def copy_crc_of(dst: np.ndarray, src: np.ndarray, crc: int = 0) -> int:
    """``copy_crc_at`` for contiguous uint8 arrays of the same size."""
    if dst.size != src.size:
        raise ValueError(f"copy of {src.size} bytes into {dst.size}")
    return int(_kernels().copy_crc_of(dst, src, crc, src.size >= STREAM_BYTES))


def copy_to_spans(src: int, spans: np.ndarray, check: bool) -> int:
    """The bytes at ``src`` across ``spans`` ((address, length) rows, int64), in order; their CRC32C when
    ``check``, else 0. Past ``STREAM_BYTES`` in all, spans at 16-byte aligned addresses bypass the cache."""
    return int(_kernels().spans_copy(src, spans, check, True, _streams(spans)))


def gather_spans(dst: int, spans: np.ndarray, check: bool) -> int:
    """The bytes of ``spans`` in order into contiguous memory at ``dst``; their CRC32C when ``check``."""
    return int(_kernels().spans_copy(dst, spans, check, False, _streams(spans)))


def copy_rows(rows: np.ndarray, blocks: int, check: bool) -> np.ndarray:
    """Run the (src, dst, n, block) rows in order; each block's CRC32C (see the module docstring). Past
    ``STREAM_BYTES`` in all, rows into 16-byte aligned memory bypass the cache."""
    crcs = np.zeros(blocks, dtype=np.uint64)
    stream = bool(rows.shape[0]) and int(rows[:, 2].sum()) >= STREAM_BYTES
    _kernels().rows_copy(rows, crcs, check, stream)
    return crcs


def _streams(spans: np.ndarray) -> bool:
    return bool(spans.shape[0]) and int(spans[:, 1].sum()) >= STREAM_BYTES


def _compile() -> None:
    buf = np.zeros(256, dtype=np.uint8)
    base = int(buf.ctypes.data)
    crc_at(base, 200)
    copy_crc_at(base, base + 128, 100)
    crc_of(buf, 0)
    copy_crc_of(buf[128:], buf[:128])
    spans = np.array([[base + 128, 64], [base + 192, 64]], dtype=np.int64)
    copy_to_spans(base, spans, True)
    gather_spans(base, spans, False)
    copy_rows(np.array([[base, 0, 64, 0], [base, base + 128, 64, 1]], dtype=np.int64), 2, True)


_compiled = BackgroundCompile("kvstore-memops-jit", AVAILABLE, _compile)


def ready() -> bool:
    """The kernels are compiled; the first call starts compiling them in the background (see above)."""
    return _compiled.ready()


_library_faster: bool | None = None


def library_crc_faster() -> bool:
    """True when the `crc32c` package's CRC32C outruns the folding kernel here (or the kernels are not ready)."""
    global _library_faster
    if _library_faster is None:
        if not ready():
            return True
        _library_faster = _time_crcs()
    return _library_faster


def _time_crcs(size: int = 256 << 10, reps: int = 8) -> bool:
    import time

    from crc32c import crc32c

    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    view, address = data.data, int(data.ctypes.data)
    library, kernel = float("inf"), float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        crc32c(view)
        t1 = time.perf_counter()
        crc_at(address, size)
        library, kernel = min(library, t1 - t0), min(kernel, time.perf_counter() - t1)
    return library * LIBRARY_MARGIN <= kernel


def warm_up() -> None:
    """Compile the kernels (or load them from numba's cache) now, not on a caller's first copy."""
    _compiled.warm_up()
