"""Read planning: coalesced runs cut into balanced pieces within the size limit."""
from __future__ import annotations

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
    pieces = plan_pieces(None, layout([64 * KiB] * 32), 2 * MiB, 0, parallel=4)  # type: ignore[arg-type]
    assert [len(p.records) for p in pieces] == [8, 8, 8, 8]
    assert len(plan_pieces(None, layout([64 * KiB] * 32), 8 * MiB, 0, parallel=1)) == 1  # type: ignore[arg-type]


def test_gaps_split_runs_unless_small() -> None:
    ws = layout([10_000] * 4, gaps=[0, 0, 40, 0])  # a 160 KiB hole before the third record
    assert len(plan_pieces(None, ws, 8 * MiB, 128 * KiB)) == 2  # type: ignore[arg-type]
    assert len(plan_pieces(None, ws, 8 * MiB, 256 * KiB)) == 1  # type: ignore[arg-type]


@given(lengths=st.lists(st.integers(0, 3 * MiB), min_size=1, max_size=40),
       gaps=st.lists(st.integers(0, 64), min_size=40, max_size=40),
       max_bytes=st.sampled_from([256 * KiB, 2 * MiB, 8 * MiB]), parallel=st.integers(1, 8))
def test_every_record_in_exactly_one_piece_within_limits(lengths: list[int], gaps: list[int], max_bytes: int,
                                                         parallel: int) -> None:
    ws = layout(lengths, gaps)
    pieces = plan_pieces(None, list(reversed(ws)), max_bytes, 64 * KiB, parallel)  # type: ignore[arg-type]
    seen = [w for p in pieces for w in p.records]
    assert sorted(w.offset for w in seen) == [w.offset for w in ws]
    for p in pieces:
        assert p.offset == p.records[0].offset
        assert p.nbytes == p.records[-1].offset + p.records[-1].nbytes - p.offset
        assert p.nbytes <= max_bytes or len(p.records) == 1
