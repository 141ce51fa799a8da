"""Frames of the bulk TCP lane: a fixed header, protobuf metadata, then raw payload bytes.

Wire layout of one frame (little endian)::

    magic  b"KVL1"   4 bytes
    kind   u8        HELLO, PUT, PUT_REPLY, GET, GET_REPLY, DATA, STATUS, TOUCH and POOL (the shm channel's)
    pad    3 bytes
    meta   u32       length of the metadata (a lanes.proto / kvstore.proto message)
    data   u64       length of the payload that follows the metadata

Conversation (client -> server, one request at a time per connection; many
blocks per frame, so a batch costs one round trip)::

    HELLO(TcpHello{lane_id, token, unordered_data}) -> STATUS(OK) | STATUS(error) and close
    PUT(TcpPut{ns, headers}) + payloads         -> PUT_REPLY(PutResponse) | STATUS(error)
    GET(GetRequest)                             -> GET_REPLY(TcpGetReply{headers})
                                                   DATA(payloads of the next blocks) ...
                                                   | STATUS(error) at any point

The payload of a PUT is, in header order, every block's stored bytes each
followed by its CRC32C (u32; the headers' crc32c field is not used), so the
sender checksums a block just before sending it and the receiver verifies and
commits each block as soon as it has arrived; a DATA frame carries whole
blocks, in request order, skipping missing ones. When the client's hello set
``unordered_data``, a DATA frame's metadata may name its blocks instead (a
u32 header index each, little endian, in the frame's order), and the server
sends blocks as their reads from NVMe complete, in any order. Errors are a STATUS frame with a grpc.StatusCode value and a message;
after an error in the middle of a PUT the server still reads (and drops) the
rest of the payload, so the connection stays usable.

Sending gathers the frame header, the metadata and the payload buffers into
``sendmsg`` calls (no copy in user space), a put's blocks in pieces of
``PIECE`` bytes each checksummed just before it is sent; receiving uses
``recv_into`` with MSG_WAITALL straight into the destination buffer (an arena
slot on the server, the caller's buffer on the client), piece by piece, each
piece checksummed while it is in cache, with SO_RCVLOWAT at the piece size
while more than a piece of the frame is still to come (one wake-up per piece).
A sender therefore sends a whole frame without waiting for the receiver: a
receiver counts on the rest of the frame to arrive.
"""

from __future__ import annotations

import socket
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

HEADER = struct.Struct("<4sB3xIQ")
CRC = struct.Struct("<I")
MAGIC = b"KVL1"
HELLO, PUT, PUT_REPLY, GET, GET_REPLY, DATA, STATUS, TOUCH, POOL = range(1, 10)  # TOUCH, POOL: shm channels only
MAX_META = 64 << 20
IOV_MAX = 1024
SOCKET_BUFFER = 4 << 20
DRAIN_PIECE = 1 << 20
PIECE = 256 << 10  # CRC32C and socket I/O in pieces that stay in L2 between the two
RCVLOWAT = getattr(socket, "SO_RCVLOWAT", 0) if sys.platform == "linux" else 0  # 0: not used
LOWAT = 1 << 20  # SO_RCVLOWAT while a frame's payload is received: wake when this much has arrived


class FrameError(ConnectionError):
    """The peer broke the framing or went away: the connection is unusable."""


@dataclass(slots=True)
class Frame:
    kind: int
    meta: bytes
    data_len: int


def tune(sock: socket.socket) -> None:
    """Large buffers and no Nagle delay (headers are small and must not wait)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


def send_frame(sock: socket.socket, kind: int, meta: bytes = b"", payload: Sequence[memoryview] = ()) -> None:
    data_len = sum(len(p) for p in payload)
    send_all(sock, [memoryview(HEADER.pack(MAGIC, kind, len(meta), data_len)), memoryview(meta), *payload])


def send_all(sock: socket.socket, buffers: Sequence[memoryview]) -> None:
    """sendmsg until every buffer is out, resuming after partial sends."""
    bufs = [b if b.format == "B" and b.ndim == 1 else b.cast("B") for b in buffers if len(b)]
    i = 0
    while i < len(bufs):
        sent = sock.sendmsg(bufs[i : i + IOV_MAX])
        while sent:
            n = len(bufs[i])
            if sent >= n:
                sent -= n
                i += 1
            else:
                bufs[i] = bufs[i][sent:]
                sent = 0


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` completely or raise FrameError."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise FrameError(f"connection closed after {got} of {n} bytes")
        got += k


def recv_frame(sock: socket.socket) -> Frame | None:
    """The next frame's header and metadata (its payload is still on the socket); None on a clean close."""
    head = memoryview(bytearray(HEADER.size))
    k = sock.recv_into(head, HEADER.size, socket.MSG_WAITALL)
    if k == 0:
        return None
    if k < HEADER.size:
        recv_into(sock, head[k:])
    magic, kind, meta_len, data_len = HEADER.unpack(head)
    if magic != MAGIC or not HELLO <= kind <= POOL or meta_len > MAX_META:
        raise FrameError(f"bad frame header (magic {bytes(magic)!r}, kind {kind}, meta {meta_len} bytes)")
    meta = bytearray(meta_len)
    if meta_len:
        recv_into(sock, memoryview(meta))
    return Frame(kind, bytes(meta), data_len)


def drain(sock: socket.socket, nbytes: int, scratch: memoryview | None = None) -> None:
    """Read and drop ``nbytes`` of payload."""
    scratch = scratch if scratch is not None else memoryview(bytearray(min(nbytes, DRAIN_PIECE) or 1))
    while nbytes > 0:
        k = min(nbytes, len(scratch))
        recv_into(sock, scratch[:k])
        nbytes -= k


def send_blocks_crc(
    sock: socket.socket,
    head: Sequence[memoryview],
    payloads: Sequence[memoryview | Sequence[memoryview]],
    piece: int = PIECE,
) -> None:
    """Send ``head``, then each payload followed by its CRC32C (u32), checksumming piece by piece.

    A payload given as a sequence of flat byte views (a block in several buffers, ``Segments``) is sent as
    their concatenation, gathered by ``sendmsg`` from where they are, its CRC32C chained over them.

    Each piece's CRC32C is computed just before ``sendmsg`` hands that piece to
    the kernel, so the kernel's copy reads it from cache instead of memory, and
    the socket buffer keeps the receiver busy while the next piece is
    checksummed. Blocks smaller than a piece are gathered, about ``piece`` bytes
    per ``sendmsg``. (Checksumming on a helper thread ahead of the sends was
    measured too: slower here, where two cores are shared.)
    """
    from kvstore.checksum import crc32c

    pack = CRC.pack
    parts: list[memoryview] = list(head)
    pending = 0
    for payload in payloads:
        if not isinstance(payload, memoryview):  # segments: pieces of each, one CRC32C over all
            crc = 0
            for view in payload:
                for start in range(0, len(view), piece):
                    part = view[start : start + piece] if len(view) > piece else view
                    crc = crc32c(part, crc)
                    parts.append(part)
                    pending += len(part)
                    if pending >= piece or len(parts) >= IOV_MAX:
                        send_all(sock, parts)
                        parts, pending = [], 0
            parts.append(memoryview(pack(crc)))
            continue
        view = payload if payload.format == "B" and payload.ndim == 1 else payload.cast("B")
        n = len(view)
        if n <= piece:
            parts.append(view)
            parts.append(memoryview(pack(crc32c(view))))
            pending += n
            if pending >= piece:
                send_all(sock, parts)
                parts, pending = [], 0
            continue
        crc = 0
        for start in range(0, n, piece):
            part = view[start : start + piece]
            crc = crc32c(part, crc)
            parts.append(part)
            if start + piece >= n:
                parts.append(memoryview(pack(crc)))
            send_all(sock, parts)
            parts = []
        pending = 0
    if parts:
        send_all(sock, parts)


def recv_into_crc(sock: socket.socket, view: memoryview, piece: int = PIECE, after: int = 0, lowat: int = LOWAT) -> int:
    """Fill ``view`` piece by piece, computing the CRC32C of each piece while it is in cache.

    ``after``: bytes of the same frame that follow ``view``, which the peer
    sends without waiting for us. While at least ``lowat`` bytes of the frame
    are still to come after the piece being received, SO_RCVLOWAT is raised to
    ``lowat``, so the kernel wakes this thread once per ``lowat`` bytes instead
    of once per arriving segment (measured, 64 blocks a batch, interleaved:
    Get of 2 MiB blocks 6.0 GB/s with 1 MiB against 3.7 with 256 KiB and 3.5
    without; put 4.7 / 4.4 / 2.7). It is back at 1 before fewer than that are
    to come, and when this returns: a receive that has taken part of its piece
    sleeps until ``lowat`` bytes are queued, so those bytes must be sure to
    come.
    """
    from kvstore.checksum import crc32c

    crc, n = 0, len(view)
    # blocks of at least a piece only: for smaller ones the two setsockopt calls cost more than they save
    use = bool(RCVLOWAT) and lowat > 1 and n >= piece and n - piece + after >= lowat
    if use:
        sock.setsockopt(socket.SOL_SOCKET, RCVLOWAT, lowat)
    try:
        for start in range(0, n, piece):
            end = min(start + piece, n)
            if use and n - end + after < lowat:  # fewer than `lowat` bytes still to come after this piece
                sock.setsockopt(socket.SOL_SOCKET, RCVLOWAT, 1)
                use = False
            part = view[start:end]
            recv_into(sock, part)
            crc = crc32c(part, crc)
    finally:
        if use:
            try:
                sock.setsockopt(socket.SOL_SOCKET, RCVLOWAT, 1)
            except OSError:
                pass  # the connection is gone; the error that ended the loop is the one to report
    return crc


def recv_views_crc(
    sock: socket.socket,
    views: Sequence[memoryview],
    piece: int = PIECE,
    after: int = 0,
    lowat: int = LOWAT,
    spans: Any = None,
) -> int:
    """Fill ``views`` in turn (one block scattered across several buffers, ``Segments``) with ``recvmsg_into``,
    one run of at most ``piece`` bytes and IOV_MAX buffers per call (``segments.pieces``), each run
    CRC32C'd while it is in cache; the CRC32C of the whole block. ``after`` and ``lowat`` as in
    ``recv_into_crc``. ``spans``: the same memory as an (address, length) int64 table (``Segments.span_table``):
    a block of one run is then received in one call and checked in one compiled pass over its pages, not a
    Python step and a CRC32C call per page (a vLLM block has 30)."""
    from kvstore import memops_jit
    from kvstore.checksum import crc32c
    from kvstore.lanes.segments import pieces

    crc, n = 0, sum(len(v) for v in views)
    if spans is not None and n <= piece and len(views) <= IOV_MAX and memops_jit.ready():
        from kvstore.memops import crc_of_spans

        _recv_all_into(sock, [v for v in views if len(v)], n)
        return crc_of_spans(spans)
    use = bool(RCVLOWAT) and lowat > 1 and n >= piece and n - piece + after >= lowat
    if use:
        sock.setsockopt(socket.SOL_SOCKET, RCVLOWAT, lowat)
    done = 0
    try:
        for run in pieces([len(v) for v in views], piece, IOV_MAX):
            bufs = [views[i][off : off + k] for i, off, k in run]
            size = sum(k for _, _, k in run)
            if use and n - done - size + after < lowat:
                sock.setsockopt(socket.SOL_SOCKET, RCVLOWAT, 1)
                use = False
            _recv_all_into(sock, list(bufs), size)
            for buf in bufs:
                crc = crc32c(buf, crc)
            done += size
    finally:
        if use:
            try:
                sock.setsockopt(socket.SOL_SOCKET, RCVLOWAT, 1)
            except OSError:
                pass
    return crc


def _recv_all_into(sock: socket.socket, bufs: list[memoryview], size: int) -> None:
    """Fill every buffer of ``bufs`` (``size`` bytes in all) with ``recvmsg_into``, resuming after short reads."""
    got = 0
    while got < size:
        k = sock.recvmsg_into(bufs, 0, socket.MSG_WAITALL)[0]
        if k == 0:
            raise FrameError(f"connection closed after {got} of {size} bytes")
        got += k
        if got >= size:  # all of it, as a rule (MSG_WAITALL): nothing to drop
            return
        while k:  # drop what was filled
            if k >= len(bufs[0]):
                k -= len(bufs[0])
                bufs.pop(0)
            else:
                bufs[0] = bufs[0][k:]
                k = 0


def set_timeouts(sock: socket.socket, seconds: float) -> None:
    """Kernel send/receive timeouts on a blocking socket (keeps MSG_WAITALL one call per buffer)."""
    whole = int(seconds)
    tv = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
