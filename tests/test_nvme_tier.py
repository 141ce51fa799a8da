"""NvmeTier on real files with real O_DIRECT: round trips, coalescing, CRC checks, compaction, capacity."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import memops_jit
from kvstore.tiers.base import BlockMeta, CorruptBlock, TierFull
from kvstore.tiers.nvme import DROPPED, NvmeTier, PosixBackend, reader
from kvstore.tiers.nvme.faults import InstrumentedBackend
from kvstore.tiers.nvme.format import PAGE, crc32c, record_bytes, split_loc
from kvstore.tiers.nvme.io import aligned_buffer

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture(params=["python", "compiled"])
def record_checks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways the tier checks the records it read: Python's, and the compiled ``check_kernels.check_piece``."""
    if request.param == "python":
        monkeypatch.setattr(reader, "compiled_checks", lambda: None)
    else:
        if not memops_jit.AVAILABLE:
            pytest.skip("the compiled kernels need numba and a CPU with SSE4.2 and PCLMULQDQ")
        from kvstore.tiers.nvme import check_kernels

        check_kernels.warm_up()
        monkeypatch.setattr(reader, "compiled_checks", lambda: check_kernels)
    return str(request.param)


def payload_for(h: bytes, n: int) -> bytes:
    """Deterministic bytes for a hash, so any process can check them."""
    return np.random.default_rng(int.from_bytes(h[:8], "little")).bytes(n)


def block(n: int, rng: np.random.Generator, ns: str = "ns") -> tuple[BlockMeta, bytes]:
    h = rng.bytes(16)
    data = payload_for(h, n)
    return BlockMeta(ns, h, b"", 0, "bfloat16", n, n, crc32c(data)), data


def write_blocks(tier: NvmeTier, sizes: list[int], rng: np.random.Generator) -> dict[int, bytes]:
    pairs = [block(n, rng) for n in sizes]
    locs = tier.write([m for m, _ in pairs], [d for _, d in pairs])
    return {loc: d for loc, (_, d) in zip(locs, pairs)}


def read_all(tier: NvmeTier, blocks: dict[int, bytes]) -> list[bytes]:
    locs = list(blocks)
    dests = [bytearray(len(blocks[loc])) for loc in locs]
    tier.read(locs, [len(blocks[loc]) for loc in locs], dests)
    return [bytes(d) for d in dests]


def segment_files(d: Path) -> list[Path]:
    return sorted(d.glob("seg-*.log"))


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def test_round_trip_mixed_sizes_across_segments(tmp_path: Path, rng: np.random.Generator) -> None:
    tier = NvmeTier(tmp_path, 64 * MiB, segment_bytes=4 * MiB, write_io_bytes=256 * KiB)
    sizes = [0, 1, 4095, 4096, 4097, 64 * KiB, 300_001, 2 * MiB, 512 * KiB, 17]
    blocks: dict[int, bytes] = {}
    for _ in range(4):
        blocks.update(write_blocks(tier, list(rng.permutation(sizes)), rng))
    assert len(segment_files(tmp_path)) > 1
    assert read_all(tier, blocks) == list(blocks.values())
    # numpy destinations, a duplicated location, reverse order
    locs = list(blocks)[::-1] + [next(iter(blocks))]
    dests = [np.empty(len(blocks[loc]), np.uint8) for loc in locs]
    tier.read(locs, [len(blocks[loc]) for loc in locs], dests)
    assert all(d.tobytes() == blocks[loc] for d, loc in zip(dests, locs))
    s = tier.stats()
    assert s.backend == "posix-odirect" and not s.degraded
    assert tier.used_bytes == sum(record_bytes(len(d)) for d in blocks.values())
    tier.close()


@pytest.mark.parametrize("policy", ["direct", "fdatasync"])
def test_a_prefix_written_together_is_read_with_one_pread(
    tmp_path: Path, rng: np.random.Generator, policy: str
) -> None:
    backend = InstrumentedBackend(PosixBackend())
    tier = NvmeTier(
        tmp_path,
        256 * MiB,
        segment_bytes=64 * MiB,
        backend=backend,
        write_policy=policy,
        write_io_bytes=4 * MiB,
        max_read_bytes=8 * MiB,
        read_threads=1,
    )
    blocks = write_blocks(tier, [64 * KiB] * 32, rng)
    assert backend.pwrites == 2  # 2.2 MB in aligned writes of 557 KB (the device starts early) and the rest
    assert backend.syncs == (1 if policy == "fdatasync" else 0)
    backend.reset_counts()
    locs = list(blocks)
    order = list(rng.permutation(len(locs)))
    dests = [bytearray(64 * KiB) for _ in locs]
    tier.read([locs[i] for i in order], [64 * KiB] * 32, dests)
    assert [bytes(d) for d in dests] == [blocks[locs[i]] for i in order]
    assert backend.preads == 1
    big = write_blocks(tier, [512 * KiB] * 32, rng)  # 16 MiB: a few reads of <= 8 MiB, in parallel
    backend.reset_counts()
    assert read_all(tier, big) == list(big.values())
    assert backend.preads <= 3
    tier.close()


def test_default_pieces_are_a_few_parallel_reads(tmp_path: Path, rng: np.random.Generator) -> None:
    backend = InstrumentedBackend(PosixBackend())
    tier = NvmeTier(tmp_path, 256 * MiB, segment_bytes=64 * MiB, backend=backend)
    # pieces of <= 2 MiB (or one record), and at least 4 (one per read thread) when that leaves >= 1 MiB each
    for size, most in [(16 * KiB, 1), (64 * KiB, 2), (128 * KiB, 4), (512 * KiB, 11), (2 * MiB, 32)]:
        blocks = write_blocks(tier, [size] * 32, rng)
        backend.reset_counts()
        assert read_all(tier, blocks) == list(blocks.values())
        assert backend.preads == most
    tier.close()


@pytest.mark.usefixtures("record_checks")
def test_corruption_is_detected_and_never_served(tmp_path: Path, rng: np.random.Generator) -> None:
    tier = NvmeTier(tmp_path, 64 * MiB, segment_bytes=8 * MiB)
    blocks = write_blocks(tier, [20_000] * 8, rng)
    locs = list(blocks)
    seg_file = segment_files(tmp_path)[0]
    bad_payload, bad_header = locs[2], locs[5]
    flip_byte(seg_file, split_loc(bad_payload)[1] + PAGE + 12_345)
    flip_byte(seg_file, split_loc(bad_header)[1] + 20)
    dests = [bytearray(b"\xaa" * 20_000) for _ in locs]
    with pytest.raises(CorruptBlock) as err:
        tier.read(locs, [20_000] * 8, dests)
    assert sorted(err.value.locs) == sorted([bad_payload, bad_header])
    untouched = b"\xaa" * 20_000
    wiped = bytes(16_384) + b"\xaa" * (20_000 - 16_384)  # read straight into a page-aligned dest, then zeroed
    for loc, d in zip(locs, dests):
        if loc in (bad_payload, bad_header):  # which of the two: whether malloc placed the bytearray on a page
            assert bytes(d) in (untouched, wiped)
        else:
            assert bytes(d) == blocks[loc]
    with pytest.raises(CorruptBlock, match="expects"):  # a wrong length is not served either
        tier.read([locs[0]], [19_999], [bytearray(19_999)])
    with pytest.raises(CorruptBlock, match="no such location"):
        tier.read([(999 << 40) | 4096], [10], [bytearray(10)])
    assert tier.stats().extra["corrupt"] == 4
    tier.close()


@pytest.mark.usefixtures("record_checks")
def test_reads_land_in_aligned_unaligned_and_repeated_dests(tmp_path: Path, rng: np.random.Generator) -> None:
    """Page-aligned host dests get the payload straight from the device; any other dest is
    filled from scratch; a location asked twice fills both; odd sizes keep their tail."""
    backend = InstrumentedBackend(PosixBackend())
    tier = NvmeTier(tmp_path, 256 * MiB, segment_bytes=64 * MiB, backend=backend)
    sizes = [64 * KiB, 20_000, 1, PAGE, 3 * PAGE + 5, 300_000, 0, 128 * KiB] * 4
    blocks = write_blocks(tier, sizes, rng)
    locs = list(blocks) + [list(blocks)[3], list(blocks)[5]]  # two locations twice
    lengths = [len(blocks[loc]) for loc in locs]

    def dest(i: int, n: int) -> object:
        kind = i % 5
        if kind == 0:
            return aligned_buffer(n)  # page aligned numpy
        if kind == 1:
            return memoryview(aligned_buffer(n + PAGE))[:n]  # an arena-like memoryview slot
        if kind == 2:
            return bytearray(n)
        if kind == 3:
            return np.frombuffer(bytearray(n + 8), np.uint8)[8:]  # misaligned numpy
        return aligned_buffer(n + 2 * PAGE)  # larger than the block

    dests = [dest(i, n) for i, n in enumerate(lengths)]
    backend.reset_counts()
    tier.read(locs, lengths, dests)
    for loc, n, d in zip(locs, lengths, dests):
        assert bytes(memoryview(d)[:n]) == blocks[loc]
    assert backend.preads <= 8  # still a few coalesced reads
    tier.close()


@pytest.mark.usefixtures("record_checks")
def test_a_corrupt_record_read_in_place_leaves_zeros_not_its_bytes(tmp_path: Path, rng: np.random.Generator) -> None:
    tier = NvmeTier(tmp_path, 64 * MiB, segment_bytes=8 * MiB)
    blocks = write_blocks(tier, [64 * KiB + 100] * 6, rng)
    locs = list(blocks)
    seg_file = segment_files(tmp_path)[0]
    flip_byte(seg_file, split_loc(locs[1])[1] + PAGE + 777)  # in the page-aligned part (read in place)
    flip_byte(seg_file, split_loc(locs[4])[1] + PAGE + 64 * KiB + 50)  # in the tail (read into scratch)
    dests = [aligned_buffer(64 * KiB + 100) for _ in locs]
    for d in dests:
        d[:] = 0xAA
    with pytest.raises(CorruptBlock) as err:
        tier.read(locs, [64 * KiB + 100] * 6, dests)
    assert sorted(err.value.locs) == sorted([locs[1], locs[4]])
    for loc, d in zip(locs, dests):
        if loc in (locs[1], locs[4]):
            assert bytes(d[: 64 * KiB]) == bytes(64 * KiB)  # what was read in place is wiped
            assert bytes(d[64 * KiB :]) == b"\xaa" * 100  # the tail is never copied in
        else:
            assert d.tobytes() == blocks[loc]
    tier.close()


def test_a_read_error_wipes_in_place_dests(tmp_path: Path, rng: np.random.Generator) -> None:
    backend = InstrumentedBackend(PosixBackend())
    tier = NvmeTier(tmp_path, 64 * MiB, segment_bytes=8 * MiB, backend=backend)
    blocks = write_blocks(tier, [64 * KiB] * 4, rng)
    dests = [aligned_buffer(64 * KiB) for _ in blocks]
    for d in dests:
        d[:] = 0xAA
    backend.fail_reads()
    with pytest.raises(CorruptBlock, match="read failed"):
        tier.read(list(blocks), [64 * KiB] * 4, dests)
    backend.heal()
    tier.read(list(blocks), [64 * KiB] * 4, dests)
    assert [d.tobytes() for d in dests] == list(blocks.values())
    tier.close()


class Owner:
    """A minimal index owner: blocks by id -> loc, switched by on_relocate."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.loc: dict[int, int] = {}
        self.data: dict[int, bytes] = {}
        self.moves: list[tuple[int, int]] = []

    def relocate(self, pairs: list[tuple[int, int]]) -> None:
        with self.lock:
            self.moves.extend(pairs)
            where = {loc: k for k, loc in self.loc.items()}
            for old, new in pairs:
                k = where.get(old)
                if k is not None:
                    self.loc[k] = new


def test_compaction_keeps_live_blocks_and_deletes_segments(tmp_path: Path, rng: np.random.Generator) -> None:
    owner = Owner()
    tier = NvmeTier(tmp_path, 64 * MiB, segment_bytes=1 * MiB, on_relocate=owner.relocate)
    for k in range(12):
        blocks = write_blocks(tier, [60_000] * 12, rng)
        for j, (loc, d) in enumerate(blocks.items()):
            owner.loc[k * 100 + j], owner.data[k * 100 + j] = loc, d
    files_before = len(segment_files(tmp_path))
    disk_before = tier.stats().extra["disk_bytes"]
    doomed = [key for i, key in enumerate(sorted(owner.loc)) if i % 4 != 0]  # free 3 of 4
    tier.free([owner.loc.pop(k) for k in doomed])
    info = tier.reclaimable()
    assert info.compactable_segments >= files_before - 2 and info.compactable_gain_bytes > 0
    report = tier.compact()
    assert report.segments_compacted >= files_before - 2 and report.records_lost == 0
    assert len(segment_files(tmp_path)) < files_before / 2
    assert tier.stats().extra["disk_bytes"] < disk_before / 2
    assert len(owner.moves) == report.records_moved > 0
    keys = sorted(owner.loc)
    dests = [bytearray(60_000) for _ in keys]
    tier.read([owner.loc[k] for k in keys], [60_000] * len(keys), dests)
    assert all(bytes(d) == owner.data[k] for d, k in zip(dests, keys))
    # a read that picked up an old location just before the switch is served from the copy
    old, new = owner.moves[0]
    buf = bytearray(60_000)
    tier.read([old], [60_000], [buf])
    assert bytes(buf) == owner.data[[k for k, v in owner.loc.items() if v == new][0]]
    tier.close()
    # the free list survives a clean restart: exactly the live blocks come back
    again = NvmeTier(tmp_path, 64 * MiB, segment_bytes=1 * MiB)
    found = dict(((m.hash, loc) for m, loc in again.recover()))
    assert len(found) == len(owner.loc)
    again.close()


def test_free_through_a_forwarded_location_frees_the_copy(tmp_path: Path, rng: np.random.Generator) -> None:
    owner = Owner()
    tier = NvmeTier(tmp_path, 16 * MiB, segment_bytes=1 * MiB, on_relocate=owner.relocate)
    blocks = list(write_blocks(tier, [100_000] * 9, rng))  # fills one segment; the last rolls over
    tier.write(*zip(block(100_000, rng)))
    tier.free(blocks[1:])
    owner.loc[0] = blocks[0]
    tier.compact()
    assert owner.moves and owner.moves[0][0] == blocks[0]
    used = tier.used_bytes
    tier.free([blocks[0]])  # the owner frees by the old location before it switched
    assert tier.used_bytes == used - record_bytes(100_000)
    tier.close()


def test_reads_during_compaction_see_old_or_new_copy(tmp_path: Path, rng: np.random.Generator) -> None:
    owner = Owner()
    tier = NvmeTier(tmp_path, 64 * MiB, segment_bytes=1 * MiB, on_relocate=owner.relocate)
    for k in range(10):
        for j, (loc, d) in enumerate(write_blocks(tier, [30_000] * 20, rng).items()):
            owner.loc[k * 100 + j], owner.data[k * 100 + j] = loc, d
    tier.free([owner.loc.pop(k) for k in sorted(owner.loc)[::2]])
    stop, errors, reads = threading.Event(), [], [0]

    def reader() -> None:
        r = np.random.default_rng(7)
        while not stop.is_set():
            with owner.lock:
                keys = [int(k) for k in r.choice(sorted(owner.loc), 8)]
                locs = [owner.loc[k] for k in keys]
            dests = [bytearray(30_000) for _ in keys]
            try:
                tier.read(locs, [30_000] * 8, dests)
            except CorruptBlock as e:
                errors.append(e)
                return
            errors.extend(k for k, d in zip(keys, dests) if bytes(d) != owner.data[k])
            reads[0] += 1

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    report = tier.compact()
    stop.set()
    for t in threads:
        t.join()
    assert report.segments_compacted > 0 and reads[0] > 0
    assert errors == []
    tier.close()


def test_dropped_records_are_reported(tmp_path: Path, rng: np.random.Generator) -> None:
    owner = Owner()
    tier = NvmeTier(tmp_path, 16 * MiB, segment_bytes=1 * MiB, on_relocate=owner.relocate)
    locs = list(write_blocks(tier, [100_000] * 10, rng))
    tier.free(locs[1:8])
    flip_byte(tmp_path / "seg-0000000001.log", split_loc(locs[8])[1] + PAGE + 5)
    report = tier.compact()
    assert report.records_lost == 1 and (locs[8], DROPPED) in owner.moves
    tier.close()


def test_tier_full_allocates_nothing(tmp_path: Path, rng: np.random.Generator) -> None:
    tier = NvmeTier(tmp_path, 3 * MiB, segment_bytes=1 * MiB)  # 2 usable segments + 1 reserve
    write_blocks(tier, [200_000] * 8, rng)
    used, files = tier.used_bytes, segment_files(tmp_path)
    with pytest.raises(TierFull, match="compact"):
        write_blocks(tier, [200_000] * 4, rng)
    assert tier.used_bytes == used and segment_files(tmp_path) == files
    assert tier.fits(1 * MiB - PAGE) and not tier.fits(1 * MiB)
    tier.close()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    steps=st.integers(10, 60),
    max_block=st.sampled_from([5000, 60_000, 250_000]),
    free_p=st.floats(0.05, 0.9),
    compact_p=st.floats(0.0, 0.5),
    threshold=st.floats(0.2, 1.0),
)
def test_capacity_is_never_exceeded(
    tmp_path_factory: pytest.TempPathFactory,
    seed: int,
    steps: int,
    max_block: int,
    free_p: float,
    compact_p: float,
    threshold: float,
) -> None:
    """Random write / free / compact sequences: the files on disk never exceed the capacity."""
    d = tmp_path_factory.mktemp("cap")
    owner = Owner()
    capacity = 6 * 256 * KiB
    tier = NvmeTier(d, capacity, segment_bytes=256 * KiB, on_relocate=owner.relocate, write_policy="direct")
    r = np.random.default_rng(seed)
    key = 0
    for _ in range(steps):
        x = r.random()
        if x < 0.6:
            pairs = [block(int(r.integers(0, max_block)), r) for _ in range(int(r.integers(1, 7)))]
            try:
                locs = tier.write([m for m, _ in pairs], [p for _, p in pairs])
            except TierFull:
                doomed = [k for k in sorted(owner.loc) if r.random() < free_p]
                tier.free([owner.loc.pop(k) for k in doomed])
                tier.compact()
                continue
            for loc, (_, p) in zip(locs, pairs):
                owner.loc[key], owner.data[key] = loc, p
                key += 1
        elif x < 0.6 + 0.4 * (1 - compact_p):
            doomed = [k for k in sorted(owner.loc) if r.random() < free_p]
            tier.free([owner.loc.pop(k) for k in doomed])
        else:
            tier.compact(threshold=threshold)
        assert sum(f.stat().st_size for f in segment_files(d)) <= capacity
        assert tier.stats().extra["disk_bytes"] <= capacity
    keys = sorted(owner.loc)
    dests = [bytearray(len(owner.data[k])) for k in keys]
    tier.read([owner.loc[k] for k in keys], [len(owner.data[k]) for k in keys], dests)
    assert all(bytes(x) == owner.data[k] for x, k in zip(dests, keys))
    assert tier.used_bytes == sum(record_bytes(len(owner.data[k])) for k in keys)
    tier.close()


def test_a_directory_is_opened_by_one_tier_at_a_time(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path, 4 * MiB, segment_bytes=1 * MiB)
    with pytest.raises(RuntimeError, match="in use"):
        NvmeTier(tmp_path, 4 * MiB, segment_bytes=1 * MiB)
    tier.close()
    NvmeTier(tmp_path, 4 * MiB, segment_bytes=1 * MiB).close()


def test_writes_take_numpy_and_memoryview_sources(tmp_path: Path, rng: np.random.Generator) -> None:
    tier = NvmeTier(tmp_path, 8 * MiB, segment_bytes=1 * MiB)
    arr = np.arange(5000, dtype=np.float32)
    raw = arr.tobytes()
    metas = [BlockMeta("ns", rng.bytes(16), b"", 0, "float32", len(raw), len(raw), crc32c(raw)) for _ in range(3)]
    locs = tier.write(metas, [arr, memoryview(raw), bytearray(raw)])
    out = np.zeros(5000, np.float32)
    tier.read(locs[:1], [len(raw)], [out])
    assert np.array_equal(out, arr)
    with pytest.raises(ValueError, match="stored_length"):
        tier.write(metas[:1], [raw[:-1]])
    assert os.listdir(tmp_path)
    tier.close()


def test_a_writer_dropping_empty_segments_never_retires_the_one_being_compacted(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """A writer that needs a segment drops empty ones; the segment being compacted is empty once its records
    moved. Retired under the compaction, it was retired twice (a KeyError that aborted the pass; with reads
    still to do, records read from a closed or reused descriptor were reported lost: seen in bench.vllm_pd)."""
    owner = Owner()
    writes: list[object] = []

    def relocate_then_write(pairs: list[tuple[int, int]]) -> None:  # runs inside the compaction, before retire
        owner.relocate(pairs)
        try:
            writes.append(write_blocks(tier, [60_000] * 20, rng))  # needs a new segment: drops empty ones
        except TierFull as full:
            writes.append(full)

    tier = NvmeTier(tmp_path, 4 * MiB, segment_bytes=1 * MiB, on_relocate=relocate_then_write)
    blocks = write_blocks(tier, [60_000] * 40, rng)  # three segments
    locs = list(blocks)
    first = {loc for loc in locs if split_loc(loc)[0] == split_loc(locs[0])[0]}
    keep = sorted(first)[0]
    tier.free(sorted(first - {keep}))  # the first segment: one live record left; the others stay full
    report = tier.compact()  # moves it into the active segment, then the hook's write needs a new segment
    assert report.segments_compacted == 1 and report.records_lost == 0 and writes
    moved = dict(owner.moves)[keep]
    assert read_all(tier, {moved: blocks[keep]}) == [blocks[keep]]
    tier.close()


def test_compaction_never_waits_for_a_reader_outside_and_its_release_deletes_the_file(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """A segment lent to a reader outside the process (``extents``, an shm client reading the files itself) is
    retired by compaction without waiting for it: the store's lock may be held by the compacting writer and be
    needed by the reader's release (a lane closing did that, and the store hung). The file stays, readable,
    until the pin ends; then it is deleted and its space counted free."""
    owner = Owner()
    tier = NvmeTier(tmp_path, 4 * MiB, segment_bytes=1 * MiB, on_relocate=owner.relocate)
    blocks = write_blocks(tier, [60_000] * 20, rng)  # a full first segment, the rest in the second
    locs = sorted(blocks)
    first = [loc for loc in locs if split_loc(loc)[0] == split_loc(locs[0])[0]]
    keep = first[0]
    owner.loc, owner.data = {0: keep}, {0: blocks[keep]}
    (place,), pins = tier.extents([keep])
    assert place is not None
    name, offset = place
    tier.free(first[1:])
    done = threading.Event()
    reports: list[object] = []
    compacting = threading.Thread(target=lambda: (reports.append(tier.compact(threshold=1.0)), done.set()), daemon=True)
    compacting.start()
    assert done.wait(30), "compaction waited for the pinned segment's outside reader"
    compacting.join()
    assert reports and reports[0].segments_compacted >= 1  # type: ignore[attr-defined]
    held = tmp_path / name
    assert held.exists()  # still the reader's: nothing rewrote it
    with open(held, "rb") as f:
        f.seek(offset)
        assert f.read(60_000) == blocks[keep]
    disk = tier.reclaimable().disk_bytes
    tier.release_extents(pins)
    assert not held.exists() and tier.reclaimable().disk_bytes == disk - 1 * MiB
    moved = owner.loc[0]
    assert moved != keep and read_all(tier, {moved: blocks[keep]}) == [blocks[keep]]
    tier.close()
