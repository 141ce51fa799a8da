"""The write-combining buffer: record bytes in, few large aligned writes out.

``WriteCombiner.write(fh, offset, chunks)`` lays a contiguous run of bytes
(headers, payloads, zero padding) at ``offset`` of one file. The bytes are
copied into page-aligned buffers of ``buffer_bytes`` each; a full buffer is
handed to a writer thread as one O_DIRECT pwrite while the caller fills the
next one, so copying and disk I/O overlap. ``write`` returns once every pwrite
of the run has completed (the caller then fdatasyncs per its write policy), or
raises the first OSError after all in-flight writes have settled. Memory is
bounded: ``buffers x buffer_bytes``, whatever the size of the batch.

Only one run is written at a time (the caller serialises appends).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable, Union

import numpy as np

from kvstore.tiers.nvme.format import PAGE
from kvstore.tiers.nvme.io import FileHandle, IoBackend, aligned_buffer

Chunk = Union[np.ndarray, int]  # bytes to copy, or a count of zero bytes


class WriteCombiner:
    def __init__(self, backend: IoBackend, buffer_bytes: int = 8 << 20, buffers: int = 2):
        if buffer_bytes % PAGE or buffer_bytes <= 0:
            raise ValueError("write buffer size must be a positive multiple of 4 KiB")
        self.backend = backend
        self.buffer_bytes = buffer_bytes
        self._bufs = [aligned_buffer(buffer_bytes) for _ in range(max(2, buffers))]
        self._inflight: list[Future[None] | None] = [None] * len(self._bufs)
        self._pool = ThreadPoolExecutor(len(self._bufs) - 1, thread_name_prefix="nvme-write")
        self.writes_issued = 0

    def write(self, fh: FileHandle, offset: int, chunks: Iterable[Chunk]) -> int:
        """Write the concatenation of ``chunks`` at ``offset``; returns the bytes written."""
        if offset % PAGE:
            raise ValueError("runs start on a 4 KiB boundary")
        cur, fill, file_pos, total = 0, 0, offset, 0
        error: BaseException | None = None
        try:
            for chunk in chunks:
                if isinstance(chunk, int):
                    n, src = chunk, None
                else:
                    n, src = chunk.nbytes, chunk
                done = 0
                while done < n:
                    if fill == self.buffer_bytes:
                        self._submit(cur, fh, fill, file_pos)
                        file_pos += fill
                        cur = (cur + 1) % len(self._bufs)
                        self._wait(cur)
                        fill = 0
                    take = min(n - done, self.buffer_bytes - fill)
                    dst = self._bufs[cur][fill:fill + take]
                    if src is None:
                        dst.fill(0)
                    else:
                        np.copyto(dst, src[done:done + take])
                    fill += take
                    done += take
                total += n
            if fill:
                if fill % PAGE:
                    raise ValueError("a run must end on a 4 KiB boundary")
                self._submit(cur, fh, fill, file_pos)
        except BaseException as e:  # noqa: BLE001 - re-raised below, after draining
            error = e
        for i in range(len(self._bufs)):
            try:
                self._wait(i)
            except BaseException as e:  # noqa: BLE001
                error = error or e
        if error is not None:
            raise error
        return total

    def _submit(self, i: int, fh: FileHandle, nbytes: int, file_pos: int) -> None:
        self._inflight[i] = self._pool.submit(self.backend.pwrite, fh, self._bufs[i][:nbytes], file_pos)
        self.writes_issued += 1

    def _wait(self, i: int) -> None:
        fut, self._inflight[i] = self._inflight[i], None
        if fut is not None:
            fut.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
