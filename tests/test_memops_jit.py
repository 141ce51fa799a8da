"""The compiled copy and CRC32C kernels (kvstore/memops_jit.py) against the `crc32c` package and plain copies:
every length (across the 64-byte steps, the 16-byte folds and the byte tail), alignment, starting value, and
the streamed (non-temporal) stores; and the callers' fallback while the kernels are not compiled."""

from __future__ import annotations

import numpy as np
import pytest
from crc32c import crc32c as reference
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import checksum, memops, memops_jit
from kvstore.lanes import segments

pytestmark = [
    pytest.mark.skipif(not memops_jit.AVAILABLE, reason="numba or SSE4.2/PCLMULQDQ missing"),
    pytest.mark.usefixtures("compiled_kernels"),
]

SIZE = 3 << 20  # past STREAM_BYTES, so the streamed stores are exercised
RNG = np.random.default_rng(7)
SOURCE = RNG.integers(0, 256, size=SIZE + 4096, dtype=np.uint8)


def _address(a: np.ndarray) -> int:
    return int(a.ctypes.data)


@settings(max_examples=300, deadline=None)
@given(offset=st.integers(0, 127), n=st.integers(0, 70_000), init=st.integers(0, 2**32 - 1))
def test_crc_matches_the_package_at_any_length_and_alignment(offset: int, n: int, init: int) -> None:
    want = reference(memoryview(SOURCE)[offset : offset + n], init)
    assert memops_jit.crc_at(_address(SOURCE) + offset, n, init) == want


@settings(max_examples=200, deadline=None)
@given(
    src_offset=st.integers(0, 63),
    dst_offset=st.integers(0, 63),
    n=st.one_of(st.integers(0, 5000), st.integers(60_000, 70_000), st.sampled_from([1 << 20, (1 << 20) + 13, SIZE])),
    init=st.integers(0, 2**32 - 1),
)
def test_copy_crc_copies_exactly_the_bytes(src_offset: int, dst_offset: int, n: int, init: int) -> None:
    dst = np.zeros(n + 128, dtype=np.uint8)
    crc = memops_jit.copy_crc_at(_address(SOURCE) + src_offset, _address(dst) + dst_offset, n, init)
    assert crc == reference(memoryview(SOURCE)[src_offset : src_offset + n], init)
    assert np.array_equal(dst[dst_offset : dst_offset + n], SOURCE[src_offset : src_offset + n])
    assert not dst[:dst_offset].any() and not dst[dst_offset + n :].any()  # nothing written around it


def test_streamed_copy_into_aligned_memory() -> None:
    dst = np.zeros(SIZE, dtype=np.uint8)
    assert _address(dst) % 16 == 0
    crc = memops_jit.copy_crc_at(_address(SOURCE), _address(dst), SIZE)
    assert crc == reference(memoryview(SOURCE)[:SIZE]) and np.array_equal(dst, SOURCE[:SIZE])


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.one_of(st.integers(0, 300), st.integers(40_000, 60_000)), min_size=1, max_size=30),
    check=st.booleans(),
    shift=st.integers(0, 15),
)
def test_spans_scatter_and_gather_round_trip(lengths: list[int], check: bool, shift: int) -> None:
    total = sum(lengths)
    pages = np.zeros(total + 16 * len(lengths) + 16, dtype=np.uint8)
    spans, at = [], _address(pages) + shift
    for n in lengths:  # apart from each other, some at unaligned addresses
        spans.append((at, n))
        at += n + 16
    table = np.array(spans, dtype=np.int64).reshape(-1, 2)
    crc = memops_jit.copy_to_spans(_address(SOURCE), table, check)
    assert crc == (reference(memoryview(SOURCE)[:total]) if check else 0)
    base, offset = _address(pages), 0
    for address, n in spans:
        got = pages[address - base : address - base + n]
        assert np.array_equal(got, SOURCE[offset : offset + n])
        offset += n
    back = np.zeros(total, dtype=np.uint8)
    assert memops_jit.gather_spans(_address(back), table, check) == crc
    assert np.array_equal(back, SOURCE[:total])


@settings(max_examples=80, deadline=None)
@given(
    blocks=st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 40_000), min_size=1, max_size=4)), min_size=1, max_size=8
    ),
    check=st.booleans(),
    compiled=st.booleans(),
    library=st.booleans(),
)
def test_rows_copy_or_read_and_chain_each_blocks_crc(
    blocks: list[tuple[bool, list[int]]], check: bool, compiled: bool, library: bool
) -> None:
    """``memops.run_rows`` (the compiled ``copy_rows``, the package a row where it is the faster CRC32C, and the
    fallback alike): a block's rows chain its CRC32C in order, copying rows land exactly their bytes, reading rows
    write nothing; without ``check`` all are 0."""
    total = sum(sum(lengths) for _, lengths in blocks)
    dst = np.zeros(total + 64 * total // 1000 + 64, dtype=np.uint8)
    rows, want, at, to = [], [], 0, 0
    for k, (copies, lengths) in enumerate(blocks):
        crc = 0
        for n in lengths:
            rows.append((_address(SOURCE) + at, _address(dst) + to + 3 if copies else 0, n, k))
            crc = reference(memoryview(SOURCE)[at : at + n], crc)
            at, to = at + n, to + n + 7
        want.append(crc)
    ready, faster = memops_jit.ready, memops_jit._library_faster
    try:
        memops_jit.ready = lambda: compiled  # type: ignore[assignment]
        memops_jit._library_faster = library
        got = memops.run_rows(rows, len(blocks), check)
    finally:
        memops_jit.ready, memops_jit._library_faster = ready, faster  # type: ignore[assignment]
    assert got == (want if check else [0] * len(blocks))
    written = np.zeros_like(dst)
    for src, address, n, _ in rows:
        if address:
            written[address - _address(dst) : address - _address(dst) + n] = SOURCE[src - _address(SOURCE) :][:n]
    assert np.array_equal(dst, written)


def test_the_faster_crc32c_is_measured_once_the_kernels_are_ready() -> None:
    memops_jit.warm_up()
    faster = memops_jit.library_crc_faster()
    assert isinstance(faster, bool) and memops_jit.library_crc_faster() is faster  # measured once, kept


def test_batched_crcs_agree_with_the_package() -> None:
    views = [memoryview(SOURCE)[i * 70_001 : i * 70_001 + n] for i, n in enumerate((0, 1, 64, 65_536, 70_000))]
    assert memops.crcs_of(views) == [reference(v) for v in views]
    assert memops.crcs_of([bytes(v) for v in views]) == [reference(v) for v in views]  # read-only ones too


def test_a_batch_s_addresses_are_taken_once_for_its_crcs_with_and_without_the_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    views = [memoryview(SOURCE)[i * 70_001 : i * 70_001 + n] for i, n in enumerate((0, 1, 64, 65_536, 70_000))]
    table = memops.addresses_of(views)
    assert table.dtype == np.int64 and table.shape == (5, 2) and table[:, 1].tolist() == [0, 1, 64, 65_536, 70_000]
    assert table[1:, 0].tolist() == [_address(SOURCE) + i * 70_001 for i in range(1, 5)]
    for compiled in (True, False):
        monkeypatch.setattr(memops_jit, "ready", lambda compiled=compiled: compiled)
        assert memops.crcs_at(table) == [reference(v) for v in views]
    assert memops.addresses_of([]).shape == (0, 2) and memops.crcs_at(memops.addresses_of([])) == []


def test_callers_use_the_kernels_and_agree_with_the_package() -> None:
    block = memoryview(SOURCE)[: 2 << 20]
    assert checksum.crc32c(block, 5) == reference(block, 5)
    assert checksum.crc32c(bytes(block)) == reference(block)  # read-only buffers too
    dst = memoryview(bytearray(len(block)))
    assert memops.copy_crc(dst, block) == reference(block) and dst == block
    with pytest.raises(ValueError):
        memops.copy_crc(dst[:-1], block)


def test_segments_copy_to_spans_with_and_without_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 64 << 10
    for compiled in (True, False):
        monkeypatch.setattr(memops_jit, "ready", lambda compiled=compiled: compiled)
        pages = np.zeros(3 * n, dtype=np.uint8)
        spans = ((_address(pages) + 2 * n, n), (_address(pages), n))
        crc = segments.copy_to_spans(spans, _address(SOURCE), check=True)
        assert crc == reference(memoryview(SOURCE)[: 2 * n])
        assert np.array_equal(pages[2 * n :], SOURCE[:n]) and np.array_equal(pages[:n], SOURCE[n : 2 * n])
        assert segments.copy_to_spans(spans, _address(SOURCE)) == 0
        region = memoryview(bytearray(2 * n))
        views = [memoryview(pages)[2 * n :], memoryview(pages)[:n]]
        assert segments.gather(region, views, crc=True, spans=spans) == crc
        assert region == memoryview(SOURCE)[: 2 * n]


def test_the_wide_loop_is_used_where_the_cpu_has_vpclmulqdq() -> None:
    from kvstore import memops_kernels

    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    assert memops_kernels.WIDE == ({"avx2", "vpclmulqdq"} <= flags)


@settings(max_examples=100, deadline=None)
@given(
    offset=st.integers(0, 63),
    n=st.one_of(st.integers(0, 1000), st.integers(60_000, 70_000)),
    init=st.integers(0, 2**32 - 1),
    write=st.sampled_from(["read", "store", "stream"]),
)
def test_both_loops_agree_with_the_package_read_or_copying(offset: int, n: int, init: int, write: str) -> None:
    """The wide loop (with the 64-byte loop for its last bytes) and the 64-byte loop alone, which a CPU without
    VPCLMULQDQ runs for every length: the same CRC32C and the same bytes copied, into 32-byte aligned memory."""
    from kvstore import memops_kernels as k

    mode = {"read": k.READ, "store": k.STORE, "stream": k.STREAM}[write]
    src = _address(SOURCE) + offset
    want = reference(memoryview(SOURCE)[offset : offset + n], init)
    for kernel in (k.copy_crc, k.copy_crc_narrow):
        dst = np.zeros(n + 96, dtype=np.uint8)
        at = (32 - _address(dst) % 32) % 32
        assert kernel(src, _address(dst) + at if mode != k.READ else 0, n, init, mode) == want
        if mode != k.READ:
            assert np.array_equal(dst[at : at + n], SOURCE[offset : offset + n])
            assert not dst[:at].any() and not dst[at + n :].any()
