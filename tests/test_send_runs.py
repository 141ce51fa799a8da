"""``kvstore.send_runs``: the TCP lane's compiled Get of NVMe runs, read with the kernel's asynchronous I/O on real
O_DIRECT segment files, checked, and sent as DATA frames on a real socket by one call. Every block arrives once, exact,
under its name, in frames the lane's framing reads; a damaged record is neither sent nor served and is read again by
the tier, which reports it alone; a send that fails raises after every read in flight landed, leaving no pin."""

from __future__ import annotations

import os
import platform
import socket
import struct
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import memops_jit, payload_runs, send_runs
from kvstore.lanes import framing
from kvstore.tiers.base import CorruptBlock
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.nvme.format import crc32c, split_loc
from kvstore.tiers.nvme.io import aligned_buffer
from tests.nvme_runs_support import damage, make_tier, write
from tests.nvme_runs_support import written as written_records

KiB, MiB = 1 << 10, 1 << 20
SIZES = [64 * KiB, 512 * KiB, 4 * KiB, 128 * KiB]


@pytest.fixture(autouse=True, params=["gathered", "direct"])
def compiled(request, monkeypatch) -> None:
    if not (memops_jit.AVAILABLE and sys.platform == "linux" and platform.machine() == "x86_64"):
        pytest.skip("the compiled send needs numba, a CPU with SSE4.2 and PCLMULQDQ, and Linux on x86-64")
    payload_runs.COMPILED.warm_up()
    send_runs.warm_up()
    if request.param == "direct":
        monkeypatch.setattr(payload_runs, "GATHER_BLOCK_BYTES", 0)


def test_the_frame_header_constants_are_the_lanes():
    assert (send_runs.FRAME_MAGIC, send_runs.FRAME_DATA) == (framing.MAGIC, framing.DATA)
    assert framing.HEADER.size == 20


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[NvmeTier, list[int], list[np.ndarray]]:
    """24 records over segments of 4 MiB (some runs cross a segment's end)."""
    return written_records(tmp_path_factory.mktemp("send-runs"), SIZES, 24, 7)


class Receiver:
    """The client's end: every DATA frame read with the lane's framing, each block kept under its name."""

    def __init__(self, sock: socket.socket, sizes: dict[int, int]):
        self.sock, self.sizes = sock, sizes
        self.blocks: dict[int, bytes] = {}
        self.repeated: list[int] = []
        self.kinds: list[int] = []  # of every frame, in order
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (frame := framing.recv_frame(self.sock)) is not None:
            self.kinds.append(frame.kind)
            if frame.kind == framing.GET_REPLY:  # what ``before`` sent
                continue
            assert frame.kind == framing.DATA
            names = struct.unpack(f"<{len(frame.meta) // 4}I", frame.meta)
            assert frame.data_len == sum(self.sizes[n] for n in names)
            for n in names:
                data = memoryview(bytearray(self.sizes[n]))
                framing.recv_into(self.sock, data)
                if n in self.blocks:
                    self.repeated.append(n)
                self.blocks[n] = bytes(data)

    def join(self) -> None:
        self.thread.join(10)
        assert not self.thread.is_alive()


def read_and_send(tier, locs, payloads, picks, names, crcs=None, fail_fd: int | None = None, before=None):
    """``tier.read`` of ``picks`` with a ``RunSender`` as its run reader; (what the receiver got, the verified and
    failed targets the sender reported, the destinations, the error raised)."""
    server, client = socket.socketpair()
    receiver = Receiver(client, {names[k]: len(payloads[i]) for k, i in enumerate(picks)})
    sender = send_runs.RunSender(server)
    if fail_fd is not None:
        sender._fd = fail_fd  # a send that fails: the kernel's writev on a descriptor it cannot write
    reported: list[tuple[list[int], list[int]]] = []

    def runs(pieces):
        sent = sender.send(pieces, np.asarray(names, dtype=np.int64), before and (lambda: before(server)))
        assert sent is not None
        reported.append((sent.verified, sent.failed))
        return sent.verified, sent.failed

    dests = [aligned_buffer(len(payloads[i])) for i in picks]
    crcs = crcs if crcs is not None else [crc32c(payloads[i]) for i in picks]
    error = None
    try:
        tier.read([locs[i] for i in picks], [len(payloads[i]) for i in picks], dests, None, crcs, True, runs)
    except (CorruptBlock, OSError, RuntimeError) as err:
        error = err
    finally:
        sender.close()
        server.close()
    receiver.join()
    client.close()
    return receiver, reported, dests, error


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(start=st.integers(0, 20), count=st.integers(1, 12), shuffle=st.randoms(use_true_random=False))
def test_every_block_arrives_once_exact_under_its_name(written, start, count, shuffle):
    tier, locs, payloads = written
    picks = list(range(start, min(start + count, len(locs))))
    shuffle.shuffle(picks)
    names = [1000 + 3 * k for k in range(len(picks))]
    receiver, reported, dests, error = read_and_send(tier, locs, payloads, picks, names)
    assert error is None and not receiver.repeated
    assert receiver.blocks == {names[k]: payloads[i].tobytes() for k, i in enumerate(picks)}
    assert all(d.tobytes() == payloads[i].tobytes() for d, i in zip(dests, picks))  # served from there too
    assert sorted(reported[0][0]) == list(range(len(picks))) and reported[0][1] == []


def test_what_goes_before_the_data_goes_once_the_first_reads_are_submitted(written, monkeypatch):
    tier, locs, payloads = written
    monkeypatch.setattr(tier, "max_read_bytes", 1 * MiB)  # more pieces than reads in flight
    calls: list[int] = []

    def reply(sock):  # the Get's reply, as the lane sends it
        calls.append(1)
        framing.send_frame(sock, framing.GET_REPLY, b"reply")

    picks = list(range(len(locs)))
    receiver, _, _, error = read_and_send(tier, locs, payloads, picks, picks, before=reply)
    assert error is None and calls == [1]
    assert receiver.kinds[0] == framing.GET_REPLY and receiver.kinds[1:] == [framing.DATA] * (len(receiver.kinds) - 1)
    assert receiver.blocks == {i: payloads[i].tobytes() for i in picks}


def test_a_failure_before_the_data_waits_for_the_reads_and_sends_nothing(written):
    tier, locs, payloads = written

    def broken(sock):
        raise RuntimeError("the reply could not be built")

    receiver, _, _, error = read_and_send(tier, locs, payloads, list(range(12)), list(range(12)), before=broken)
    assert isinstance(error, RuntimeError) and receiver.blocks == {} and receiver.kinds == []
    assert all(s.readers == 0 for s in tier._log.segments.values())


def test_many_pieces_in_flight_across_a_segment_end(written, monkeypatch):
    tier, locs, payloads = written
    assert len({split_loc(loc)[0] for loc in locs}) > 1
    monkeypatch.setattr(tier, "max_read_bytes", 1 * MiB)  # more pieces than reads in flight
    picks = list(range(len(locs)))
    receiver, _, _, error = read_and_send(tier, locs, payloads, picks, picks)
    assert error is None and not receiver.repeated
    assert receiver.blocks == {i: payloads[i].tobytes() for i in picks}


def test_a_damaged_record_is_not_sent_and_is_reported_alone(tmp_path: Path):
    tier = make_tier(tmp_path)
    rng = np.random.default_rng(9)
    payloads = [rng.integers(0, 256, 64 * KiB, dtype=np.uint8) for _ in range(6)]
    locs = write(tier, payloads, rng)
    damage(tmp_path, locs[2])  # a bad sector in record 2's payload
    picks = list(range(6))
    receiver, reported, dests, error = read_and_send(tier, locs, payloads, picks, picks)
    assert isinstance(error, CorruptBlock) and error.locs == [locs[2]]
    assert reported == [([0, 1, 3, 4, 5], [2])]
    assert receiver.blocks == {i: payloads[i].tobytes() for i in (0, 1, 3, 4, 5)}  # never the damaged one
    assert not dests[2].any()  # zeroed by the tier's record-by-record read
    assert all(s.readers == 0 for s in tier._log.segments.values())
    tier.close()


def test_a_crc_that_differs_from_the_records_is_not_sent(written):
    tier, locs, payloads = written
    picks = [4, 5, 6, 7]
    crcs = [crc32c(payloads[i]) ^ (1 if k == 1 else 0) for k, i in enumerate(picks)]
    receiver, _, _, error = read_and_send(tier, locs, payloads, picks, [0, 1, 2, 3], crcs)
    assert isinstance(error, CorruptBlock) and error.locs == [locs[5]]
    assert sorted(receiver.blocks) == [0, 2, 3]


def test_a_failed_send_raises_after_the_reads_landed_and_leaves_no_pin(written, tmp_path: Path):
    tier, locs, payloads = written
    fd = os.open(tmp_path / "read-only", os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        receiver, _, dests, error = read_and_send(tier, locs, payloads, list(range(12)), list(range(12)), fail_fd=fd)
    finally:
        os.close(fd)
    assert isinstance(error, OSError) and not isinstance(error, CorruptBlock)
    assert receiver.blocks == {}
    assert all(s.readers == 0 for s in tier._log.segments.values())


def test_the_kernel_takes_every_piece_the_tier_cuts():
    from kvstore import send_run_kernels
    from kvstore.tiers.nvme import runs

    assert runs.MAX_BLOCKS <= send_run_kernels.PIECE_BLOCKS  # a piece's iovecs: a payload and a gap a block


def test_no_pieces_or_no_kernels_leave_the_read_to_the_tier(monkeypatch):
    a, b = socket.socketpair()
    try:
        sender = send_runs.RunSender(a)
        assert sender.send([], np.zeros(0, dtype=np.int64)) is None
        too_many = types.SimpleNamespace(at=np.arange(send_runs.kernels().PIECE_BLOCKS + 1))
        assert sender.send([too_many], np.zeros(len(too_many.at), dtype=np.int64)) is None
        monkeypatch.setattr(send_runs, "ready", lambda: False)
        assert sender.send([object()], np.zeros(1, dtype=np.int64)) is None
        sender.close()
    finally:
        a.close()
        b.close()
