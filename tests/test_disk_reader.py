"""The shm client's own reads of NVMe records (``--share-nvme``): kvstore/lanes/client/disk.py against real
segment files written by the NVMe tier. Exact bytes into every kind of destination (page-aligned, unaligned,
split in several spans, lengths that are not a multiple of a page), records read through gaps, and every
failure (a corrupt payload, a bad file name, a location past the end) reported by position, never served."""

from __future__ import annotations

import ctypes
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import memops_jit, payload_runs
from kvstore.arena_index_layout import segment_name
from kvstore.checksum import crc32c
from kvstore.lanes.client import disk as client_disk
from kvstore.lanes.client import segment_files
from kvstore.lanes.client.disk import DiskBlock, DiskReader
from kvstore.tiers.base import BlockMeta
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.nvme.io import aligned_buffer


def _address(a: np.ndarray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(a))


@pytest.fixture(scope="module", autouse=True)
def small_pieces():
    """Pieces of 64 KiB at least (1 MiB by default, and runs under 3 MiB not cut), so these files of 1.6 MB are cut
    across the threads too."""
    default = client_disk.MIN_PIECE_BYTES, client_disk.ALONE_BYTES
    client_disk.MIN_PIECE_BYTES, client_disk.ALONE_BYTES = 64 << 10, 0
    yield
    client_disk.MIN_PIECE_BYTES, client_disk.ALONE_BYTES = default


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, list[tuple[str, int]], list[np.ndarray]]:
    """40 records of assorted sizes in one tier directory; where each payload lies and its bytes."""
    root = tmp_path_factory.mktemp("nvme")
    tier = NvmeTier(root, 1 << 30, segment_bytes=64 << 20)
    rng = np.random.default_rng(7)
    sizes = [4096, 65536, 1, 5000, 12288, 100_000, 131072, 8191] * 5
    payloads = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    metas = [BlockMeta("t", rng.bytes(16), b"", 0, "uint8", len(p), len(p), crc32c(p)) for p in payloads]
    locs = tier.write(metas, payloads)
    where, pins = tier.extents(locs)
    tier.release_extents(pins)
    tier.close()  # the files stay; nothing rewrites them now
    assert all(w is not None for w in where)
    return root, [w for w in where if w is not None], payloads


def _block(i: int, where: tuple[str, int], payload: np.ndarray, spans: tuple[tuple[int, int], ...]) -> DiskBlock:
    return DiskBlock(i, where[0], where[1], len(payload), crc32c(payload), spans)


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("dest", ["aligned", "unaligned", "spans"])
def test_every_record_comes_back_exact(written, threads, dest):
    root, where, payloads = written
    reader = DiskReader(str(root), threads=threads)
    keep: list[np.ndarray] = []
    blocks = []
    for i, (w, p) in enumerate(zip(where, payloads)):
        if dest == "aligned":
            buf = aligned_buffer(len(p))
            spans: tuple[tuple[int, int], ...] = ((_address(buf), len(p)),)
            keep.append(buf)
        elif dest == "unaligned":
            buf = np.zeros(len(p) + 3, dtype=np.uint8)[3:]
            spans = ((_address(buf), len(p)),)
            keep.append(buf)
        else:  # a block in several buffers, as a vLLM block is one slice per layer: page-sized parts, then the rest
            cut = min(len(p), 4096)
            a, b = aligned_buffer(cut), aligned_buffer(max(len(p) - cut, 1))
            spans = ((_address(a), cut),) + (((_address(b), len(p) - cut),) if len(p) > cut else ())
            keep += [a, b]
        blocks.append(_block(i, w, p, spans))
    assert reader.read(blocks) == []
    for blk, p in zip(blocks, payloads):
        got = b"".join(ctypes.string_at(addr, n) for addr, n in blk.spans)
        assert got == p.tobytes()
    reader.close()


def test_records_far_apart_and_in_any_order(written):
    """Every third record, in reverse: runs break at gaps larger than GAP_BYTES and pieces are still right."""
    root, where, payloads = written
    reader = DiskReader(str(root), threads=3)
    pick = list(range(0, len(where), 3))[::-1]
    bufs = [aligned_buffer(len(payloads[i])) for i in pick]
    blocks = [_block(k, where[i], payloads[i], ((_address(b), len(b)),)) for k, (i, b) in enumerate(zip(pick, bufs))]
    assert reader.read(blocks) == []
    assert all(b.tobytes() == payloads[i].tobytes() for i, b in zip(pick, bufs))


def test_failures_are_reported_by_position_and_the_rest_is_read(written):
    root, where, payloads = written
    reader = DiskReader(str(root))
    bufs = [aligned_buffer(len(p)) for p in payloads[:6]]
    blocks = [_block(i, where[i], payloads[i], ((_address(b), len(b)),)) for i, b in enumerate(bufs)]
    blocks[1].crc32c ^= 1  # as if the record on disk were corrupt
    blocks[3] = DiskBlock(3, "../etc/passwd", blocks[3].offset, blocks[3].length, blocks[3].crc32c, blocks[3].spans)
    blocks[4].offset = 1 << 40  # past the end of the file: a short read
    assert sorted(reader.read(blocks)) == [1, 3, 4]
    for i in (0, 2, 5):
        assert bufs[i].tobytes() == payloads[i].tobytes()


def test_a_missing_file_fails_its_blocks(written):
    root, where, payloads = written
    reader = DiskReader(str(root))
    buf = aligned_buffer(len(payloads[0]))
    assert reader.read(
        [DiskBlock(9, "seg-0000009999.log", where[0][1], len(buf), 0, ((_address(buf), len(buf)),))]
    ) == [9]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    picks=st.lists(st.integers(0, 39), min_size=1, max_size=12, unique=True),
    shifts=st.lists(st.sampled_from([0, 0, 1, 512, 4096]), min_size=12, max_size=12),
    threads=st.integers(1, 4),
)
def test_any_subset_into_any_alignment(written, picks, shifts, threads):
    root, where, payloads = written
    reader = DiskReader(str(root), threads=threads)
    bufs = [aligned_buffer(len(payloads[i]) + 4096)[s : s + len(payloads[i])] for i, s in zip(picks, shifts)]
    blocks = [_block(k, where[i], payloads[i], ((_address(b), len(b)),)) for k, (i, b) in enumerate(zip(picks, bufs))]
    assert reader.read(blocks) == []
    assert all(b.tobytes() == payloads[i].tobytes() for i, b in zip(picks, bufs))
    reader.close()


def test_a_directory_this_process_cannot_see_makes_the_reader_unusable(tmp_path, written):
    """As in a container that does not mount the store's NVMe directory: every block fails (the store then reads
    them) and ``unusable`` says why, so the lane stops asking for disk reads."""
    _, where, payloads = written
    reader = DiskReader(str(tmp_path / "not-mounted"))
    buf = aligned_buffer(len(payloads[0]))
    assert reader.read([_block(0, where[0], payloads[0], ((_address(buf), len(buf)),))]) == [0]
    assert "not-mounted" in reader.unusable
    assert DiskReader(str(tmp_path)).unusable == ""


def test_one_reader_reuses_its_scratch_across_reads_and_grows_it(written, tmp_path):
    """Each thread keeps one scratch: reads in a row into unaligned memory stay exact, a corrupt record
    between them fails alone, and a record larger than the scratch makes it grow."""
    root, where, payloads = written
    reader = DiskReader(str(root), threads=2)
    for round_ in range(3):
        picks = list(range(round_, 40, 3))
        bufs = [aligned_buffer(len(payloads[i]) + 64)[1 : 1 + len(payloads[i])] for i in picks]
        blocks = [
            _block(k, where[i], payloads[i], ((_address(b), len(b)),)) for k, (i, b) in enumerate(zip(picks, bufs))
        ]
        if round_ == 1:
            blocks[2].crc32c ^= 1
        assert reader.read(blocks) == ([2] if round_ == 1 else [])
        assert all(
            b.tobytes() == payloads[i].tobytes()
            for k, (i, b) in enumerate(zip(picks, bufs))
            if not (round_ == 1 and k == 2)
        )
    reader.close()

    tier = NvmeTier(tmp_path, 1 << 30, segment_bytes=64 << 20)
    big = np.random.default_rng(3).integers(0, 256, (9 << 20) + 5, dtype=np.uint8)  # past SCRATCH_BYTES
    (loc,) = tier.write([BlockMeta("t", b"\x01" * 16, b"", 0, "uint8", len(big), len(big), crc32c(big))], [big])
    (place,), pins = tier.extents([loc])
    tier.release_extents(pins)
    tier.close()
    assert place is not None
    reader = DiskReader(str(tmp_path), threads=1)
    out = aligned_buffer(len(big) + 64)[3 : 3 + len(big)]
    assert reader.read([DiskBlock(0, place[0], place[1], len(big), crc32c(big), ((_address(out), len(out)),))]) == []
    assert out.tobytes() == big.tobytes()
    reader.close()


# -- read_run: the common Get (whole-page payloads of one file into page-aligned buffers) as array operations ---
def _run_args(where, payloads, picks, bufs, crcs=None):
    return (
        where[picks[0]][0],
        np.arange(len(picks), dtype=np.int64),
        np.array([where[i][1] for i in picks], dtype=np.int64),
        np.array([len(payloads[i]) for i in picks], dtype=np.int64),
        np.array(crcs if crcs is not None else [crc32c(payloads[i]) for i in picks], dtype=np.int64),
        np.array([_address(b) for b in bufs], dtype=np.int64),
    )


WHOLE_PAGES = [i for i in range(40) if [4096, 65536, 1, 5000, 12288, 100_000, 131072, 8191][i % 8] % 4096 == 0]


class _Ready:
    def __init__(self, ready: bool):
        self.value = ready

    def ready(self) -> bool:
        return self.value


@pytest.fixture(params=["compiled", "compiled-direct", "arrays"])
def runs_allowed(request, monkeypatch):
    """Every way of reading a run: the compiled kernel (``payload_run_kernels.read_run``), small blocks gathered
    through scratch or (``-direct``) each read straight into its buffer, and numpy's array operations."""
    monkeypatch.setattr(client_disk, "ALONE_BYTES", 3 << 20)  # the module's fixture turns single pieces off
    compiled = request.param != "arrays"
    if compiled:
        if not memops_jit.AVAILABLE:
            pytest.skip("the compiled kernels need numba and a CPU with SSE4.2 and PCLMULQDQ")
        client_disk._compiled.warm_up()
    if request.param == "compiled-direct":
        monkeypatch.setattr(payload_runs, "GATHER_BLOCK_BYTES", 0)
    monkeypatch.setattr(client_disk, "_compiled", _Ready(compiled))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(picks=st.lists(st.sampled_from(WHOLE_PAGES), min_size=1, max_size=10, unique=True), bad=st.integers(-1, 9))
def test_a_run_comes_back_exact_in_any_order_and_a_corrupt_block_fails_alone(written, runs_allowed, picks, bad):
    """Positions are the caller's order, the file's order may differ; records of other sizes between the picked
    ones are read through into scratch (or, past GAP_BYTES, the run is not one: ``read`` takes it)."""
    root, where, payloads = written
    reader = DiskReader(str(root))
    bufs = [aligned_buffer(len(payloads[i])) for i in picks]
    crcs = [crc32c(payloads[i]) ^ (1 if k == bad else 0) for k, i in enumerate(picks)]
    failed = reader.read_run(*_run_args(where, payloads, picks, bufs, crcs))
    offsets = sorted(where[i][1] for i in picks)
    ends = {where[i][1]: where[i][1] + len(payloads[i]) for i in picks}
    gaps = [b - ends[a] for a, b in zip(offsets, offsets[1:])]
    if gaps and max(gaps) > client_disk.GAP_BYTES:
        assert failed is None
        return
    assert failed == ([bad] if 0 <= bad < len(picks) else [])
    assert all(b.tobytes() == payloads[i].tobytes() for k, (i, b) in enumerate(zip(picks, bufs)) if k != bad)
    reader.close()


def test_blocks_that_are_not_such_a_run_are_left_to_read(written, runs_allowed):
    root, where, payloads = written
    reader = DiskReader(str(root))
    picks = [0, 1]
    aligned = [aligned_buffer(len(payloads[i])) for i in picks]
    assert reader.read_run(*_run_args(where, payloads, picks, aligned)) == []
    unaligned = [aligned_buffer(len(payloads[i]) + 64)[16 : 16 + len(payloads[i])] for i in picks]
    assert reader.read_run(*_run_args(where, payloads, picks, unaligned)) is None  # into scratch: read()
    odd = [2, 3]  # 1 and 5000 bytes: tails in scratch
    assert reader.read_run(*_run_args(where, payloads, odd, [aligned_buffer(8192) for _ in odd])) is None
    far = [0, 32]  # records apart by more than GAP_BYTES
    assert reader.read_run(*_run_args(where, payloads, far, [aligned_buffer(len(payloads[i])) for i in far])) is None
    saved = client_disk.ALONE_BYTES, client_disk.RUN_ALONE_BYTES
    client_disk.ALONE_BYTES = client_disk.RUN_ALONE_BYTES = 4096
    try:  # longer than one piece on the caller's thread: the kernel reads it in pieces, the arrays leave it to read()
        longer = reader.read_run(*_run_args(where, payloads, picks, aligned))
        assert longer == ([] if client_disk._compiled.ready() else None)
    finally:
        client_disk.ALONE_BYTES, client_disk.RUN_ALONE_BYTES = saved


@pytest.fixture(params=["gathered", "direct"])
def compiled_pieces(request, monkeypatch):
    """The compiled kernels, and every run longer than a page cut into pieces (``_read_run_pieces``), each piece of
    small blocks gathered through scratch or read straight into its buffers."""
    if not memops_jit.AVAILABLE:
        pytest.skip("the compiled kernels need numba and a CPU with SSE4.2 and PCLMULQDQ")
    client_disk._compiled.warm_up()
    if request.param == "direct":
        monkeypatch.setattr(payload_runs, "GATHER_BLOCK_BYTES", 0)
    monkeypatch.setattr(client_disk, "ALONE_BYTES", 4096)
    monkeypatch.setattr(client_disk, "RUN_ALONE_BYTES", 4096)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    picks=st.lists(st.sampled_from(WHOLE_PAGES), min_size=2, max_size=12, unique=True),
    bad=st.integers(-1, 11),
    threads=st.sampled_from([1, 3]),
    scratch=st.sampled_from([8192, client_disk.SCRATCH_BYTES]),
)
def test_a_run_too_long_for_one_preadv_is_read_in_pieces_and_a_corrupt_block_fails_alone(
    written, compiled_pieces, monkeypatch, picks, bad, threads, scratch
):
    """Pieces of about 64 KiB (``cut_run``), each one compiled ``read_run`` on the caller's or a pool thread; with
    little scratch a piece also ends where its gaps (record headers, other records) would not fit."""
    monkeypatch.setattr(client_disk, "MAX_PIECE_BYTES", 64 << 10)
    monkeypatch.setattr(client_disk, "SCRATCH_BYTES", scratch)
    root, where, payloads = written
    reader = DiskReader(str(root), threads=threads)
    bufs = [aligned_buffer(len(payloads[i])) for i in picks]
    crcs = [crc32c(payloads[i]) ^ (1 if k == bad else 0) for k, i in enumerate(picks)]
    failed = reader.read_run(*_run_args(where, payloads, picks, bufs, crcs))
    offsets = sorted(where[i][1] for i in picks)
    ends = {where[i][1]: where[i][1] + len(payloads[i]) for i in picks}
    if max(b - ends[a] for a, b in zip(offsets, offsets[1:])) > client_disk.GAP_BYTES:
        assert failed is None
        return
    assert failed == ([bad] if 0 <= bad < len(picks) else [])
    assert all(b.tobytes() == payloads[i].tobytes() for k, (i, b) in enumerate(zip(picks, bufs)) if k != bad)
    reader.close()


def test_a_run_past_the_files_end_or_in_a_missing_file_fails_by_position(written, runs_allowed, tmp_path):
    root, where, payloads = written
    picks = [0, 1, 4]  # 4 KiB, 64 KiB, 12 KiB payloads
    name = where[0][0]
    cut = where[1][1] + 8192  # the file ends inside the second payload
    (tmp_path / name).write_bytes((root / name).read_bytes()[:cut])
    reader = DiskReader(str(tmp_path))
    bufs = [aligned_buffer(len(payloads[i])) for i in picks]
    assert reader.read_run(*_run_args(where, payloads, picks, bufs)) == [1, 2]
    assert bufs[0].tobytes() == payloads[0].tobytes()
    args = list(_run_args(where, payloads, picks, bufs))
    args[0] = "seg-0000009999.log"
    assert reader.read_run(*args) == [0, 1, 2]
    reader.close()


# -- read_runs: a prefix whose records lie in several segment files ---------------------------------------------
@pytest.fixture(scope="module")
def written_across(tmp_path_factory) -> tuple[Path, list[tuple[str, int]], list[np.ndarray]]:
    """24 whole-page records in a tier of 192 KiB segments: a prefix of them lies in several files."""
    root = tmp_path_factory.mktemp("nvme-across")
    tier = NvmeTier(root, 1 << 30, segment_bytes=192 << 10)
    rng = np.random.default_rng(11)
    payloads = [rng.integers(0, 256, n, dtype=np.uint8) for n in [4096, 65536, 12288, 8192] * 6]
    metas = [BlockMeta("t", rng.bytes(16), b"", 0, "uint8", len(p), len(p), crc32c(p)) for p in payloads]
    where, pins = tier.extents(tier.write(metas, payloads))
    tier.release_extents(pins)
    tier.close()
    assert all(w is not None for w in where) and len({w[0] for w in where if w is not None}) > 2
    return root, [w for w in where if w is not None], payloads


def _segment_of(name: str) -> int:
    return int(name.removeprefix("seg-").removesuffix(".log"))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(picks=st.lists(st.integers(0, 23), min_size=1, max_size=12, unique=True), bad=st.integers(-1, 11))
def test_runs_in_several_files_come_back_exact_and_a_corrupt_block_fails_alone(
    written_across, runs_allowed, picks, bad
):
    """Each file's blocks are one run, read at once with the other files' on the pool's threads; failures come back
    as the caller's positions, whichever file they lie in."""
    root, where, payloads = written_across
    reader = DiskReader(str(root), threads=3)
    bufs = [aligned_buffer(len(payloads[i])) for i in picks]
    crcs = [crc32c(payloads[i]) ^ (1 if k == bad else 0) for k, i in enumerate(picks)]
    _, positions, offsets, lengths, crc_column, addresses = _run_args(where, payloads, picks, bufs, crcs)
    segments = np.array([_segment_of(where[i][0]) for i in picks], dtype=np.int64)
    failed = reader.read_runs(segments, segment_name, positions, offsets, lengths, crc_column, addresses)
    assert sorted(failed) == ([bad] if 0 <= bad < len(picks) else [])
    assert all(b.tobytes() == payloads[i].tobytes() for k, (i, b) in enumerate(zip(picks, bufs)) if k != bad)
    reader.close()


def test_runs_in_several_files_are_left_to_read_when_one_file_s_blocks_are_not_a_run(written_across, runs_allowed):
    root, where, payloads = written_across
    reader = DiskReader(str(root), threads=2)
    picks = [0, 23]  # first and last record: two files
    segments = np.array([_segment_of(where[i][0]) for i in picks], dtype=np.int64)
    assert segments[0] != segments[1]
    aligned = [aligned_buffer(len(payloads[i])) for i in picks]
    args = _run_args(where, payloads, picks, aligned)[1:]
    assert reader.read_runs(segments, segment_name, *args) == []
    unaligned = [aligned_buffer(len(payloads[i]) + 64)[16 : 16 + len(payloads[i])] for i in picks]
    args = _run_args(where, payloads, picks, unaligned)[1:]
    assert reader.read_runs(segments, segment_name, *args) is None
    empty = np.zeros(0, dtype=np.int64)
    assert reader.read_runs(empty, segment_name, empty, empty, empty, empty, empty) is None  # as read_run's
    reader.close()


def test_runs_in_several_files_wait_for_every_read_when_one_raises(written_across, monkeypatch):
    """A run that raises on the caller's thread leaves no read of another file running into the caller's buffers."""
    root, where, payloads = written_across
    reader = DiskReader(str(root), threads=2)
    picks = [0, 23]
    segments = np.array([_segment_of(where[i][0]) for i in picks], dtype=np.int64)
    bufs = [aligned_buffer(len(payloads[i])) for i in picks]
    args = _run_args(where, payloads, picks, bufs)[1:]
    run, finished = reader._run, []  # noqa: SLF001 - the per-file read this wraps

    def slow_or_failing(name, *a):
        if name == segment_name(int(segments[0])):
            raise OSError("the caller's file")
        time.sleep(0.2)
        finished.append(run(name, *a))
        return finished[-1]

    monkeypatch.setattr(reader, "_run", slow_or_failing)
    with pytest.raises(OSError):
        reader.read_runs(segments, segment_name, *args)
    assert finished == [[]]  # the other file's read had ended before read_runs raised
    reader.close()


def test_runs_in_several_files_each_too_long_for_one_preadv_never_wait_on_the_pool_from_it(
    written_across, compiled_pieces, monkeypatch
):
    """A file's run read on the pool is cut into pieces read on that thread alone: with one pool thread, a run there
    that handed its pieces to the pool too would wait on work queued behind itself, for ever."""
    monkeypatch.setattr(client_disk, "MAX_PIECE_BYTES", 16 << 10)
    monkeypatch.setattr(client_disk, "MIN_PIECE_BYTES", 4096)
    root, where, payloads = written_across
    reader = DiskReader(str(root), threads=2)  # the pool: one thread
    picks = list(range(24))
    segments = np.array([_segment_of(where[i][0]) for i in picks], dtype=np.int64)
    assert len(set(segments.tolist())) > 2
    bufs = [aligned_buffer(len(payloads[i])) for i in picks]
    args = _run_args(where, payloads, picks, bufs)[1:]
    done: list[list[int] | None] = []
    reading = threading.Thread(target=lambda: done.append(reader.read_runs(segments, segment_name, *args)), daemon=True)
    reading.start()
    reading.join(20)
    assert done == [[]], "read_runs waited on its own pool"
    assert all(b.tobytes() == payloads[i].tobytes() for i, b in zip(picks, bufs))
    reader.close()


def test_the_gather_setting_reads_sizes_and_falls_back_on_anything_else(caplog):
    assert payload_runs.gather_block_bytes(None) == payload_runs.GATHER_BLOCK_DEFAULT
    assert payload_runs.gather_block_bytes("0") == 0
    assert payload_runs.gather_block_bytes("256KiB") == 256 << 10
    assert payload_runs.gather_block_bytes("65536") == 64 << 10
    assert payload_runs.gather_block_bytes("lots") == payload_runs.GATHER_BLOCK_DEFAULT
    assert "KVSTORE_GATHER_BLOCK_BYTES" in caplog.text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["open", "delete", "sweep", "close"]), st.integers(0, 5)), max_size=30))
def test_the_table_of_open_files_names_only_open_descriptors(tmp_path_factory, monkeypatch, ops):
    """``SegmentFiles.table`` (what the compiled Get reads descriptors from): each row it fills holds a file open
    now, under its segment id, at the row ``id & (FILE_SLOTS - 1)``, whatever opens (ids that share a row among
    them), evictions past ``MAX_OPEN_FILES``, sweeps of deleted files and closes came before."""
    monkeypatch.setattr(segment_files, "MAX_OPEN_FILES", 3)
    monkeypatch.setattr(segment_files, "SWEEP_SECONDS", 0.0)
    root = tmp_path_factory.mktemp("segments")
    ids = [1, 1 + segment_files.FILE_SLOTS, 2, 3, 4 + 2 * segment_files.FILE_SLOTS, 5]
    files = segment_files.SegmentFiles(str(root))
    for op, k in ops:
        name = segment_name(ids[k])
        if op == "open":
            (root / name).touch()
            assert files.fd(name) >= 0
        elif op == "delete":
            (root / name).unlink(missing_ok=True)
        elif op == "sweep":
            files.sweep_if_due()
        else:
            files.close()
        opened = files.opened()
        for row, (segment, fd) in enumerate(files.table.tolist()):
            if fd >= 0:
                assert row == segment & (segment_files.FILE_SLOTS - 1) and opened[segment_name(segment)] == fd
        if op == "open":  # the file just asked for is listed
            assert files.table[ids[k] & (segment_files.FILE_SLOTS - 1)].tolist() == [ids[k], files.fd(name)]
    files.close()
    assert (files.table == -1).all()
