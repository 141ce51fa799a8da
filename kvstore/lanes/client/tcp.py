"""Client side of the bulk TCP lane: one connection, one request at a time, a whole batch per frame.

- ``put``: one PUT frame: the metadata with every header, then each payload
  followed by its CRC32C, gathered straight from the caller's buffers by
  ``sendmsg`` (no copy in user space, no per-block round trip). Each piece of
  256 KiB is checksummed (C, hardware CRC32C) just before ``sendmsg`` hands it
  to the kernel, so the kernel's copy reads it from cache, while the socket
  buffer keeps the server busy (``framing.send_blocks_crc``). Then one
  PUT_REPLY with a result per block, or a STATUS error.
- ``get``: one GET frame; the GET_REPLY lists every header, then DATA frames
  carry the blocks, received with ``recv_into`` straight into ``out`` (or new
  buffers carved from one mapping per batch), the CRC32C computed piece by piece as bytes arrive.
  The hello asks for DATA frames that name their blocks (``TcpHello.unordered_data``), so the server sends
  blocks as their reads complete; a frame without names holds the next blocks in the reply's order.

A STATUS frame raises ``KVStoreError`` with its code; a broken connection
raises ``LaneBroken`` (the pool opens a fresh lane and retries once).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from typing import Any

import grpc

from kvstore.errors import KVStoreError, corrupt_block, short_buffer, status_code
from kvstore.lanes import framing
from kvstore.lanes.base import Lane, LaneBroken
from kvstore.lanes.buffers import alloc_blocks
from kvstore.payload import Segments, as_bytes_view
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import lanes_pb2 as lpb
from kvstore.wire import put_results

CONNECT_SECONDS = 3.0  # an unreachable lane port (not exposed, filtered) must not stall the first call long


class TcpClientLane(Lane):
    kind = "tcp"

    def __init__(self, host: str, port: int, opened: lpb.OpenLaneResponse, timeout: float):
        self.ref = lpb.LaneRef(lane_id=opened.lane_id, token=opened.token)
        self.sock = socket.create_connection((host, port), timeout=min(timeout, CONNECT_SECONDS))
        try:
            framing.tune(self.sock)
            self.sock.settimeout(None)  # blocking, so MSG_WAITALL fills a buffer in one call
            framing.set_timeouts(self.sock, timeout)
            hello = lpb.TcpHello(lane=self.ref, unordered_data=True)
            framing.send_frame(self.sock, framing.HELLO, hello.SerializeToString())
            self._expect(framing.STATUS)
        except BaseException:
            self.sock.close()
            raise

    # -- put ------------------------------------------------------------------------------
    def put(
        self, namespace: str, headers: Sequence[pb.BlockHeader], payloads: Sequence[memoryview | Segments]
    ) -> list[Any]:
        meta = lpb.TcpPut(namespace=namespace, headers=headers).SerializeToString()
        data_len = sum(h.stored_length + framing.CRC.size for h in headers)
        blocks = [p.views if isinstance(p, Segments) else p for p in payloads]  # segments: gathered by sendmsg
        try:
            head = framing.HEADER.pack(framing.MAGIC, framing.PUT, len(meta), data_len)
            framing.send_blocks_crc(self.sock, [memoryview(head), memoryview(meta)], blocks)
            frame = self._expect(framing.PUT_REPLY)
        except OSError as err:
            raise LaneBroken(f"tcp lane connection failed during Put: {err}") from None
        return put_results(pb.PutResponse.FromString(frame.meta).results)

    # -- get ------------------------------------------------------------------------------
    def get(
        self, namespace: str, hashes: Sequence[bytes], out: Sequence[Any] | None, allow_missing: bool, verify: bool
    ) -> list[Any]:
        request = pb.GetRequest(namespace=namespace, hashes=hashes, allow_missing=allow_missing)
        try:
            framing.send_frame(self.sock, framing.GET, request.SerializeToString())
            headers = lpb.TcpGetReply.FromString(self._expect(framing.GET_REPLY).meta).headers
            return self._receive(headers, out, verify)
        except OSError as err:
            raise LaneBroken(f"tcp lane connection failed during Get: {err}") from None

    def _receive(self, headers: Sequence[pb.BlockHeader], out: Sequence[Any] | None, verify: bool) -> list[Any]:
        results: list[Any] = [None] * len(headers)
        present = [i for i, h in enumerate(headers) if not h.missing]
        dests: list[Any]
        tables: dict[int, Any] = {}  # k -> the span table of a Segments destination that holds its block exactly
        if out is None:
            dests = alloc_blocks([headers[i].stored_length for i in present])
        else:
            dests = []
            for i in present:
                n = headers[i].stored_length
                if isinstance(out[i], Segments):  # scattered across the segments as it arrives
                    if out[i].nbytes < n:
                        self._drain_reply(headers, present)
                        raise short_buffer(i, out[i].nbytes, n)
                    if out[i].nbytes == n:
                        tables[len(dests)] = out[i].span_table
                    dests.append(out[i].head_views(n))
                    continue
                dst = as_bytes_view(out[i])[0]
                if len(dst) < n:
                    self._drain_reply(headers, present)
                    raise short_buffer(i, len(dst), n)
                dests.append(dst[:n])
        bad: int | None = None
        place = {i: k for k, i in enumerate(present)}  # header index -> position among the present blocks
        received = [False] * len(present)
        todo, cursor = len(present), 0
        while todo:
            frame = self._expect(framing.DATA)
            if frame.meta:  # the frame names its blocks (sent as their reads completed)
                ks = _named(frame.meta, place, received)
            else:  # the next blocks in the reply's order
                ks = _following(headers, present, cursor, frame.data_len)
                cursor = ks[-1] + 1
            if sum(headers[present[k]].stored_length for k in ks) != frame.data_len:
                raise framing.FrameError("a DATA frame does not end on a block boundary")
            left = frame.data_len
            for k in ks:
                received[k] = True
                h = headers[present[k]]
                n, dst = h.stored_length, dests[k]
                if isinstance(dst, list):  # segments
                    crc = framing.recv_views_crc(self.sock, dst, after=left - n, spans=tables.get(k))
                    if verify and h.codec == pb.CODEC_NONE and crc != h.crc32c and bad is None:
                        bad = present[k]
                elif verify and h.codec == pb.CODEC_NONE:
                    if framing.recv_into_crc(self.sock, dst, after=left - n) != h.crc32c and bad is None:
                        bad = present[k]
                else:
                    framing.recv_into(self.sock, dst)
                left -= n
            todo -= len(ks)
        if bad is not None:
            raise corrupt_block(bad, headers[bad].hash)
        for i, dst in zip(present, dests):
            results[i] = out[i] if out is not None else dst
        return results

    def _drain_reply(self, headers: Sequence[pb.BlockHeader], present: list[int]) -> None:
        """Read and drop the rest of a Get reply so the connection stays in step."""
        left = sum(headers[i].stored_length for i in present)
        while left > 0:
            frame = self._expect(framing.DATA)
            framing.drain(self.sock, frame.data_len)
            left -= frame.data_len

    # -- plumbing ------------------------------------------------------------------------------
    def _expect(self, kind: int) -> framing.Frame:
        frame = framing.recv_frame(self.sock)
        if frame is None:
            raise LaneBroken("the tcp lane connection was closed by the server")
        if frame.kind == framing.STATUS:
            status = lpb.LaneStatus.FromString(frame.meta)
            code = status_code(status.code)
            if code == grpc.StatusCode.OK and kind == framing.STATUS:
                return frame
            if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE):
                raise LaneBroken(f"{code.name}: {status.message}")
            raise KVStoreError(code, status.message)
        if frame.kind != kind:
            raise framing.FrameError(f"expected frame kind {kind}, got {frame.kind}")
        return frame

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _named(meta: bytes, place: dict[int, int], received: list[bool]) -> list[int]:
    """The positions (among the present blocks) of the header indices a DATA frame names, each new."""
    if not meta or len(meta) % 4:
        raise framing.FrameError("a DATA frame's block names are not whole uint32s")
    ks = [place.get(i, -1) for i in struct.unpack(f"<{len(meta) // 4}I", meta)]
    if any(k < 0 or received[k] for k in ks) or len(set(ks)) != len(ks):
        raise framing.FrameError("a DATA frame names a block that is missing or was received already")
    return ks


def _following(headers: Sequence[pb.BlockHeader], present: list[int], cursor: int, data_len: int) -> list[int]:
    """The present blocks from ``cursor`` on that an unnamed DATA frame of ``data_len`` bytes holds."""
    ks: list[int] = []
    left = data_len
    while left > 0 and cursor + len(ks) < len(present):
        k = cursor + len(ks)
        ks.append(k)
        left -= headers[present[k]].stored_length
    if left != 0 or not ks:
        raise framing.FrameError("a DATA frame does not end on a block boundary")
    return ks
