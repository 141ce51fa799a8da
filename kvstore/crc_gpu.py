"""CRC32C of device memory, computed on the GPU: equal to ``kvstore.checksum.crc32c`` of the same bytes.

Why: a cuda_ipc Put checksums every block where it lands in HBM; on the CPU
that costs a device -> host copy plus about 11 ms per 128 MiB on one core of
an H200 host (most of the Put). Here the bytes never leave the device.

How (two small CUDA kernels through cupy, the ``gpu`` extra):

1. every block is cut into chunks of ``CHUNK`` bytes, its *first* chunk taking
   the remainder, so all later chunks are full; one thread per chunk computes
   the chunk's raw CRC (register starting at 0, no final xor; reflected
   Castagnoli polynomial, slicing-by-4 tables in shared memory);
2. one thread per block folds its chunks left to right:
   ``raw(A || B) = advance_|B|(raw(A)) ^ raw(B)``, where advancing over
   ``CHUNK`` zero bytes is a fixed linear map over GF(2)^32, applied with four
   256-entry tables;
3. the standard CRC32C (initial register and final xor all ones) follows by
   linearity: ``crc32c(x) = raw(x) ^ crc32c(zeros(len(x)))``, the latter
   computed once per distinct length on the host.

``reference_crcs`` runs steps 2-3 in numpy over chunk CRCs from the CPU
library (tests here check the math without a GPU); ``GpuCrc32c.crcs`` runs
all three on the device (tests on a GPU host compare it with the CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache, lru_cache
from typing import Any

import numpy as np

from kvstore.checksum import crc32c

POLY = 0x82F63B78  # Castagnoli, reflected
CHUNK = 4096


@cache
def slicing_tables() -> np.ndarray:
    """(4, 256) uint32: the byte table and its slicing-by-4 extensions."""
    t = np.zeros((4, 256), dtype=np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (POLY if c & 1 else 0)
        t[0, i] = c
    for k in range(1, 4):
        for i in range(256):
            prev = int(t[k - 1, i])
            t[k, i] = (prev >> 8) ^ int(t[0, prev & 0xFF])
    return t


def _advance(x: int, nbytes: int) -> int:
    """The raw CRC register ``x`` after ``nbytes`` zero bytes."""
    t = slicing_tables()[0]
    for _ in range(nbytes):
        x = (x >> 8) ^ int(t[x & 0xFF])
    return x


@cache
def shift_tables(nbytes: int = CHUNK) -> np.ndarray:
    """(4, 256) uint32: advancing a register over ``nbytes`` zero bytes, byte by byte of the register."""
    basis = [_advance(1 << bit, nbytes) for bit in range(32)]
    out = np.zeros((4, 256), dtype=np.uint32)
    for j in range(4):
        for v in range(256):
            acc = 0
            for bit in range(8):
                if v >> bit & 1:
                    acc ^= basis[8 * j + bit]
            out[j, v] = acc
    return out


@lru_cache(maxsize=256)
def zeros_crc(nbytes: int) -> int:
    """crc32c of ``nbytes`` zero bytes (the all-ones initial register and final xor, moved to the end)."""
    return crc32c(bytes(nbytes)) if nbytes else 0


def plan(lengths: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Chunks of each block, first chunk short: (offset in block, length, block's first chunk, chunk count)."""
    n = np.asarray(lengths, dtype=np.int64)
    count = np.maximum(1, -(-n // CHUNK))
    first = np.concatenate(([0], np.cumsum(count)[:-1])).astype(np.int64)
    head = n - (count - 1) * CHUNK  # 1..CHUNK (0 for an empty block)
    idx = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(first, count)
    head_rep = np.repeat(head, count)
    offsets = np.where(idx == 0, 0, head_rep + (idx - 1) * CHUNK)
    lens = np.where(idx == 0, head_rep, CHUNK)
    return offsets, lens, first, count


def combine(chunk_raw: np.ndarray, first: np.ndarray, count: np.ndarray, lengths: Sequence[int]) -> list[int]:
    """Fold raw chunk CRCs into each block's crc32c (numpy; the GPU kernel does the same per block)."""
    sh = shift_tables()
    out = []
    for b, n in enumerate(lengths):
        s = int(first[b])
        crc = int(chunk_raw[s])
        for i in range(s + 1, s + int(count[b])):
            crc = int(sh[0, crc & 0xFF] ^ sh[1, crc >> 8 & 0xFF] ^ sh[2, crc >> 16 & 0xFF] ^ sh[3, crc >> 24]) ^ int(
                chunk_raw[i]
            )
        out.append(crc ^ zeros_crc(int(n)))
    return out


def reference_crcs(buffers: Sequence[Any]) -> list[int]:
    """The chunked algorithm on the host (chunk raws from the CPU library): for tests of the math."""
    views = [memoryview(b).cast("B") for b in buffers]
    offsets, lens, first, count = plan([len(v) for v in views])
    owner = np.repeat(np.arange(len(views)), count)
    raw = np.array(
        [crc32c(views[o][off : off + ln]) ^ zeros_crc(int(ln)) for o, off, ln in zip(owner, offsets, lens)],
        dtype=np.uint64,
    )
    return combine(raw, first, count, [len(v) for v in views])


_KERNELS = r"""
extern "C" __global__ void chunk_crc(const unsigned long long* ptrs, const long long* lens,
                                     unsigned int* out, const unsigned int* table, int n) {
    __shared__ unsigned int t[4][256];
    for (int i = threadIdx.x; i < 1024; i += blockDim.x) t[i >> 8][i & 255] = table[i];
    __syncthreads();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n) return;
    const unsigned char* p = (const unsigned char*)ptrs[c];
    long long len = lens[c], i = 0;
    unsigned int crc = 0;
    while (i < len && (((unsigned long long)(p + i)) & 3)) { crc = (crc >> 8) ^ t[0][(crc ^ p[i]) & 255]; i++; }
    for (; i + 4 <= len; i += 4) {
        unsigned int w = *(const unsigned int*)(p + i) ^ crc;
        crc = t[3][w & 255] ^ t[2][(w >> 8) & 255] ^ t[1][(w >> 16) & 255] ^ t[0][w >> 24];
    }
    for (; i < len; i++) crc = (crc >> 8) ^ t[0][(crc ^ p[i]) & 255];
    out[c] = crc;
}

extern "C" __global__ void fold(const unsigned int* chunk, const long long* first, const long long* count,
                                const unsigned int* sh, const unsigned int* fix, unsigned int* out, int n) {
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n) return;
    long long s = first[b], e = s + count[b];
    unsigned int crc = chunk[s];
    for (long long i = s + 1; i < e; i++)
        crc = sh[crc & 255] ^ sh[256 + ((crc >> 8) & 255)] ^ sh[512 + ((crc >> 16) & 255)] ^ sh[768 + (crc >> 24)]
              ^ chunk[i];
    out[b] = crc ^ fix[b];
}
"""


class GpuCrc32c:
    """CRC32C of CUDA tensors on their device (cupy kernels, compiled once per process)."""

    def __init__(self) -> None:
        import cupy

        self._cp = cupy
        module = cupy.RawModule(code=_KERNELS)
        self._chunk, self._fold = module.get_function("chunk_crc"), module.get_function("fold")
        self._tables: dict[int, tuple[Any, Any]] = {}

    def crcs(self, tensors: Sequence[Any]) -> list[int]:
        import torch

        cp = self._cp
        if not tensors:
            return []
        device = tensors[0].device
        lengths = [t.numel() * t.element_size() for t in tensors]
        offsets, lens, first, count = plan(lengths)
        bases = np.array([t.data_ptr() for t in tensors], dtype=np.uint64)
        ptrs = np.repeat(bases, count) + offsets.astype(np.uint64)
        fix = np.array([zeros_crc(n) for n in lengths], dtype=np.uint32)
        with cp.cuda.Device(device.index):
            tables = self._tables.get(device.index)
            if tables is None:
                tables = self._tables[device.index] = (
                    cp.asarray(slicing_tables().reshape(-1)),
                    cp.asarray(shift_tables().reshape(-1)),
                )
            stream = cp.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)
            with stream:
                d_ptrs, d_lens = cp.asarray(ptrs), cp.asarray(lens)
                d_first, d_count, d_fix = cp.asarray(first), cp.asarray(count), cp.asarray(fix)
                chunks = cp.empty(len(ptrs), dtype=cp.uint32)
                out = cp.empty(len(tensors), dtype=cp.uint32)
                self._chunk(
                    ((len(ptrs) + 255) // 256,), (256,), (d_ptrs, d_lens, chunks, tables[0], np.int32(len(ptrs)))
                )
                self._fold(
                    ((len(tensors) + 127) // 128,),
                    (128,),
                    (chunks, d_first, d_count, tables[1], d_fix, out, np.int32(len(tensors))),
                )
                result = out.get(stream=stream)
            stream.synchronize()
        return [int(x) for x in result]


_gpu: GpuCrc32c | None = None
_gpu_failed = False


def gpu_crc32c() -> GpuCrc32c | None:
    """The process's GPU checksummer, or None where cupy or its compiler is missing (callers use the CPU)."""
    global _gpu, _gpu_failed
    if _gpu is None and not _gpu_failed:
        try:
            _gpu = GpuCrc32c()
        except Exception as err:  # noqa: BLE001 - ImportError, or NVRTC missing: fall back, once, with the reason
            import logging

            logging.getLogger(__name__).info("CRC32C stays on the CPU: no GPU kernel (%s)", err)
            _gpu_failed = True
    return _gpu
