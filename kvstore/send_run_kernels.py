"""The numba kernel that reads runs of NVMe record payloads, checks them and sends them as TCP lane DATA frames, all
in one call that holds no GIL (``read_check_send``): the reads go to the kernel's asynchronous I/O (``io_submit``
on the O_DIRECT segment files, two pieces in flight), and as each piece lands this thread submits the next read,
checks the piece's CRC32Cs and ``writev``s its verified blocks, straight from where they were read. Loaded through
``kvstore.send_runs``.

Why: the store-read TCP lane's Get ran its pieces on reading threads and handed each verified piece to the
connection's thread, a wake-up and a Python send a piece; a Get doing the same in C (``bench.nvme_native_floor``)
reached 0.85 of the raw read at 32 x 512 KiB where the store reached 0.56 (sixty-first session). Measured with
``bench.compiled_send`` (sixty-second session, docs/nvme_log.md): Gets 1.19 / 1.00 / 1.15x as fast at 64 KiB /
512 KiB / 2 MiB, the store's CPU per Get 9-25 % lower; the rest of the gap is the Get's Python before its first
read and the promotion after its reply.

Imported only once ``kvstore.memops_jit`` has found numba and a CPU with SSE4.2 and PCLMULQDQ, and Linux on x86-64
(the system call numbers below).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kvstore.memops_kernels import READ, STREAM, copy_crc
from kvstore.payload_run_kernels import payload_iovecs

_I32, _I64 = ir.IntType(32), ir.IntType(64)
IO_SETUP, IO_DESTROY, IO_GETEVENTS, IO_SUBMIT = 206, 207, 208, 209  # x86-64
IOCB_CMD_PREADV = 7  # (8 is PWRITEV)
EINTR = 4
IOCB_WORDS, EVENT_WORDS = 8, 4  # struct iocb: 64 bytes; struct io_event: 32
HEAD_BYTES = 20  # framing.HEADER: magic, kind, 3 pad bytes, u32 metadata length, u64 payload length
PIECE_BLOCKS = 512  # the most blocks a piece may hold (runs.MAX_BLOCKS): its iovecs and frame are sized for it
SUBMIT_FAILED = -(1 << 40)  # minus errno: io_submit refused the first piece (no I/O was started)


@intrinsic
def _syscall(typingctx: Any, nr: Any, a: Any, b: Any, c: Any, d: Any, e: Any) -> Any:
    """libc's ``syscall(nr, a, b, c, d, e)``: the result, or -1 with errno set."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I64, [_I64], var_arg=True), "syscall")
        return builder.call(fn, list(args))

    i = types.int64
    return i(i, i, i, i, i, i), codegen


@intrinsic
def _writev(typingctx: Any, fd: Any, iov: Any, count: Any) -> Any:
    """libc's ``writev(fd, iov, count)``: bytes written, or -1."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        fnty = ir.FunctionType(_I64, [_I32, ir.IntType(8).as_pointer(), _I32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "writev")
        fd, iov, count = args
        return builder.call(fn, [builder.trunc(fd, _I32), builder.inttoptr(iov, ir.IntType(8).as_pointer()),
                                 builder.trunc(count, _I32)])  # fmt: skip

    return types.int64(types.int64, types.int64, types.int64), codegen


@intrinsic
def _errno(typingctx: Any) -> Any:
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32.as_pointer(), []), "__errno_location")
        return builder.sext(builder.load(builder.call(fn, [])), _I64)

    return types.int64(), codegen


@numba.njit(nogil=True, cache=True)
def setup(depth: int, ctx: Any) -> int:
    """An AIO context for ``depth`` reads in flight into ``ctx[0]``: 0, or -errno."""
    ctx[0] = 0
    err: int = 0 if _syscall(IO_SETUP, depth, ctx.ctypes.data, 0, 0, 0) == 0 else -_errno()
    return err


@numba.njit(nogil=True, cache=True)
def destroy(ctx: int) -> int:
    """End an AIO context (waits for its reads, and an RCU grace period: milliseconds): 0, or -errno."""
    return -_errno() if _syscall(IO_DESTROY, ctx, 0, 0, 0, 0) < 0 else 0


@numba.njit(nogil=True, cache=True)
def _plan(
    p: int, starts: Any, offsets: Any, lengths: Any, addresses: Any, order: Any, scratch: int, scratch_bytes: int,
    gather_block: int, iov: Any,
) -> tuple[int, int, int]:  # fmt: skip
    """Piece ``p``'s iovecs into ``iov`` (each payload into its destination, the gaps between into ``scratch``; or,
    gathered, the whole span into ``scratch``): (iovec count, first file offset, gathered scratch or 0). ``order``:
    every block's index, the blocks being in file order already."""
    lo, hi = starts[p], starts[p + 1]
    first = offsets[lo]
    span = offsets[hi - 1] + lengths[hi - 1] - first
    if gather_block > 0 and span <= scratch_bytes and lengths[lo:hi].max() <= gather_block:
        iov[0, 0], iov[0, 1] = scratch, span
        return 1, first, scratch
    return payload_iovecs(offsets, lengths, addresses, order, lo, hi, scratch, iov), first, 0


@numba.njit(nogil=True, cache=True)
def _send(sock: int, iov: Any, count: int) -> int:
    """``writev`` every iovec in full, resuming after partial writes (``iov`` is consumed): 0, or -errno."""
    i = 0
    while i < count:
        n = _writev(sock, iov.ctypes.data + i * 16, min(count - i, 1024))
        if n < 0:
            err: int = _errno()
            if err == EINTR:
                continue
            return -err
        while n > 0 and i < count:
            if n >= iov[i, 1]:
                n -= iov[i, 1]
                i += 1
            else:
                iov[i, 0] += n
                iov[i, 1] -= n
                n = 0
    return 0


@numba.njit(nogil=True, cache=True)
def _submit(
    ctx: int, fds: Any, starts: Any, offsets: Any, lengths: Any, addresses: Any, order: Any, scratch: int,
    scratch_bytes: int, gather_block: int, slots: int, p: int, slot: int, iocbs: Any, reads: Any, gathered: Any,
    pointer: Any,
) -> int:  # fmt: skip
    """Submit piece ``p``'s read into scratch slot ``slot``: 0, or -errno."""
    parts, first, gathered[slot] = _plan(
        p, starts, offsets, lengths, addresses, order, scratch + slot * scratch_bytes, scratch_bytes, gather_block,
        reads[slot],
    )  # fmt: skip
    b = iocbs[slot]
    b[0] = p * slots + slot  # aio_data: the piece and its slot
    b[2] = IOCB_CMD_PREADV | (fds[p] << 32)
    b[3] = reads[slot].ctypes.data
    b[4] = parts
    b[5] = first
    pointer[0] = iocbs.ctypes.data + slot * IOCB_WORDS * 8
    err: int = 0 if _syscall(IO_SUBMIT, ctx, 1, pointer.ctypes.data, 0, 0) == 1 else -_errno()
    return err


# ``state``'s words, kept between the two calls of a read (``read_check_send``'s ``first_reads``)
FAILED, SENT_BLOCKS, SUBMITTED, INFLIGHT, FREE, SENT_BYTES, ERROR, LANDED = range(8)


@numba.njit(nogil=True, cache=True)
def workspace(depth: int) -> Any:
    """The arrays ``read_check_send`` works in for ``depth`` reads in flight (made once a connection): each of
    ``2 * depth`` slots' iocb and preadv iovecs, which slots hold gathered spans, the landed events, the pointer
    io_submit takes, a frame's iovecs, names and sizes, the free slots."""
    slots = 2 * depth
    return (
        np.zeros((slots, IOCB_WORDS), dtype=np.int64),
        np.empty((slots, 2 * PIECE_BLOCKS, 2), dtype=np.int64),  # a piece's preadv iovecs: payloads and gaps
        np.zeros(slots, dtype=np.int64),
        np.zeros((depth, EVENT_WORDS), dtype=np.int64),
        np.zeros(1, dtype=np.int64),
        np.empty((2 + PIECE_BLOCKS, 2), dtype=np.int64),
        np.empty(PIECE_BLOCKS, dtype=np.uint32),
        np.zeros(2, dtype=np.int64),  # the header's metadata and payload lengths, as bytes below
        np.arange(slots),
    )


@numba.njit(nogil=True, cache=True)
def read_check_send(
    ctx: int, sock: int, fds: Any, starts: Any, offsets: Any, lengths: Any, crcs: Any, addresses: Any, names: Any,
    scratch: int, scratch_bytes: int, depth: int, gather_block: int, head: Any, failed: Any, state: Any, work: Any,
    first_reads: bool,
) -> int:  # fmt: skip
    """Read, check and send pieces ``p`` (blocks ``starts[p]:starts[p + 1]`` of file ``fds[p]``, in file order:
    int64 columns of payload offset, length, CRC32C and destination address, and ``names``, each block's u32 name in
    its DATA frame) with up to ``depth`` reads in flight on AIO context ``ctx`` (``work``: ``workspace(depth)``).
    ``scratch`` holds ``2 * depth`` slots of ``scratch_bytes``, one a piece being read or checked: its gaps, or its
    whole span, gathered when its blocks are at most ``gather_block`` bytes. As reads land the next ones are
    submitted first, so the disk never waits for this thread's checks and sends; then each landed piece's verified
    blocks go out in one DATA frame on ``sock`` (``head``: a 20-byte frame header whose magic and kind are set).
    Blocks not read in full or failing their check are neither sent nor served: their indices go into ``failed``
    (``state[FAILED]`` how many; ``state[SENT_BLOCKS]`` counts those sent).

    With ``first_reads`` the call only submits the first reads and returns 0 (the caller may send what must go
    before the data meanwhile), or ``SUBMIT_FAILED - errno`` when the first could not be submitted (nothing was
    read); a second call, without it, goes on from there. Returns the payload bytes sent, or a negative errno when
    a send failed (the reads in flight are waited for first: no DMA outlives the call)."""
    iocbs, reads, gathered, events, pointer, out, frame_names, frame_sizes, free = work
    pieces = fds.shape[0]
    slots = 2 * depth
    order = np.arange(offsets.shape[0])  # the blocks of each piece lie in file order
    if first_reads:
        state[:] = 0
        free[:] = np.arange(slots)
        state[FREE] = slots
    while True:
        while state[ERROR] == 0 and state[SUBMITTED] < pieces and state[INFLIGHT] < depth:  # the next reads first
            p = state[SUBMITTED]
            state[FREE] -= 1
            err: int = _submit(
                ctx, fds, starts, offsets, lengths, addresses, order, scratch, scratch_bytes, gather_block, slots, p,
                free[state[FREE]], iocbs, reads, gathered, pointer,
            )  # fmt: skip
            if err:
                state[FREE] += 1
                if p == 0:
                    return SUBMIT_FAILED + err
                for k in range(starts[p], starts[pieces]):  # never read: left to the caller's reads
                    failed[state[FAILED]] = k
                    state[FAILED] += 1
                state[SUBMITTED] = pieces
                break
            state[SUBMITTED] += 1
            state[INFLIGHT] += 1
        if first_reads:
            return 0
        for e in range(state[LANDED]):  # the pieces that landed, checked and sent while the next are read
            p, slot = events[e, 0] // slots, events[e, 0] % slots
            landed = events[e, 2]
            lo, hi = starts[p], starts[p + 1]
            first = offsets[lo]
            m = 0
            nbytes = 0
            for k in range(lo, hi):
                whole = landed >= 0 and offsets[k] + lengths[k] - first <= landed
                crc = np.uint64(0)
                if whole and gathered[slot]:
                    crc = copy_crc(gathered[slot] + offsets[k] - first, addresses[k], lengths[k], 0, STREAM)
                elif whole:
                    crc = copy_crc(addresses[k], 0, lengths[k], 0, READ)
                if not whole or np.int64(crc) != crcs[k]:
                    failed[state[FAILED]] = k
                    state[FAILED] += 1
                    continue
                frame_names[m] = names[k]
                out[2 + m, 0], out[2 + m, 1] = addresses[k], lengths[k]
                m += 1
                nbytes += lengths[k]
            free[state[FREE]] = slot
            state[FREE] += 1
            if m == 0 or state[ERROR]:
                continue
            frame_sizes[0], frame_sizes[1] = 4 * m, nbytes
            head[8:12] = frame_sizes[:1].view(np.uint8)[:4]
            head[12:20] = frame_sizes[1:].view(np.uint8)
            out[0, 0], out[0, 1] = head.ctypes.data, HEAD_BYTES
            out[1, 0], out[1, 1] = frame_names.ctypes.data, 4 * m
            state[ERROR] = _send(sock, out, 2 + m)
            if state[ERROR] == 0:
                state[SENT_BYTES] += nbytes
                state[SENT_BLOCKS] += m
        state[LANDED] = 0
        if not state[INFLIGHT]:
            break
        got = -1
        while got < 0:
            got = _syscall(IO_GETEVENTS, ctx, 1, depth, events.ctypes.data, 0)
            if got < 0 and _errno() != EINTR:
                got = 0  # cannot happen with a valid context; a read in flight is never abandoned
        state[LANDED] = got
        state[INFLIGHT] -= got
    result: int = state[ERROR] if state[ERROR] else state[SENT_BYTES]
    return result


def warm_up() -> None:
    """Compile the kernels (or load them from numba's cache) for the types ``send_runs`` passes."""
    ctx = np.zeros(1, dtype=np.int64)
    if setup(1, ctx) == 0:
        destroy(ctx[0])
    one = np.ones(1, dtype=np.int64)
    head = np.zeros(HEAD_BYTES, dtype=np.uint8)
    state = np.zeros(8, dtype=np.int64)
    work = workspace(1)
    for first_reads in (True, False):
        read_check_send(
            0, -1, one[:0], one * 0, one, one, one, one, one.astype(np.uint32), 0, 0, 1, 0, head, one, state, work,
            first_reads,
        )  # fmt: skip
