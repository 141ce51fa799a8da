"""Memory operations of the lanes: a copy with its CRC32C fused in, host views, batch buffers.

``copy_crc(dst, src)`` copies in pieces of ``PIECE`` bytes and computes the
CRC32C of each piece right after copying it, while it is still in cache: one
pass over memory instead of two (measured here: 12.8 GB/s against 10 GB/s for
a copy followed by a CRC over 2 MiB blocks).
"""
from __future__ import annotations

import mmap
from typing import Any, Sequence

from kvstore.checksum import crc32c

PIECE = 256 << 10


def copy_crc(dst: memoryview, src: memoryview, crc: int = 0) -> int:
    """Copy ``src`` into ``dst`` (same length, both flat byte views); the CRC32C of the bytes copied."""
    n = len(src)
    for start in range(0, n, PIECE):
        end = start + PIECE if start + PIECE < n else n
        piece = dst[start:end]
        piece[:] = src[start:end]
        crc = crc32c(piece, crc)
    return crc


def host_view(buf: Any) -> memoryview | None:
    """A flat writable byte view of a host buffer (memoryview, numpy, CPU tensor); None for device memory."""
    if hasattr(buf, "copy_"):  # torch tensor
        if buf.device.type != "cpu":
            return None
        return memoryview(buf.numpy()).cast("B")
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def copy_into(dst: Any, src: Any) -> None:
    """Copy between host buffers and torch tensors of any device (the HBM tier's slots are tensors)."""
    d, s = host_view(dst), host_view(src)
    if d is not None and s is not None:
        d[:] = s
        return
    import torch

    dt = dst if hasattr(dst, "copy_") else torch.frombuffer(host_view(dst), dtype=torch.uint8)
    st = src if hasattr(src, "copy_") else torch.frombuffer(host_view(src), dtype=torch.uint8)
    dt.copy_(st.view(torch.uint8).reshape(-1))


HUGE_PAGE = 2 << 20


def alloc_blocks(lengths: Sequence[int]) -> list[memoryview]:
    """Fresh buffers for a batch of blocks, carved from one anonymous mapping.

    One mapping (transparent huge pages where the kernel allows them) instead of
    one allocation per block: fresh memory is paid for by page faults, and per
    2 MiB block allocations measured five times slower here than one mapping
    for the batch. The mapping lives as long as any of the returned views.
    """
    total = sum(lengths)
    if total == 0:
        return [memoryview(b"") for _ in lengths]
    size = -(-total // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if size >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    whole = memoryview(region)
    views, offset = [], 0
    for n in lengths:
        views.append(whole[offset : offset + n])
        offset += n
    return views
