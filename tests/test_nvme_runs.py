"""``NvmeTier.read``'s compiled runs (kvstore/tiers/nvme/runs.py): raw payloads bound for page-aligned host memory read
by one compiled call a piece, on real segment files with O_DIRECT. Exact bytes in any order, across a segment's end
and in many pieces handed on as they land; a damaged record or a wrong CRC32C read again record by record and
reported alone; and every batch that is no such run read the general way."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import memops_jit, payload_runs
from kvstore.tiers.base import CorruptBlock
from kvstore.tiers.nvme import NvmeTier, PosixBackend, runs
from kvstore.tiers.nvme.faults import InstrumentedBackend
from kvstore.tiers.nvme.format import crc32c, split_loc
from kvstore.tiers.nvme.io import aligned_buffer
from tests.nvme_runs_support import damage, make_tier, write
from tests.nvme_runs_support import written as written_records

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 64 * KiB, 512 * KiB, 12 * KiB]  # whole pages, as raw KV blocks are


@pytest.fixture(autouse=True, params=["gathered", "direct"])
def compiled(request, monkeypatch) -> None:
    """Both ways a run of small blocks is read: into scratch and copied out (``payload_runs.GATHER_BLOCK_BYTES``,
    blocks up to 256 KiB by default), or each payload straight into its destination."""
    if not memops_jit.AVAILABLE:
        pytest.skip("the compiled kernels need numba and a CPU with SSE4.2 and PCLMULQDQ")
    payload_runs.COMPILED.warm_up()
    if request.param == "direct":
        monkeypatch.setattr(payload_runs, "GATHER_BLOCK_BYTES", 0)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[NvmeTier, list[int], list[np.ndarray]]:
    """40 records of whole-page sizes over segments of 4 MiB (so some runs cross a segment's end)."""
    return written_records(tmp_path_factory.mktemp("runs"), SIZES, 40, 5)


def counts(tier: NvmeTier) -> tuple[int, int]:
    extra = tier.stats().extra
    return int(extra["read_ios"]), int(extra["run_read_ios"])


def read(tier, picks, locs, payloads, crcs=None, dests=None, on_ready=None, on_caller=False):
    """``tier.read`` of ``picks``; (dests, read_ios, of them compiled) of this read."""
    dests = dests if dests is not None else [aligned_buffer(len(payloads[i])) for i in picks]
    crcs = crcs if crcs is not None else [crc32c(payloads[i]) for i in picks]
    before = counts(tier)
    tier.read([locs[i] for i in picks], [len(payloads[i]) for i in picks], dests, on_ready, crcs, on_caller)
    after = counts(tier)
    return dests, after[0] - before[0], after[1] - before[1]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(start=st.integers(0, 35), count=st.integers(1, 5), shuffle=st.randoms(use_true_random=False))
def test_neighbouring_records_come_back_exact_in_any_order(written, start, count, shuffle):
    tier, locs, payloads = written
    picks = list(range(start, min(start + count, len(locs))))
    shuffle.shuffle(picks)
    dests, ios, compiled_ios = read(tier, picks, locs, payloads)
    assert all(d.tobytes() == payloads[i].tobytes() for i, d in zip(picks, dests))
    assert compiled_ios == ios > 0  # every piece read by one compiled call


@pytest.mark.parametrize("on_caller", [False, True])
def test_many_pieces_across_a_segment_end_are_handed_on_once_each(written, monkeypatch, on_caller):
    tier, locs, payloads = written
    assert len({split_loc(loc)[0] for loc in locs}) > 1
    monkeypatch.setattr(tier, "max_read_bytes", 64 * KiB)  # many pieces, read on this thread and the tier's readers
    seen: list[tuple[int, bool]] = []
    me = threading.get_ident()
    dests, ios, compiled_ios = read(
        tier, list(range(len(locs))), locs, payloads,
        on_ready=lambda ks: seen.extend((k, threading.get_ident() == me) for k in ks), on_caller=on_caller,
    )  # fmt: skip
    assert all(d.tobytes() == p.tobytes() for d, p in zip(dests, payloads))
    assert compiled_ios == ios > 2
    assert sorted(k for k, _ in seen) == list(range(len(locs)))
    if on_caller:  # the readers only read; the caller hands each piece on (the lane copies it out there)
        assert all(mine for _, mine in seen)


def test_a_damaged_payload_is_read_again_and_reported_alone(tmp_path: Path):
    tier = make_tier(tmp_path)
    rng = np.random.default_rng(9)
    payloads = [rng.integers(0, 256, 64 * KiB, dtype=np.uint8) for _ in range(6)]
    locs = write(tier, payloads, rng)
    damage(tmp_path, locs[2])  # a bad sector in record 2's payload
    ready: list[int] = []
    dests = [aligned_buffer(64 * KiB) for _ in payloads]
    for d in dests:
        d[:] = 0x5A
    with pytest.raises(CorruptBlock) as err:
        tier.read(locs, [64 * KiB] * 6, dests, ready.extend, [crc32c(p) for p in payloads])
    assert err.value.locs == [locs[2]]
    assert sorted(ready) == [0, 1, 3, 4, 5]  # never the damaged one
    assert not dests[2].any()  # what landed of it was zeroed by the record-by-record read
    assert all(d.tobytes() == p.tobytes() for k, (d, p) in enumerate(zip(dests, payloads)) if k != 2)
    assert all(s.readers == 0 for s in tier._log.segments.values())  # no segment left pinned (the tier's count)
    tier.close()


def test_a_crc_that_differs_from_the_records_is_reported(written):
    tier, locs, payloads = written
    picks = [4, 5, 6, 7]
    crcs = [crc32c(payloads[i]) ^ (1 if k == 1 else 0) for k, i in enumerate(picks)]
    with pytest.raises(CorruptBlock) as err:
        read(tier, picks, locs, payloads, crcs)
    assert err.value.locs == [locs[5]]


def test_what_is_no_such_run_is_read_the_general_way(written, tmp_path: Path, monkeypatch):
    tier, locs, payloads = written

    def general(picks, **kw) -> None:
        dests, ios, compiled_ios = read(tier, picks, locs, payloads, **kw)
        assert compiled_ios == 0 and ios > 0
        assert all(bytes(memoryview(d)[: len(payloads[i])]) == payloads[i].tobytes() for i, d in zip(picks, dests))

    general([0, 1], dests=[aligned_buffer(len(payloads[i]) + 4096)[64 : 64 + len(payloads[i])] for i in (0, 1)])
    general([0, 1], dests=[bytearray(len(payloads[i])) for i in (0, 1)])  # not page aligned as a rule
    general([0, 3])  # 580 KiB of other records between: not one run
    general([0, 1], crcs=[None, crc32c(payloads[1])])  # a block whose CRC32C the caller does not know
    general([1, 1])  # a location twice
    monkeypatch.setattr(runs, "MAX_BLOCKS", 2)  # IOV_MAX / 2 in truth
    general([8, 9, 10])
    monkeypatch.undo()
    monkeypatch.setattr(payload_runs, "ready", lambda: False)  # the kernels still compiling
    general([0, 1])


def test_an_empty_payload_reads_the_general_way(tmp_path: Path):
    tier = make_tier(tmp_path)
    rng = np.random.default_rng(4)
    payloads = [np.zeros(0, dtype=np.uint8), rng.integers(0, 256, 4096, dtype=np.uint8)]
    locs = write(tier, payloads, rng)
    dests, _, compiled_ios = read(tier, [0, 1], locs, payloads, dests=[np.zeros(0, np.uint8), aligned_buffer(4096)])
    assert compiled_ios == 0 and dests[1].tobytes() == payloads[1].tobytes()
    tier.close()


def test_payloads_that_are_not_whole_pages_and_a_fault_seam_read_the_general_way(tmp_path: Path):
    rng = np.random.default_rng(3)
    for root, backend, size in (
        (tmp_path / "odd", None, 5000),
        (tmp_path / "seam", InstrumentedBackend(PosixBackend()), 4096),
    ):
        tier = make_tier(root, backend)
        payload = rng.integers(0, 256, size, dtype=np.uint8)
        loc = write(tier, [payload], rng)
        dests, ios, compiled_ios = read(tier, [0], loc, [payload], dests=[aligned_buffer(8192)[:size]])
        assert compiled_ios == 0 and dests[0].tobytes() == payload.tobytes()
        tier.close()
