"""Read planning: coalesced runs cut into balanced pieces within the size limit."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvstore.tiers.nvme.format import PAGE, record_bytes
from kvstore.tiers.nvme.reader import Wanted, plan_pieces

KiB, MiB = 1 << 10, 1 << 20


def layout(lengths: list[int], gaps: list[int] | None = None) -> list[Wanted]:
    out, off = [], 0
    for i, n in enumerate(lengths):
        off += (gaps[i] if gaps else 0) * PAGE
        out.append(Wanted.block(off, n))
        off += record_bytes(n)
    return out


def test_a_prefix_is_cut_into_equal_parallel_pieces() -> None:
    pieces = plan_pieces(None, layout([128 * KiB] * 32), 2 * MiB, 0, parallel=4)  # type: ignore[arg-type]
    assert [len(p.records) for p in pieces] == [8, 8, 8, 8]
    # no piece below MIN_PIECE (1 MiB) for parallelism alone: a 2.2 MB prefix of 64 KiB blocks is two, 1.1 MB one
    assert [len(p.records) for p in plan_pieces(None, layout([64 * KiB] * 32), 2 * MiB, 0, parallel=4)] == [16, 16]  # type: ignore[arg-type]
    assert len(plan_pieces(None, layout([32 * KiB] * 32), 2 * MiB, 0, parallel=4)) == 1  # type: ignore[arg-type]
    assert len(plan_pieces(None, layout([64 * KiB] * 32), 8 * MiB, 0, parallel=1)) == 1  # type: ignore[arg-type]


def test_gaps_split_runs_unless_small() -> None:
    ws = layout([10_000] * 4, gaps=[0, 0, 40, 0])  # a 160 KiB hole before the third record
    assert len(plan_pieces(None, ws, 8 * MiB, 128 * KiB)) == 2  # type: ignore[arg-type]
    assert len(plan_pieces(None, ws, 8 * MiB, 256 * KiB)) == 1  # type: ignore[arg-type]


@given(
    lengths=st.lists(st.integers(0, 3 * MiB), min_size=1, max_size=40),
    gaps=st.lists(st.integers(0, 64), min_size=40, max_size=40),
    max_bytes=st.sampled_from([256 * KiB, 2 * MiB, 8 * MiB]),
    parallel=st.integers(1, 8),
)
def test_every_record_in_exactly_one_piece_within_limits(
    lengths: list[int], gaps: list[int], max_bytes: int, parallel: int
) -> None:
    ws = layout(lengths, gaps)
    pieces = plan_pieces(None, list(reversed(ws)), max_bytes, 64 * KiB, parallel)  # type: ignore[arg-type]
    seen = [w for p in pieces for w in p.records]
    assert sorted(w.offset for w in seen) == [w.offset for w in ws]
    for p in pieces:
        assert p.offset == p.records[0].offset
        assert p.nbytes == p.records[-1].offset + p.records[-1].nbytes - p.offset
        assert p.nbytes <= max_bytes or len(p.records) == 1


def test_posix_preadv_finishes_short_transfers_and_stops_at_eof(tmp_path, monkeypatch):
    import os

    from kvstore.tiers.nvme import io as nvme_io

    backend = nvme_io.PosixBackend(direct=False)
    fh = backend.create(str(tmp_path / "f"), 64 << 10)
    data = np.random.default_rng(0).integers(0, 256, 64 << 10, dtype=np.uint8)
    backend.pwrite(fh, data, 0)
    real_pread = os.pread

    def short_preadv(fd, bufs, offset):  # the kernel may return less: at most 5,000 bytes a call here
        views = [memoryview(b).cast("B") for b in bufs]
        got = real_pread(fd, min(5000, sum(len(v) for v in views)), offset)
        pos = 0
        for v in views:
            n = min(len(v), len(got) - pos)
            v[:n] = got[pos : pos + n]
            pos += n
        return len(got)

    monkeypatch.setattr(nvme_io.os, "preadv", short_preadv)
    bufs = [np.zeros(4096, np.uint8) for _ in range(20)]  # 80 KiB asked, 64 KiB in the file
    assert backend.preadv(fh, bufs, 0) == 64 << 10
    assert np.concatenate(bufs)[: 64 << 10].tobytes() == data.tobytes()
    assert not np.concatenate(bufs)[64 << 10 :].any()
    backend.close(fh)
