"""The tcp lane's piecewise send and receive: blocks that are not whole numbers of pieces, and SO_RCVLOWAT.

A receiver raises SO_RCVLOWAT to ``framing.LOWAT`` while at least that much
of the frame is still to come after the piece it receives; it must lower it
again before that, or a receive would wait for bytes the peer never sends (the
frame timeout here is short, so a stall fails the test instead of hanging it).
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from kvstore.client import Client
from kvstore.lanes import framing

P = framing.PIECE
L = framing.LOWAT
SIZES = [1, P - 1, P, P + 1, 2 * P, 2 * P + 3, 3 * P - 5, 8 * P + 4, L + P + 1, L]


@pytest.fixture
def lane_server(make_server):
    return make_server(dram=256 << 20, max_block=4 << 20)  # room for a slab page per block size


def test_odd_block_sizes_round_trip_on_tcp(lane_server):
    blocks = [os.urandom(n) for n in SIZES]
    keys = [os.urandom(16) for _ in SIZES]
    with Client(f"127.0.0.1:{lane_server.port}", lane="tcp", timeout=5, retries=0) as kv:
        results = kv.put("pieces", keys, blocks)
        assert [r.status for r in results] == ["stored"] * len(SIZES)
        got = kv.get("pieces", keys)
        assert [bytes(g) for g in got] == blocks
        out = [bytearray(n + 7) for n in SIZES]  # larger caller buffers: filled up to each block's length
        kv.get("pieces", keys, out=out)
        assert [bytes(o[: len(b)]) for o, b in zip(out, blocks)] == blocks
        again = kv.put("pieces", keys[::-1], blocks[::-1])  # one batch mixing present blocks and new bytes
        assert [r.status for r in again] == ["already_present"] * len(SIZES)


def test_recv_into_crc_restores_the_low_water_mark():
    if not framing.RCVLOWAT:
        pytest.skip("no SO_RCVLOWAT on this platform")
    from kvstore.checksum import crc32c

    data = os.urandom(L + 2 * P + 3)  # large enough for the low-water mark to be raised
    with socket.create_server(("127.0.0.1", 0)) as srv:
        sender = threading.Thread(target=_send_to, args=(srv.getsockname(), data), daemon=True)
        sender.start()
        conn, _ = srv.accept()
        with conn:
            framing.set_timeouts(conn, 5.0)
            view = memoryview(bytearray(len(data)))
            assert framing.recv_into_crc(conn, view) == crc32c(data)
            assert bytes(view) == data
            assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
        sender.join(5)


def test_last_block_of_a_frame_does_not_wait_for_the_low_water_mark():
    """A receive that took part of its piece sleeps until RCVLOWAT bytes are queued: never more than will come."""
    if not framing.RCVLOWAT:
        pytest.skip("no SO_RCVLOWAT on this platform")
    from kvstore.checksum import crc32c

    data = os.urandom(L + 2 * P + 3)  # the frame's last block: nothing follows it
    with socket.create_server(("127.0.0.1", 0)) as srv:
        done = threading.Event()  # the sender stays connected: its FIN would wake the receiver anyway
        sender = threading.Thread(
            target=_send_to, args=(srv.getsockname(), data, len(data) - L // 2 + 100, done), daemon=True
        )
        sender.start()
        conn, _ = srv.accept()
        with conn:
            framing.set_timeouts(conn, 5.0)
            view = memoryview(bytearray(len(data)))
            start = time.monotonic()
            assert framing.recv_into_crc(conn, view, after=0) == crc32c(data)
            assert time.monotonic() - start < 4.0  # a stall lasts until the 5 s receive timeout
            assert bytes(view) == data
        done.set()
        sender.join(5)


def _send_to(address, data: bytes, first: int = 0, done: threading.Event | None = None) -> None:
    with socket.create_connection(address) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if first:  # the receiver takes part of a piece, then waits for the rest: less than LOWAT bytes
            s.sendall(data[:first])
            time.sleep(0.3)
        s.sendall(data[first:])
        if done is not None:
            done.wait(10)
