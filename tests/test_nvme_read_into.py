"""``NvmeTier.read_into``: raw payloads read straight into page-aligned memory, one compiled call a piece
(kvstore/tiers/nvme/runs.py), on real segment files with O_DIRECT. Exact bytes in any order and across segments, a
damaged record or a wrong CRC32C failing alone, and every batch that is no such run left to ``read``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import memops_jit, payload_runs
from kvstore.tiers.base import BlockMeta
from kvstore.tiers.nvme import NvmeTier, PosixBackend, runs
from kvstore.tiers.nvme.faults import InstrumentedBackend
from kvstore.tiers.nvme.format import HEADER_BYTES, crc32c, make_loc, split_loc
from kvstore.tiers.nvme.io import aligned_buffer

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 64 * KiB, 512 * KiB, 12 * KiB]  # whole pages, as raw KV blocks are


@pytest.fixture(autouse=True)
def compiled() -> None:
    if not memops_jit.AVAILABLE:
        pytest.skip("the compiled kernels need numba and a CPU with SSE4.2 and PCLMULQDQ")
    payload_runs.COMPILED.warm_up()


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[NvmeTier, list[int], list[np.ndarray]]:
    """40 records of whole-page sizes over segments of 4 MiB (so some runs cross a segment's end)."""
    root = tmp_path_factory.mktemp("read_into")
    tier = NvmeTier(root, 64 * MiB, segment_bytes=4 * MiB, write_io_bytes=256 * KiB)
    rng = np.random.default_rng(5)
    payloads = [rng.integers(0, 256, SIZES[k % len(SIZES)], dtype=np.uint8) for k in range(40)]
    metas = [BlockMeta("ns", rng.bytes(16), b"", 0, "uint8", len(p), len(p), crc32c(p)) for p in payloads]
    locs = tier.write(metas, payloads)
    return tier, locs, payloads


def read_into(tier: NvmeTier, picks: list[int], locs: list[int], payloads: list[np.ndarray], crcs=None, dests=None):
    dests = dests if dests is not None else [aligned_buffer(len(payloads[i])) for i in picks]
    lengths = np.array([len(payloads[i]) for i in picks], dtype=np.int64)
    crcs = np.array(crcs if crcs is not None else [crc32c(payloads[i]) for i in picks], dtype=np.int64)
    addresses = np.array([int(d.ctypes.data) for d in dests], dtype=np.int64)
    return tier.read_into([locs[i] for i in picks], lengths, crcs, addresses), dests


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(start=st.integers(0, 35), count=st.integers(1, 5), shuffle=st.randoms(use_true_random=False))
def test_neighbouring_records_come_back_exact_in_any_order(written, start, count, shuffle):
    tier, locs, payloads = written
    picks = list(range(start, min(start + count, len(locs))))
    shuffle.shuffle(picks)
    failed, dests = read_into(tier, picks, locs, payloads)
    assert failed == []
    assert all(d.tobytes() == payloads[i].tobytes() for i, d in zip(picks, dests))


def test_a_prefix_across_a_segment_end_and_cut_into_pieces(written, monkeypatch):
    tier, locs, payloads = written
    segments = [split_loc(loc)[0] for loc in locs]
    assert len(set(segments)) > 1
    monkeypatch.setattr(runs, "PIECE_BYTES", 64 * KiB)  # many pieces, read on this thread and the tier's readers
    failed, dests = read_into(tier, list(range(len(locs))), locs, payloads)
    assert failed == []
    assert all(d.tobytes() == p.tobytes() for d, p in zip(dests, payloads))


@pytest.mark.parametrize("bad", [0, 3])
def test_a_crc_that_differs_from_the_records_fails_that_block_alone(written, bad):
    tier, locs, payloads = written
    picks = [4, 5, 6, 7]
    crcs = [crc32c(payloads[i]) ^ (1 if k == bad else 0) for k, i in enumerate(picks)]
    failed, dests = read_into(tier, picks, locs, payloads, crcs)
    assert failed == [bad]
    assert all(d.tobytes() == payloads[i].tobytes() for k, (i, d) in enumerate(zip(picks, dests)) if k != bad)


def test_a_damaged_payload_fails_alone(tmp_path: Path):
    tier = NvmeTier(tmp_path, 16 * MiB, segment_bytes=4 * MiB)
    rng = np.random.default_rng(9)
    payloads = [rng.integers(0, 256, 64 * KiB, dtype=np.uint8) for _ in range(6)]
    metas = [BlockMeta("ns", rng.bytes(16), b"", 0, "uint8", len(p), len(p), crc32c(p)) for p in payloads]
    locs = tier.write(metas, payloads)
    seg, offset = split_loc(locs[2])
    with open(tmp_path / f"seg-{seg:010d}.log", "r+b") as f:  # a bad sector in record 2's payload
        at = offset + HEADER_BYTES + 100
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    failed, dests = read_into(tier, list(range(6)), locs, payloads)
    assert failed == [2]
    assert all(d.tobytes() == p.tobytes() for k, (d, p) in enumerate(zip(dests, payloads)) if k != 2)
    assert all(s.readers == 0 for s in tier._log.segments.values())  # no segment left pinned (the tier's count)
    tier.close()


def test_what_is_no_such_run_is_left_to_read(written, tmp_path: Path):
    tier, locs, payloads = written
    unaligned = [aligned_buffer(len(payloads[i]) + PAGE_PLUS)[64 : 64 + len(payloads[i])] for i in (0, 1)]
    assert read_into(tier, [0, 1], locs, payloads, dests=unaligned)[0] is None
    assert split_loc(locs[0])[0] == split_loc(locs[3])[0]
    assert read_into(tier, [0, 3], locs, payloads)[0] is None  # 580 KiB of other records between: not one run
    gone = make_loc(999, 0)  # a segment that does not exist: ``read`` says so
    assert (
        tier.read_into([gone], np.array([4096]), np.array([0]), np.array([int(aligned_buffer(4096).ctypes.data)]))
        is None
    )
    rng = np.random.default_rng(3)
    odd = rng.integers(0, 256, 5000, dtype=np.uint8)  # not whole pages: its tail would go through scratch
    other = NvmeTier(tmp_path / "odd", 16 * MiB, segment_bytes=4 * MiB)
    loc = other.write([BlockMeta("ns", rng.bytes(16), b"", 0, "uint8", 5000, 5000, crc32c(odd))], [odd])
    assert read_into(other, [0], loc, [odd], dests=[aligned_buffer(8192)[:5000]])[0] is None
    other.close()
    instrumented = NvmeTier(
        tmp_path / "seam", 16 * MiB, segment_bytes=4 * MiB, backend=InstrumentedBackend(PosixBackend())
    )
    page = rng.integers(0, 256, 4096, dtype=np.uint8)
    loc = instrumented.write([BlockMeta("ns", rng.bytes(16), b"", 0, "uint8", 4096, 4096, crc32c(page))], [page])
    assert read_into(instrumented, [0], loc, [page])[0] is None  # a fault seam's reads go through its backend
    instrumented.close()


def test_a_piece_of_more_blocks_than_one_preadv_takes_is_left_to_read(written, monkeypatch):
    tier, locs, payloads = written
    monkeypatch.setattr(runs, "MAX_BLOCKS", 2)  # IOV_MAX / 2 in truth: 4 KiB records fill a 2 MiB piece with 256
    assert read_into(tier, [8, 9, 10], locs, payloads)[0] is None
    assert read_into(tier, [8, 9], locs, payloads)[0] == []


def test_nothing_is_read_until_the_kernels_are_ready(written, monkeypatch):
    tier, locs, payloads = written
    monkeypatch.setattr(payload_runs, "ready", lambda: False)
    assert read_into(tier, [0, 1], locs, payloads)[0] is None


PAGE_PLUS = 4096 + 128
