"""The in-process baselines of the NVMe Get benches (``bench.nvme_get``, ``bench.ttft_nvme``): what a prefix of
32 blocks costs with no store at all.

- ``RawExtents``: one O_DIRECT ``preadv`` of a prefix-sized extent of a file written beside the store's segments,
  each extent read once, in a shuffled order (the disk's speed; ``raw`` in the benches' rows);
- ``DramFloor``: 32 blocks' CRC32Cs and one copy each into page-aligned memory, each time from another part of a large
  buffer (what a checked DRAM hit costs at the least; ``dram_floor``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np

from kvstore.checksum import crc32c
from kvstore.tiers.nvme.format import record_bytes
from kvstore.tiers.nvme.io import aligned_buffer

if TYPE_CHECKING:  # numpy's stubs give ndarray __buffer__ only from Python 3.12 (collections.abc.Buffer's too)
    from typing_extensions import Buffer

PREFIX = 32
MiB = 1 << 20


class DramFloor:
    """A checked copy of 32 blocks out of a large buffer (``run(i)``), each time from another part of it."""

    def __init__(self, block: int):
        self.block = block
        self.src = np.ones(max(256 * MiB, 4 * PREFIX * block), dtype=np.uint8)  # written: every page backed
        pool = aligned_buffer(PREFIX * block)
        self.dst = [pool[k * block : (k + 1) * block] for k in range(PREFIX)]
        self.span = PREFIX * block

    def run(self, i: int) -> None:
        at = (i * self.span) % (len(self.src) - self.span + 1)
        for k, dst in enumerate(self.dst):
            src = self.src[at + k * self.block : at + (k + 1) * self.block]
            crc32c(src)
            np.copyto(dst, src)


class RawExtents:
    """A file of ``count`` prefix-sized extents written with O_DIRECT (``write(j)``), beside the store's segments;
    ``read(i)`` reads the i-th of them in a shuffled order, each once, into one buffer of this process (a repeated
    read could come from the host's cache; a separate file, so that a Get and a raw read never read the same
    bytes). With ``dst_extents`` ``count`` more, one written with each: ``dst_offset(i)`` is where the i-th of
    those lies, read once each by the worker into its Gets' own buffers (``rawdst``)."""

    def __init__(self, path: Path, block: int, count: int, rng: np.random.Generator, dst_extents: bool = False):
        self.path = path
        self.extent = PREFIX * record_bytes(block)
        self.count = count
        self.dst_extents = dst_extents
        self.buf = aligned_buffer(self.extent)
        self.buf[:] = rng.integers(0, 256, self.extent, dtype=np.uint8)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        self.order = rng.permutation(count)

    def write(self, j: int) -> None:
        """Write extent ``j`` (and ``count + j``) (the driver interleaves these with the stores' writes)."""
        os.pwrite(self.fd, cast("Buffer", self.buf), j * self.extent)
        if self.dst_extents:
            os.pwrite(self.fd, cast("Buffer", self.buf), (self.count + j) * self.extent)

    def read(self, i: int) -> None:
        os.preadv(self.fd, [cast("Buffer", self.buf)], int(self.order[i % self.count]) * self.extent)

    def dst_offset(self, i: int) -> int:
        return (self.count + int(self.order[(i + self.count // 2) % self.count])) * self.extent

    def close(self) -> None:
        os.close(self.fd)
