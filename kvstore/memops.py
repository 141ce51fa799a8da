"""Memory operations of the lanes: a copy with its CRC32C fused in, and host views of buffers.

``copy_crc(dst, src)`` copies in pieces of ``PIECE`` bytes and computes the
CRC32C of each piece right after copying it, while it is still in cache: one
pass over memory instead of two (measured here over 2 MiB blocks: 13.8 GB/s
with 512 KiB pieces, 13.4 with 256 KiB, 12.4 for a copy then a CRC, against
20.6 GB/s for the copy alone and 15.8 for the CRC alone). On this project's 2-core VM the package's CRC32C
runs at 6 GB/s, so with ``kvstore.memops_jit``'s kernels compiled a copy of ``JIT_BYTES`` or more goes through
its fused loop instead (each 64 bytes copied and folded into the CRC32C while in registers: 9.6 GB/s a core
over 1 MiB, where the pieces here take 4.5).

``crcs_of(views)`` and ``run_rows(rows, blocks)`` (raw (src, dst, n, block) rows) do the same for a whole batch
of blocks in one compiled call (``memops_jit.copy_rows``), where a call per block let two threads of one process
reach only half the kernel's speed (the GIL, taken again after every call, is the likely cost). A batch that only
checks (no row copies) of rows of ``LIBRARY_ROW_BYTES`` or more on average goes to the package instead, a call a
row, where its CRC32C outruns the kernel's folding loop on this CPU (``memops_jit.library_crc_faster``): on
2026-12-04 it ran 1.3-2.3x the loop (32 x 64 KiB: 0.19 / 0.35 ms against 0.40 / 0.55, in cache / not; 16 x
1.47 MB: 1.9 / 2.4 against 3.4 / 3.6), and it lets go of the GIL (two threads 1.7x one).
``address_of(buf)``: (address, length) of a host buffer; ``addresses_of(bufs)`` a batch's as an int64 table, whose
CRC32Cs ``crcs_at(table)`` takes (a Get that checks and then writes its blocks finds each address once).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
from crc32c import crc32c as _crc32c

from kvstore import memops_jit
from kvstore.checksum import crc32c

PIECE = 512 << 10
LIBRARY_ROW_BYTES = 16 << 10
JIT_BYTES = 32 << 10
NUMPY_COPY_BYTES = 1 << 20


def copy_crc(dst: memoryview, src: memoryview, crc: int = 0) -> int:
    """Copy ``src`` into ``dst`` (same length, both flat byte views); the CRC32C of the bytes copied."""
    n = len(src)
    if n >= JIT_BYTES and memops_jit.ready():
        d = np.frombuffer(dst, dtype=np.uint8)
        if d.flags.writeable:
            return memops_jit.copy_crc_of(d, np.frombuffer(src, dtype=np.uint8), crc)
    if n < PIECE:
        dst[:] = src
        return crc32c(dst, crc)
    d, s = np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8)
    for start in range(0, n, PIECE):
        end = start + PIECE if start + PIECE < n else n
        np.copyto(d[start:end], s[start:end])  # numpy lets go of the GIL while it copies; a memoryview does not
        crc = crc32c(d[start:end], crc)
    return crc


def run_rows(rows: Sequence[tuple[int, int, int, int]] | np.ndarray, blocks: int, check: bool = True) -> list[int]:
    """Each (src, dst, n, block) row in order: n bytes at address src copied to dst (dst 0: only read), their
    CRC32C chained onto that block's; the ``blocks`` CRC32Cs (zeros without ``check``: then only copies). One
    compiled call when the kernels are ready (``memops_jit.copy_rows``), else a memmove and a CRC32C a row."""
    if not len(rows):
        return [0] * blocks
    table = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
    if memops_jit.ready() and not (check and _library_checks(table)):
        crcs = memops_jit.copy_rows(table, blocks, check)
        return crcs.tolist() if check else [0] * blocks
    values = [0] * blocks
    for src, dst, n, block in table.tolist():
        if dst:
            ctypes.memmove(dst, src, n)  # lets go of the GIL
        if check:
            values[block] = _crc32c((ctypes.c_char * n).from_address(src), values[block])
    return values


def _library_checks(table: np.ndarray) -> bool:
    """Only reads, of rows large enough for a call each, on a CPU where the package's CRC32C is the faster."""
    return (
        not table[:, 1].any()
        and int(table[:, 2].sum()) >= LIBRARY_ROW_BYTES * table.shape[0]
        and memops_jit.library_crc_faster()
    )


def crc_of_spans(spans: np.ndarray) -> int:
    """The CRC32C of the bytes at an (address, length) int64 table's rows, in order, chained: one compiled call
    when the kernels are ready."""
    rows = np.zeros((len(spans), 4), dtype=np.int64)
    rows[:, 0], rows[:, 2] = spans[:, 0], spans[:, 1]
    return run_rows(rows, 1)[0]


def crcs_of(views: Sequence[memoryview]) -> list[int]:
    """The CRC32C of each flat byte view, in one compiled call when the kernels are ready."""
    if len(views) < 2 or not memops_jit.ready():
        return [crc32c(v) for v in views]
    return crcs_at(addresses_of(views))


def addresses_of(bufs: Sequence[Any]) -> np.ndarray:
    """Each contiguous host buffer's (address, length) as the rows of an int64 table: taken once for a batch
    that both checks and moves its blocks (``crcs_at``, ``cma.write_table``)."""
    return np.array([address_of(b) for b in bufs], dtype=np.int64).reshape(-1, 2)


def crcs_at(table: np.ndarray) -> list[int]:
    """The CRC32C of the bytes at each (address, length) row of an int64 table (``addresses_of``)."""
    rows = np.zeros((len(table), 4), dtype=np.int64)
    rows[:, 0], rows[:, 2], rows[:, 3] = table[:, 0], table[:, 1], np.arange(len(table))
    return run_rows(rows, len(table))


def address_of(buf: Any) -> tuple[int, int]:
    """(address, length) of a contiguous host buffer (bytes, memoryview, numpy array, CPU tensor)."""
    if hasattr(buf, "data_ptr"):  # torch tensor
        return int(buf.data_ptr()), int(buf.numel() * buf.element_size())
    if type(buf) is memoryview and buf.nbytes and not buf.readonly and buf.c_contiguous:  # ~4x cheaper than numpy
        return ctypes.addressof(ctypes.c_char.from_buffer(buf)), buf.nbytes
    array = np.frombuffer(buf, dtype=np.uint8)
    return int(array.ctypes.data), int(array.nbytes)


def host_view(buf: Any) -> memoryview | None:
    """A flat writable byte view of a host buffer (memoryview, numpy, CPU tensor); None for device memory."""
    if hasattr(buf, "copy_"):  # torch tensor
        if buf.device.type != "cpu":
            return None
        if not buf.is_contiguous():
            raise ValueError("a tensor buffer must be contiguous")  # a reshape would copy: writes would be lost
        import torch

        return memoryview(buf.reshape(-1).view(torch.uint8).numpy())  # bf16 has no numpy dtype: bytes do
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def host_bytes(buf: Any) -> memoryview:
    """A flat byte view of a buffer to send: ``host_view``'s, or a device tensor's bytes downloaded once (an HBM
    tier's slot)."""
    view = host_view(buf)
    if view is not None:
        return view
    return memoryview(buf.cpu().reshape(-1).numpy()).cast("B")


def copy_into(dst: Any, src: Any) -> None:
    """Copy between host buffers and torch tensors of any device (the HBM tier's slots are tensors)."""
    d, s = host_view(dst), host_view(src)
    if d is not None and s is not None:
        if len(d) >= NUMPY_COPY_BYTES:  # numpy's copy: about 1.6x a memoryview assignment for MiB blocks here
            np.copyto(np.frombuffer(d, dtype=np.uint8), np.frombuffer(s, dtype=np.uint8))
        else:
            d[:] = s
        return
    import torch

    dt = dst if hasattr(dst, "copy_") else torch.frombuffer(host_view(dst), dtype=torch.uint8)
    st = src if hasattr(src, "copy_") else torch.frombuffer(host_view(src), dtype=torch.uint8)
    dt.copy_(st.view(torch.uint8).reshape(-1))
